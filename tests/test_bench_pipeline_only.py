"""`prefixq bench --standalone none`: the pipeline's runs alone, for a GPU that cannot hold the
standalone engines beside the workers' (issue 36's two shards on one GPU: four engines' weights).
End to end on two CPU shards of the simulated engine (bench/sim_engine.py: vLLM's own scheduler
and block pool on a modelled clock), against a real redis-server; what is checked is the
report's shape and sizing, never a speed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from helpers import cli
from prefixq.bench.plan import estimate
from prefixq.bench.runner import BenchConfig
from prefixq.cli.redis_server import RedisServer

#: 1 GiB of KV cache of the Llama-3.1-8B shape: 8,192 tokens per engine
KV_BYTES = 1 << 30
#: a clock a hundred times faster than an H200's (tests/test_sim_engine.py)
FAST = ("sim_step_ms=0.05", "sim_token_us=0.2", "sim_context_ns=0")


def _alone(
    url: str, *more: str, cpu: int = 1, model_len: int = 8192, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``prefixq bench --standalone none`` on ``cpu`` simulated engines of `KV_BYTES` on the
    `FAST` clock, with ``more`` flags; the finished process."""
    engine = [f"max_model_len={model_len}", f"kv_cache_memory_bytes={KV_BYTES}", *FAST]
    flags = [x for a in engine for x in ("--engine-arg", a)]
    base = ["bench", "--model", "sim:llama-3.1-8b", "--cpu", str(cpu), "--standalone", "none"]
    return cli(None, *base, *flags, *more, url=url, timeout=timeout)


@pytest.mark.engine
def test_the_pipeline_alone_is_sized_from_its_workers_engines_and_reports_no_ratios(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Given two shards and no standalone engines, the workloads are sized from the KV caches
    the workers' engines state (multi-burst's documents hold three times both caches), every run
    is a pipeline run, the cached prompt tokens are set against the optimum, the ratios to a
    standalone engine are absent (None, not 0 or a made-up figure), and the table and the plot
    are written all the same."""
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    more = ("--workloads", "multi-burst", "--pairs", "1", "--json", str(out), "--plot", str(png))
    p = _alone(redis_server.url, *more, cpu=2, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "multi-burst" in p.stderr and "of the optimum" in p.stderr  # the table
    report = json.loads(out.read_text())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["config"]["standalone"] == "none"
    kv = report["environment"]["kv_tokens"]
    assert set(kv) == {"workers"} and len(kv["workers"]) == 2
    assert kv["workers"][0] == kv["workers"][1] == KV_BYTES // 131_072  # 128 KiB a token
    wl = report["workloads"]["multi-burst"]
    assert wl["kv_capacity_tokens"] == sum(kv["workers"])
    assert wl["corpus_over_capacity"] >= 2.5  # sized to 3x the two caches
    case = wl["placements"]["affinity"]
    assert [r["mode"] for r in case["runs"]] == ["pipeline"]
    assert case["modes"] == ["pipeline"] and case["setups"] == {}
    assert case["ratios"] == [] and case["median_ratio"] is None and case["min_ratio"] is None
    assert case["standalone"]["median_throughput"] is None
    assert case["pipeline"]["median_throughput"] > 0
    assert 0 < case["cached_share"]["pipeline"] <= 1
    assert set(case["cached_share"]) == {"pipeline"}
    # each burst asks the same documents: affinity sends each burst's questions to the same
    # shards (the split against the scratch assignment, `placement_mismatches`, feeds no
    # standalone engine here and varies with how fast this clock drains the queues)
    splits = case["runs"][0]["per_shard"].split()
    assert len(splits) == 3 and len(set(splits)) == 1, splits
    assert all(int(n) > 0 for n in splits[0].split(","))  # both shards have work
    assert len(case["runs"][0]["shares"]["completed"]) == 3  # three tenants' bursts


def test_standalone_set_ups_without_standalone_engines_are_a_clear_error(
    redis_server: RedisServer,
) -> None:
    """``--standalone none --setups sorted``: refused before anything starts, naming both."""
    p = _alone(redis_server.url, "--setups", "multi-burst:sorted")
    assert p.returncode != 0
    assert "--setups multi-burst:sorted" in p.stderr and "--standalone none" in p.stderr


def test_the_plan_of_the_pipeline_alone_counts_only_its_runs_and_its_engines() -> None:
    """``--plan``: one engine per shard (the workers'), and every case's runs the pipeline's."""
    both = BenchConfig(
        model="fake", gpus=["0", "0"], workloads=["multi-burst", "no-reuse"], pairs=2
    )
    alone = BenchConfig(
        model="fake", gpus=["0", "0"], workloads=["multi-burst", "no-reuse"], pairs=2,
        standalone="none",
    )  # fmt: skip
    a, b = estimate(alone, 65_536), estimate(both, 65_536)
    assert a["engines"] == 2 and b["engines"] == 4
    assert [set(c["run_s"]) for c in a["cases"]] == [{"pipeline"}, {"pipeline"}]
    assert a["runs_s"] < b["runs_s"] and a["start_s"] < b["start_s"]


@pytest.mark.engine
def test_a_run_whose_requests_all_fail_says_why(redis_server: RedisServer) -> None:
    """Documents longer than the engine's ``max_model_len``: the bench stops with the count and
    the first request's reason (before: the count alone, the reason only in Redis)."""
    more = ("--workloads", "no-reuse", "--requests", "2", "--pairs", "1")
    p = _alone(redis_server.url, *more, model_len=1024, timeout=300)
    assert p.returncode != 0
    assert "2 of 2 requests failed (the first: prompt of" in p.stderr, p.stderr[-2000:]
    assert "exceeds max_model_len 1024" in p.stderr
