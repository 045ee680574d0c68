"""`prefixq bench --fleet` (bench/fleet_cases.py): the zipf workload, how a run's engine-busy
time and ideal end are computed, the flag's errors, the workers' steal switch, and the two cases
end to end on two real CPU workers (the lose case kills one -9)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from helpers import cli
from prefixq.bench.command import _fleet
from prefixq.bench.fleet_cases import busy_seconds, run_view
from prefixq.bench.workloads import Shape, Sizes, build, zipf_counts
from prefixq.cli.redis_server import RedisServer
from prefixq.core.errors import ConfigError
from prefixq.core.result_record import Result, Timings
from prefixq.core.settings import Settings
from prefixq.store.connection import async_client
from prefixq.worker.fleet import FleetWatch

IDS = Shape(doc_tokens=64, question_tokens=8, output_tokens=4, token_ids=True)


@pytest.mark.parametrize(("docs", "total", "exp"), [(64, 1536, 1.0), (10, 95, 1.5), (8, 3, 1.0)])
def test_zipf_counts_split_the_total_by_rank_and_give_every_document_one(
    docs: int, total: int, exp: float
) -> None:
    """Each document gets at least one request, the counts add up to the total (or to one per
    document when the total is smaller), and they never grow with the rank."""
    c = zipf_counts(docs, total, exp)
    assert len(c) == docs and min(c) >= 1 and sum(c) == max(total, docs)
    assert c == sorted(c, reverse=True)


def test_the_zipf_workload_has_one_path_per_request_and_groups_of_zipf_sizes() -> None:
    wl = build("zipf", IDS, Sizes(documents=6, zipf_requests=40))
    sizes = sorted((wl.paths.count(p) for p in set(wl.paths)), reverse=True)
    assert sizes == zipf_counts(6, 40, 1.0) and len(wl.requests) == 40
    assert len({q["id"] for q in wl.requests}) == 40


def test_busy_seconds_is_the_union_of_the_intervals() -> None:
    assert busy_seconds([]) == 0
    assert busy_seconds([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)


def test_a_run_view_counts_each_worker_busy_time_share_and_the_ideal_end() -> None:
    """Two workers busy 4 s and 1 s: the ideal end is 2.5 s; a burst that ended at 5 s took
    twice the ideal."""

    def res(i: int, worker: str, a: float, b: float) -> Result:
        return Result(id=f"r{i}", index=i, worker=worker, timings=Timings(admitted=a, finished=b))

    got = [res(0, "w0", 100, 103), res(1, "w0", 102, 104), res(2, "w1", 100, 101)]
    v = run_view(100.0, 105.0, got, ["w0", "w1"], {"steal": 1})
    assert v["busy_s"] == {"w0": 4.0, "w1": 1.0} and v["ideal_s"] == 2.5
    assert v["end_over_ideal"] == 2.0 and v["share"] == {"w0": 2, "w1": 1}


def test_the_fleet_flag_names_its_cases_and_needs_two_shards() -> None:
    assert _fleet("lose,steal", 2) == ["steal", "lose"]  # lose runs last: it kills a worker
    assert _fleet("", 1) == []
    with pytest.raises(ConfigError, match="unknown swap"):
        _fleet("steal,swap", 2)
    with pytest.raises(ConfigError, match="two shards"):
        _fleet("steal", 1)


def test_the_steal_switch_turns_steals_off_and_back_to_the_setting() -> None:
    """steal:off stops steals; steal:on restores the setting, or its default where it was 0."""
    for setting, on in ((1000, 1000), (0, Settings().steal_min_tokens)):
        s = Settings(steal_min_tokens=setting)
        w = FleetWatch(async_client(s), s, shard=0, name="w")  # makes no call
        cmds = w.commands()
        asyncio.run(cmds["steal:off"]())
        assert w.steal_min_tokens == 0
        asyncio.run(cmds["steal:on"]())
        assert w.steal_min_tokens == on


@pytest.mark.engine
def test_the_fleet_cases_run_on_two_cpu_workers_and_the_lost_worker_loses_nothing(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Given --quick --fleet steal,lose on two CPU shards: a run with steals off and one with
    them on, each with every worker's busy time and an ideal end; then the last worker killed
    -9 at a quarter of the burst, its queue moved (orphaned) to the live one, and every request
    answered exactly once; the table and a PNG plot are written."""
    out, png = tmp_path / "fleet.json", tmp_path / "fleet.png"
    p = cli(
        None, "bench", "--quick", "--cpu", "2", "--workloads", "none", "--fleet", "steal,lose",
        "--zipf-requests", "40", "--heartbeat-s", "0.5", "--heartbeat-ttl-s", "3",
        "--orphan-after-s", "4", "--json", str(out), "--plot", str(png),
        url=redis_server.url, timeout=900,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-4000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "end / ideal" in p.stderr
    rep = json.loads(out.read_text())
    assert rep["workloads"] == {} and "kv_tokens" not in rep["environment"]  # no standalone
    f = rep["fleet"]
    assert f["workload"] == "zipf" and sum(f["group_sizes"]) == f["requests"]
    steal = f["steal"]
    assert sorted(r["mode"] for r in steal["runs"]) == ["off", "on"]
    for r in steal["runs"]:
        assert sum(r["share"].values()) == f["requests"]
        assert r["ideal_s"] == pytest.approx(sum(r["busy_s"].values()) / 2, abs=0.01)
        assert 0 < r["ideal_s"] <= r["seconds"] and r["end_over_ideal"] >= 1
    lose = f["lose"]
    assert lose["killed"] == "bench-s1" and lose["exactly_once"]
    assert lose["results"] == lose["distinct"] == f["requests"]
    assert lose["steals"].get("orphaned", 0) > 0  # its queue moved to the live worker
    assert lose["share"]["bench-s0"] > f["requests"] // 2
    assert lose["kill_to_last_s"] > 0 and lose["ideal_with_detection_s"] == pytest.approx(
        lose["ideal_s"] + 4
    )


def test_the_plan_counts_the_fleet_runs_and_only_the_workers_engines() -> None:
    """--plan with --workloads none --fleet steal,lose: 2 runs a pair for steal, one for lose
    (with the wait before its move), and no standalone engine to start."""
    from prefixq.bench.plan import estimate
    from prefixq.bench.runner import BenchConfig

    cfg = BenchConfig(model="m", gpus=["0", "0"], workloads=[], fleet=["steal", "lose"], pairs=2)
    plan = estimate(cfg, 131072, orphan_after_s=15.0)
    steal, lose = plan["cases"]
    assert (steal["workload"], steal["pairs"], lose["workload"]) == ("fleet/steal", 4, "fleet/lose")
    assert plan["engines"] == 2 and lose["seconds"] > lose["run_s"]["pipeline"] + 15.0
