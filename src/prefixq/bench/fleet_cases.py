"""`prefixq bench --fleet`: the elastic fleet on the benchmark's own workers (worker/fleet.py).

The cases run a workload whose prefix groups differ widely in size (``zipf``, bench/workloads.py)
through the pipeline only; nothing here has a standalone twin:

- ``steal``: the burst with the workers' tail stealing off and on (control commands
  ``steal:off`` / ``steal:on``), in ``pairs`` pairs whose order rotates. Per run: the burst's end
  (first enqueue to the last result), each worker's engine-busy seconds (the union of its
  requests' ``[admitted, finished]`` intervals), its share of the requests, the steals (the moves
  totals), and the **ideal end**: total engine-busy seconds / engines, the end a perfectly even
  split of the same work would have; ``end_over_ideal`` is the burst's end against it.
- ``lose``: the burst once more, stealing on; when a quarter of its results are in, the last
  worker and its engine are killed -9 (a preempted GPU) and not restarted, so this case runs last.
  Its shard is orphaned after the workers' ``orphan_after_s``; the live workers move its queue
  (and reclaim what was in flight on it). Reports whether every request has exactly one result,
  the kill to the last result, what moved, and the ideal: with ``W`` the median total engine-busy
  seconds of the steal-on runs (else of this burst's work as measured here) and ``n`` engines,
  the engines have done ``n * t_kill`` of it by the kill and the ``n - 1`` left do the rest:
  ``t_kill + (W - n * t_kill) / (n - 1)``; ``ideal_with_detection_s`` adds ``orphan_after_s``,
  the wait the design chooses before it calls a worker lost.

Engine-busy seconds count an engine as busy whenever it holds a request, however few: a tail
that one engine serves alone at a small batch counts in full, so the ideal is the end of a
perfectly balanced fleet only as far as batch size does not change an engine's speed. On two
engines that share one GPU (``--gpus 0,0``) an engine alone also runs faster than beside the
other; docs/BENCHMARKS.md reads the figures with both in mind.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from prefixq.bench.cases import Env, reset
from prefixq.bench.engines import Workers
from prefixq.bench.workloads import Workload
from prefixq.client import results as results_api
from prefixq.core.errors import SetupError
from prefixq.core.inputs import normalize
from prefixq.core.records import Request
from prefixq.core.result_record import Result
from prefixq.store.move_log import parse_totals
from prefixq.worker import control

FLEET_CASES = ("steal", "lose")
#: the share of the burst's results in before ``lose`` kills a worker
KILL_AT = 0.25


def busy_seconds(spans: list[tuple[float, float]]) -> float:
    """The length of the union of ``[start, end]`` intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def run_view(
    t0: float, t1: float, got: list[Result], names: list[str], steals: dict[str, int]
) -> dict[str, Any]:
    """One run's figures from its results (see the module's docstring)."""
    spans: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for x in got:
        if x.timings.admitted > 0 and x.timings.finished >= x.timings.admitted:
            spans.setdefault(x.worker, []).append((x.timings.admitted, x.timings.finished))
    busy = {n: round(busy_seconds(v), 3) for n, v in spans.items()}
    engines = len(names)
    ideal = sum(busy.values()) / engines if engines else 0.0
    end = t1 - t0
    return {
        "seconds": round(end, 3),
        "throughput": round(len(got) / end, 4) if end > 0 else None,
        "busy_s": busy,
        "engine_seconds": round(sum(busy.values()), 3),
        "ideal_s": round(ideal, 3),
        "end_over_ideal": round(end / ideal, 4) if ideal > 0 else None,
        "share": {n: sum(1 for x in got if x.worker == n) for n in spans},
        "cached_tokens": sum(x.cached_tokens for x in got),
        "steals": steals,
    }


async def run_fleet(env: Env, wl: Workload, cases: list[str], pairs: int) -> dict[str, Any]:
    """The asked ``cases`` (`FLEET_CASES`, ``lose`` last, two workers or more: checked by the
    command) on ``wl``'s one burst."""
    reqs = normalize(wl.bursts[0].requests, env.s)
    out: dict[str, Any] = {"workload": wl.name, "requests": len(reqs), "documents": wl.documents}
    out["group_sizes"] = _group_sizes(wl)
    if "steal" in cases:
        out["steal"] = await _steal_case(env, reqs, pairs)
    if "lose" in cases:
        on = out.get("steal", {}).get("on", {})
        out["lose"] = await _lose_case(env, reqs, on.get("median_engine_seconds"))
    return out


def _group_sizes(wl: Workload) -> list[int]:
    counts: dict[tuple[str, ...], int] = {}
    for p in wl.paths:
        counts[p] = counts.get(p, 0) + 1
    return sorted(counts.values(), reverse=True)


async def _steal_case(env: Env, reqs: list[Request], pairs: int) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    modes = ("off", "on")
    names = env.workers.names
    for pair in range(pairs):
        for mode in modes[pair % 2 :] + modes[: pair % 2]:
            env.say(f"fleet / steal {mode} / pair {pair + 1}/{pairs}")
            await control.send(env.r, env.keys, f"steal:{mode}", names)
            t0, t1, got, steals = await _one_run(env, reqs)
            runs.append({"pair": pair, "mode": mode, **run_view(t0, t1, got, names, steals)})
    await control.send(env.r, env.keys, "steal:on", names)
    out: dict[str, Any] = {"runs": runs}
    for mode in modes:
        mine = [x for x in runs if x["mode"] == mode]
        out[mode] = {
            "median_seconds": round(statistics.median(x["seconds"] for x in mine), 3),
            "median_ideal_s": round(statistics.median(x["ideal_s"] for x in mine), 3),
            "median_end_over_ideal": _median([x["end_over_ideal"] for x in mine]),
            "median_engine_seconds": round(statistics.median(x["engine_seconds"] for x in mine), 3),
        }
    off, on = out["off"]["median_seconds"], out["on"]["median_seconds"]
    out["on_over_off"] = round(on / off, 4) if off else None
    return out


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return round(statistics.median(vals), 4) if vals else None


async def _steal_totals(env: Env) -> dict[str, int]:
    totals = parse_totals(await env.r.hgetall(env.keys.move_totals))
    return {why: t["requests"] for why, t in totals.items()}


async def _one_run(
    env: Env, reqs: list[Request], during: Any = None
) -> tuple[float, float, list[Result], dict[str, int]]:
    """One pipeline run of the burst (affinity placement, the default order) from a cold start:
    (start, end, its results, requests moved by why during it). ``during(burst_id, t0)``, when
    given, runs beside the wait (the lose case's kill)."""
    await reset(env)
    before = await _steal_totals(env)
    t0 = time.time()
    burst = await env.producer.asubmit(reqs, placement="affinity", seed=1)
    side = asyncio.create_task(during(burst, t0)) if during is not None else None
    st = await asyncio.to_thread(results_api.wait, burst, env.s, timeout=3600)
    t1 = time.time()
    if side is not None:
        await side
    if st.failed:
        raise SetupError(f"fleet run: {st.failed} of {len(reqs)} requests failed")
    got = await asyncio.to_thread(results_api.collect, burst, env.s)
    after = await _steal_totals(env)
    moved = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
    return t0, t1, got, moved


async def _lose_case(env: Env, reqs: list[Request], work: float | None) -> dict[str, Any]:
    workers: Workers = env.workers
    names = list(workers.names)
    victim = len(names) - 1
    await control.send(env.r, env.keys, "steal:on", names)
    kill: dict[str, float] = {}

    async def kill_at_quarter(burst: str, t0: float) -> None:
        want = max(1, int(KILL_AT * len(reqs)))
        while (await results_api.astatus(burst, env.s)).done < want:  # noqa: ASYNC110 -- polls Redis
            await asyncio.sleep(0.1)
        workers.kill(victim)
        kill["t"] = time.time() - t0
        env.say(f"fleet / lose: {names[victim]} killed -9 at {kill['t']:.1f} s")

    env.say("fleet / lose: one run, a worker killed at a quarter of the results")
    t0, t1, got, moved = await _one_run(env, reqs, kill_at_quarter)
    workers.names.remove(names[victim])
    view = run_view(t0, t1, got, names, moved)
    n, t_kill = len(names), kill["t"]
    total = work if work is not None else view["engine_seconds"]
    ideal = t_kill + max(0.0, total - n * t_kill) / (n - 1)
    orphan = env.s.orphan_after_s
    indexes = [x.index for x in got]
    return {
        **view,
        "killed": names[victim],
        "kill_at_s": round(t_kill, 3),
        "results": len(got),
        "distinct": len(set(indexes)),
        "exactly_once": len(got) == len(reqs) == len(set(indexes))
        and sum(view["share"].values()) == len(reqs),
        "kill_to_last_s": round(view["seconds"] - t_kill, 3),
        "work_engine_seconds": round(total, 3),
        "work_from": "steal-on runs (median)" if work is not None else "this run",
        "orphan_after_s": orphan,
        "ideal_s": round(ideal, 3),
        "ideal_with_detection_s": round(ideal + orphan, 3),
        "end_over_ideal": round(view["seconds"] / ideal, 4) if ideal > 0 else None,
    }
