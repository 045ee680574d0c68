"""Where a run's time goes: one timeline per run, the same points for both modes.

Points are seconds from the run's start (the first enqueue, or the first engine call):
``first_add`` / ``last_add`` (the first and last request handed to an engine), ``first_token``
(the first output token of any request), ``last_finish`` (the last request leaving an engine),
``last_recorded`` (pipeline: the last result recorded in Redis, from its events stream's id,
which is Redis's clock in milliseconds), ``end`` (the run's end: the waiter saw the burst done, or
the last engine call returned). Per run also: prompt tokens and those served from the prefix
cache (a different admission order that loses cache hits shows here), and for the pipeline the
workers' read-to-engine time and event-loop lag (worker/probes.py). The gap between the modes,
point by point, says which stage a pipeline's extra time is spent in (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

POINTS = ("first_add", "last_add", "first_token", "last_finish", "last_recorded", "end")


@dataclass(slots=True)
class Stamp:
    """One request's epoch times and tokens, as either mode saw them."""

    added: float
    first_token: float
    finished: float
    prompt_tokens: int
    cached_tokens: int


def timeline(
    t0: float, t1: float, stamps: Sequence[Stamp], last_recorded: float | None = None
) -> dict[str, Any]:
    """The run's points (seconds from ``t0``) and token counts."""
    firsts = [s.first_token for s in stamps if s.first_token > 0]
    out: dict[str, Any] = {
        "first_add": round(min(s.added for s in stamps) - t0, 4),
        "last_add": round(max(s.added for s in stamps) - t0, 4),
        "first_token": round(min(firsts) - t0, 4) if firsts else None,
        "last_finish": round(max(s.finished for s in stamps) - t0, 4),
        "last_recorded": None if last_recorded is None else round(last_recorded - t0, 4),
        "end": round(t1 - t0, 4),
        "prompt_tokens": sum(s.prompt_tokens for s in stamps),
        "cached_tokens": sum(s.cached_tokens for s in stamps),
    }
    return out


def medians(runs: Iterable[dict[str, Any]], mode: str) -> dict[str, Any]:
    """Per point, the median over ``mode``'s runs (None where no run has the point)."""
    rows = [r["timeline"] for r in runs if r["mode"] == mode and "timeline" in r]
    out: dict[str, Any] = {}
    for p in (*POINTS, "prompt_tokens", "cached_tokens"):
        vals = [x[p] for x in rows if x.get(p) is not None]
        out[p] = round(statistics.median(vals), 4) if vals else None
    return out


def gaps(pipeline: dict[str, Any], standalone: dict[str, Any]) -> dict[str, Any]:
    """Pipeline minus standalone at each point both have (milliseconds)."""
    return {
        p: round((pipeline[p] - standalone[p]) * 1000, 1)
        for p in POINTS
        if pipeline.get(p) is not None and standalone.get(p) is not None
    }


def worker_stats(stats: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The workers' read-to-engine and loop-lag figures of one run (worst worker)."""
    keys = (
        "read_to_engine_p50_ms",
        "read_to_engine_p99_ms",
        "read_to_engine_max_ms",
        "loop_lag_p99_ms",
        "loop_lag_max_ms",
    )
    return {k: max(float(s.get(k, 0.0)) for s in stats.values()) for k in keys}
