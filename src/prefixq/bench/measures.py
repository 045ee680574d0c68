"""What the benchmark computes from a workload and its runs: the cached-token optimum, how evenly
concurrent bursts were served, and which standalone set-up was strongest (docs/BENCHMARKS.md)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any


def optimum_cached(
    paths: Sequence[tuple[str, ...]],
    depth: Mapping[str, int],
    shards: Sequence[int],
    block: int,
) -> int:
    """Prompt tokens a prefix cache that never evicts can serve to this burst on this placement.

    A request's prompt is a path in the prefix tree (``paths[i]``, root first); a node visited
    earlier on the same shard is cached up to its depth (``depth[node]`` tokens from the start of
    the prompt), in whole KV blocks of ``block`` tokens, as vLLM caches them. Whatever the order,
    each node's first visitor on a shard computes it and every later one is served from the
    cache, so the sum does not depend on the order the requests run in: for D documents x Q
    questions on one shard it is D x (Q - 1) x the document's whole blocks, and for the
    system-prompt workload it adds, for every document after the first under each system prompt,
    the system prompt's whole blocks (the two-level optimum)."""
    seen: set[tuple[int, str]] = set()
    total = 0
    for path, shard in zip(paths, shards, strict=True):
        hit = 0
        for node in path:
            if (shard, node) in seen:
                hit = depth[node]
        total += hit // block * block
        seen.update((shard, node) for node in path)
    return total


def shares(
    burst_of: Sequence[int], finished: Sequence[float], arrived: Sequence[float]
) -> dict[str, Any] | None:
    """How evenly concurrent bursts were served: completions of each burst while all of them had
    work (from the last burst's arrival to the first burst's last completion; times in seconds
    from the run's start). ``ratio`` is the most completions over the fewest (1.0: even; the
    fairness bound of docs/BENCHMARKS.md is 1.2). None for a single burst; ``ratio`` None when
    the bursts never overlapped."""
    n = len(arrived)
    if n < 2:
        return None
    last: list[float] = [0.0] * n
    for b, t in zip(burst_of, finished, strict=True):
        last[b] = max(last[b], t)
    start, end = max(arrived), min(last)
    done = [0] * n
    for b, t in zip(burst_of, finished, strict=True):
        if start <= t <= end:
            done[b] += 1
    ratio = round(max(done) / min(done), 4) if end > start and min(done) > 0 else None
    return {
        "window_s": [round(start, 4), round(end, 4)],
        "completed": done,
        "ratio": ratio,
        "finished_s": [round(x, 4) for x in last],
        # each burst's arrival to its last completion: what a high-priority burst is about
        "took_s": [round(x - a, 4) for x, a in zip(last, arrived, strict=True)],
    }


def strongest(setups: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The standalone set-up with the highest median throughput (None if none ran)."""
    ran = {k: v for k, v in setups.items() if v.get("median_throughput")}
    if not ran:
        return None
    return max(ran, key=lambda k: float(ran[k]["median_throughput"]))


def pair_ratios(runs: Sequence[Mapping[str, Any]], mode: str) -> list[float]:
    """Per pair, the pipeline's throughput over ``mode``'s."""
    out = []
    for p in sorted({int(x["pair"]) for x in runs}):
        t = {x["mode"]: float(x["throughput"]) for x in runs if x["pair"] == p}
        if "pipeline" in t and mode in t:
            out.append(round(t["pipeline"] / t[mode], 4))
    return out


def setup_summary(runs: Sequence[Mapping[str, Any]], mode: str) -> dict[str, Any]:
    """One standalone set-up's median throughput and cached tokens, and the pipeline against it."""
    mine = [x for x in runs if x["mode"] == mode]
    ratios = pair_ratios(runs, mode)
    cached = [x["timeline"]["cached_tokens"] for x in mine if "timeline" in x]
    return {
        "median_throughput": statistics.median(float(x["throughput"]) for x in mine),
        "cached_tokens": statistics.median(cached) if cached else None,
        "ratios": ratios,
        "median_ratio": round(statistics.median(ratios), 4) if ratios else None,
        "min_ratio": min(ratios) if ratios else None,
    }
