"""One case of the benchmark: a workload's bursts, one placement and enqueue order, run in pairs
through the pipeline and through each standalone set-up (bench/setups.py), in an order that
rotates from pair to pair.

Before every run both sides' prefix caches are reset and the pipeline's placement state (prefix
map, load counters, stored prefixes) is cleared, so each run is a cold, identical burst. The
standalone engines get the very shard assignment that the pipeline's producer computes on an
empty map (the same `Producer`, into a scratch namespace, entries read back); each pipeline run
checks that its requests landed there. A workload of several bursts (multi-burst) submits each
at its arrival, under its tenant; the standalone set-ups add each burst's requests when it
arrives.
"""

from __future__ import annotations

import asyncio
import secrets
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aredis

from prefixq.bench.engine_set import Engines
from prefixq.bench.measures import optimum_cached, pair_ratios, setup_summary, shares, strongest
from prefixq.bench.setups import GIVEN, MODE_OF, SORTED, sorted_order
from prefixq.bench.timeline import Stamp, gaps, medians, timeline, worker_stats
from prefixq.bench.workloads import Workload
from prefixq.client import Producer
from prefixq.client import results as results_api
from prefixq.core import wire
from prefixq.core.entries import Entry
from prefixq.core.errors import SetupError
from prefixq.core.keys import FIELD, Keys
from prefixq.core.records import Request
from prefixq.core.settings import Settings
from prefixq.store.connection import async_client
from prefixq.worker import control

Step = Any  # Callable[[str], None]


@dataclass
class Env:
    """What every run needs: settings, Redis, the engines of each set-up, the workers, one
    `Producer` (kept connection) and a progress callback."""

    s: Settings
    r: aredis.Redis
    engines: dict[str, Engines]
    workers: Any
    producer: Producer
    say: Step
    block: int = 16
    #: called after each case with the report so far (`prefixq bench --json` keeps it beside
    #: the report's path: a run cut short keeps the cases it finished)
    saved: Callable[[], None] = lambda: None
    #: called after each run of a case with its label and the runs so far (None: the case is
    #: done), so that the report so far keeps the runs of a case a lost machine cut short
    ran: Callable[[str, list[dict[str, Any]] | None], None] = lambda _label, _runs: None

    @property
    def keys(self) -> Keys:
        return self.s.keys


@dataclass
class Bursts:
    """A workload's bursts as validated requests, with their tenants and arrivals."""

    wl: Workload
    reqs: list[list[Request]]

    @property
    def flat(self) -> list[Request]:
        return [q for b in self.reqs for q in b]

    @property
    def burst_of(self) -> list[int]:
        return [k for k, b in enumerate(self.reqs) for _ in b]

    @property
    def arrivals(self) -> list[float]:
        return [b.at for b in self.wl.bursts]

    @property
    def at(self) -> list[float] | None:
        """Each request's arrival, or None when everything arrives at once."""
        if len(self.reqs) == 1 and not self.wl.bursts[0].at:
            return None
        return [self.wl.bursts[k].at for k in self.burst_of]


async def run_case(
    env: Env, b: Bursts, placement: str, order: str, pairs: int, setups: list[str]
) -> dict[str, Any]:
    """``pairs`` rounds of the pipeline and every set-up in ``setups``; the summary."""
    expected = await assignment(env.s, b.reqs, placement, order)
    flat_shards = [k for shards in expected for k in shards]
    flat, at = b.flat, b.at
    by_order = sorted_order(b.reqs) if SORTED in setups else None
    modes = [MODE_OF[x] for x in setups] + ["pipeline"]
    runs: list[dict[str, Any]] = []
    gc_max: dict[str, float] = {}
    stats: dict[str, dict[str, Any]] = {}
    for pair in range(pairs):
        k = pair % len(modes)
        for mode in modes[k:] + modes[:k]:
            env.say(f"{b.wl.name} / {placement} / {order} / pair {pair + 1}/{pairs}: {mode}")
            await reset(env)
            if mode == "pipeline":
                t0, t1, run, stats = await pipeline(env, b, placement, order, expected)
                for name, st in stats.items():
                    gc_max[name] = max(gc_max.get(name, 0.0), float(st["gc_max_pause_ms"]))
            else:
                setup = next(x for x in setups if MODE_OF[x] == mode)
                eng = env.engines[setup]
                perm = by_order if setup == SORTED else None
                t0, t1, stamps = await eng.run(flat, flat_shards, at, perm)
                run = {"timeline": timeline(t0, t1, stamps)}
                if len(b.reqs) > 1:
                    done = [x.finished - t0 for x in stamps]
                    run["shares"] = shares(b.burst_of, done, b.arrivals)
            runs.append(
                {
                    "pair": pair,
                    "mode": mode,
                    "seconds": round(t1 - t0, 4),
                    "throughput": round(len(flat) / (t1 - t0), 4),
                    **run,
                }
            )
            env.ran(f"{b.wl.name} / {placement} / {order}", runs)
    env.ran("", None)
    names = env.workers.names
    summary = summarise(runs, modes)
    summary["optimum_cached_tokens"] = optimum_cached(
        b.wl.paths, b.wl.depth, flat_shards, env.block
    )
    summary["optimum_one_engine"] = optimum_cached(
        b.wl.paths, b.wl.depth, [0] * len(flat), env.block
    )
    summary["optimum_exact"] = b.wl.exact
    opt = summary["optimum_cached_tokens"]
    summary["cached_share"] = {
        m: round(tl["cached_tokens"] / opt, 4) if opt and tl.get("cached_tokens") else None
        for m, tl in summary["timeline"].items()
        if m != "gap_ms"
    }
    summary["order"] = order
    summary["gc_max_pause_ms_frozen"] = [gc_max.get(n, 0.0) for n in names]
    summary["gc_frozen_by_gen"] = by_gen(stats, names) if stats else []
    # each worker's KV budget in the last pipeline run: the share it ran at, and whether
    # requests waited for it (a case's admission, or the settings' budget, shown to be on)
    summary["kv_budget"] = [
        {k: v for k, v in stats[n].items() if k.startswith("kv_budget_")}
        for n in names
        if n in stats
    ]
    return summary


def summarise(runs: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    """Medians per mode, the pipeline against standalone as given (``ratios``, as before set-ups
    existed; against the first set-up measured when "given" was not: ``ratios_vs``) and against
    every set-up (``setups``), and the strongest set-up. Without standalone engines
    (``--standalone none``) the pipeline's own figures, the ratios None."""
    standalone = [m for m in modes if m != "pipeline"]
    setups = {m: setup_summary(runs, m) for m in standalone}
    best = strongest(setups)
    base = MODE_OF[GIVEN] if MODE_OF[GIVEN] in modes else next(iter(standalone), None)
    pipe_runs = [x for x in runs if x["mode"] == "pipeline"]
    ratios = pair_ratios(runs, base) if base else []
    tl: dict[str, Any] = {m: medians(runs, m) for m in modes}
    tl["gap_ms"] = gaps(tl["pipeline"], tl[base]) if base else {}
    out: dict[str, Any] = {
        "runs": runs,
        "modes": modes,
        "ratios_vs": base,
        "standalone": {"median_throughput": setups[base]["median_throughput"] if base else None},
        "pipeline": {"median_throughput": statistics.median(x["throughput"] for x in pipe_runs)},
        "ratios": ratios,
        "median_ratio": round(statistics.median(ratios), 4) if ratios else None,
        "min_ratio": min(ratios) if ratios else None,
        "setups": setups,
        "strongest": best,
        "vs_strongest": setups[best]["median_ratio"] if best else None,
        "raw_bytes": pipe_runs[0]["raw_bytes"] if pipe_runs else 0,
        "stored_bytes": pipe_runs[0]["stored_bytes"] if pipe_runs else 0,
        "entry_bytes": pipe_runs[0]["entry_bytes"] if pipe_runs else 0,
        "timeline": tl,
    }
    if any("shares" in x for x in runs):
        out["shares"] = {m: [x["shares"] for x in runs if x["mode"] == m] for m in modes}
        out["max_share_ratio"] = {m: _worst(out["shares"][m]) for m in modes}
    return out


def _worst(runs: list[dict[str, Any] | None]) -> float | None:
    """The largest completion ratio of ``runs`` (None if a run's bursts never overlapped)."""
    ratios = [x["ratio"] if x else None for x in runs]
    return None if not ratios or None in ratios else max(r for r in ratios if r is not None)


async def pipeline(
    env: Env, b: Bursts, placement: str, order: str, expected: list[list[int]]
) -> tuple[float, float, dict[str, Any], dict[str, dict[str, Any]]]:
    """One pipeline run of every burst (each submitted at its arrival, under its tenant):
    (start, end, its record, the workers' stats of it)."""
    s, names = env.s, env.workers.names
    await control.send(env.r, env.keys, "reset_stats", names)
    t0 = time.time()

    async def submit(k: int) -> str:
        delay = t0 + b.wl.bursts[k].at - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        burst = b.wl.bursts[k]
        tenant = burst.tenant if len(b.reqs) > 1 else None
        return await env.producer.asubmit(
            b.reqs[k],
            placement=placement,
            seed=1,
            order=order,
            tenant=tenant,
            priority=burst.priority,
        )

    ids = await asyncio.gather(*(submit(k) for k in range(len(b.reqs))))
    sts = [await asyncio.to_thread(results_api.wait, x, s, timeout=3600) for x in ids]
    t1 = time.time()
    failed = sum(st.failed for st in sts)
    got = [await asyncio.to_thread(results_api.collect, x, s) for x in ids]
    if failed:
        why = next((x.error for results in got for x in results if x.error), None)
        raise SetupError(
            f"pipeline run: {failed} of {len(b.flat)} requests failed (the first: {why})"
        )
    recorded = None
    for x in ids:
        last = await env.r.xrevrange(env.keys.events(x), count=1)
        if last:
            ms = int(last[0][0].split(b"-")[0]) / 1000
            recorded = ms if recorded is None else max(recorded, ms)
    stats = await control.send(env.r, env.keys, "stats", names)
    stamps = [
        Stamp(x.timings.admitted, x.timings.first_token, x.timings.finished, x.prompt_tokens,
              x.cached_tokens)
        for results in got for x in results
    ]  # fmt: skip
    metas = [st.meta for st in sts]
    record: dict[str, Any] = {
        "failed": failed,
        "raw_bytes": sum(int(m["raw_bytes"]) for m in metas),
        "stored_bytes": sum(int(m["encoded_bytes"]) for m in metas),
        "entry_bytes": sum(int(m["entry_bytes"]) for m in metas),
        "per_shard": " ".join(m.get("per_shard", "") for m in metas),
        "placement_mismatches": sum(
            1 for k, results in enumerate(got) for x in results if x.shard != expected[k][x.index]
        ),
        "timeline": timeline(t0, t1, stamps, recorded) | worker_stats(stats),
    }
    if len(b.reqs) > 1:
        done = [x.finished - t0 for x in stamps]
        record["shares"] = shares(b.burst_of, done, b.arrivals)
    return t0, t1, record, stats


async def reset(env: Env) -> None:
    """Cold caches and a fresh placement state before every run."""
    keys = env.keys
    for eng in env.engines.values():
        await eng.reset_prefix_cache()
    await control.send(env.r, keys, "reset_prefix_cache", env.workers.names)
    stale = [k async for k in env.r.scan_iter(match=keys.prefix("*"), count=1000)]
    stale += [keys.pass_marks(k, w) for k in range(env.s.shards) for w in env.workers.names]
    await env.r.delete(
        keys.prefix_map, keys.prefix_map_old, keys.load, keys.pass_order, keys.pass_shards, *stale
    )


async def assignment(
    s: Settings, bursts: list[list[Request]], placement: str, order: str
) -> list[list[int]]:
    """The shard of each request of each burst as the pipeline's producer places them, burst
    after burst, starting from an empty map: the real `Producer`, into a scratch namespace (same
    shard count and engine block), entries read back."""
    scratch = s.replace(namespace=f"{s.namespace}-scr{secrets.token_hex(3)}")
    keys, real = scratch.keys, s.keys
    r = async_client(scratch)
    out: list[list[int]] = []
    try:
        block = await r.hget(real.config, "block_size")
        await r.hset(keys.config, mapping={"shards": s.shards, "block_size": block or 0})
        for reqs in bursts:
            burst = await Producer(scratch).asubmit(reqs, placement=placement, seed=1, order=order)
            shards = [-1] * len(reqs)
            for k in range(s.shards):  # the head in the intake stream, the rest in its lane
                for stream in (keys.intake(k, scratch.priority), keys.lane(k, burst)):
                    for _, fields in await r.xrange(stream):
                        e = Entry.from_wire(wire.decode(fields[FIELD]))
                        if e.burst == burst:
                            shards[e.index] = k
            if -1 in shards:
                raise SetupError(f"placement: {shards.count(-1)} requests not in the streams")
            out.append(shards)
        stale = [x async for x in r.scan_iter(match=f"{scratch.namespace}:*", count=1000)]
        if stale:
            await r.delete(*stale)
    finally:
        await r.aclose()
    return out


def by_gen(stats: dict[str, dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Per worker: the worst pause (ms) and the number of collections of each generation."""
    return [
        {
            "max_pause_ms": stats[n]["gc_max_pause_ms_by_gen"],
            # the worst in the collecting thread's CPU time (a preempted collection is not long)
            "max_pause_cpu_ms": stats[n].get("gc_max_pause_cpu_ms"),
            "collections": stats[n]["gc_pauses_by_gen"],
            # collections in idle time (worker/gc_policy.py): no request waits on them
            "idle_collections": stats[n]["gc_idle_collections"],
            "idle_max_ms": stats[n]["gc_idle_max_ms"],
            # its longest single step, which the event loop waits for: what a burst arriving
            # meanwhile waits at most (the whole heap is one step); and the idle collections
            # stopped between steps because work arrived
            "idle_max_step_ms": stats[n].get("gc_idle_max_step_ms"),
            "idle_postponed": stats[n].get("gc_idle_postponed"),
            # what the last whole-heap collection freed (-1: none yet), and the requests frozen
            # before the next one (spaced by the garbage found)
            "whole_heap_freed": stats[n].get("gc_whole_heap_freed"),
            "whole_heap_skipped": stats[n].get("gc_whole_heap_skipped"),
            "whole_heap_after": stats[n].get("gc_whole_heap_after"),
            "heap_blocks": stats[n].get("gc_heap_blocks"),
            "heap_growth_needed": stats[n].get("gc_heap_growth_needed"),
            "heap_growth": stats[n].get("gc_heap_growth"),
            "heap_known": stats[n].get("gc_heap_known"),
        }
        for n in names
    ]
