"""A burst's latency histograms and its throughput over time, from the sample of its results that
prefixq.ops.stats reads anyway (no I/O here): what `prefixq inspect --json` and the dashboard's
burst page show under ``histograms`` and ``timeline``.

Histograms count the sampled successful requests per stage in fixed log-spaced buckets (`EDGES`,
seconds; the last bucket is open-ended), the same buckets for every stage and every burst, so two
bursts compare at a glance. The timeline splits the burst's span (first enqueue to last finish in
the sample) into at most `TIMELINE_BINS` equal bins and counts the requests that finished in each,
scaled from the sample to the burst (``scale``), as requests per second.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

from prefixq.core.records import Result

__all__ = ["EDGES", "TIMELINE_BINS", "histograms", "timeline"]

#: bucket lower edges, seconds: a bucket holds [EDGES[i], EDGES[i + 1]); the last is open
EDGES = (
    0.0, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
)  # fmt: skip
#: most bins of a burst's timeline
TIMELINE_BINS = 60


def _counts(values: list[float]) -> list[int]:
    out = [0] * len(EDGES)
    for v in values:
        out[max(0, bisect_right(EDGES, max(0.0, v)) - 1)] += 1
    return out


def histograms(ok: list[Result]) -> dict[str, Any]:
    """``{"edges_s": EDGES, "queue_wait_s": counts, "first_token_s": ..., "end_to_end_s": ...}``
    over the successful requests of a sample."""
    t = [r.timings for r in ok]
    return {
        "edges_s": list(EDGES),
        "queue_wait_s": _counts([x.admitted - x.enqueued for x in t]),
        "first_token_s": _counts([x.first_token - x.admitted for x in t if x.first_token]),
        "end_to_end_s": _counts([x.finished - x.enqueued for x in t]),
    }


def timeline(sample: list[Result], scale: float) -> dict[str, Any]:
    """Requests finished per second over the burst's span, ok and failed apart, estimated from
    ``sample`` (each sampled request counts ``scale`` requests of the burst)."""
    done = [r for r in sample if r.timings.finished > 0]
    if not done:
        return {"start": 0.0, "step_s": 0.0, "ok_per_s": [], "failed_per_s": []}
    begin = min((r.timings.enqueued or r.timings.finished) for r in done)
    end = max(r.timings.finished for r in done)
    span = max(end - begin, 1e-3)
    bins = max(1, min(TIMELINE_BINS, len(done)))
    step = span / bins
    ok, failed = [0.0] * bins, [0.0] * bins
    for r in done:
        i = min(bins - 1, int((r.timings.finished - begin) / step))
        (failed if r.error is not None else ok)[i] += scale
    return {
        "start": round(begin, 3),
        "step_s": round(step, 6),
        "ok_per_s": [round(x / step, 3) for x in ok],
        "failed_per_s": [round(x / step, 3) for x in failed],
    }
