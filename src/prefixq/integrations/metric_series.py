"""The series a worker's metrics share, defined once: the labels every series carries, the
histograms' buckets, the worker's counters (`COUNTERS`), and `FastHistogram`, the lock-free
histogram behind the latency and GC-pause series. Read by prefixq.integrations.worker_metrics.
"""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client.core import HistogramMetricFamily

#: the labels of every series (the per-tenant ones add priority and tenant, errors their code)
LABELS = ("shard", "worker")
#: the loop-lag histogram's first bucket, seconds (worker/loopwatch.py's 0.01 ms)
LAG_BASE_S = 0.00001
#: queue wait and end to end: batch work waits from milliseconds to an hour
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
)  # fmt: skip
#: admitted -> first token (prefill, plus waiting for a slot in the engine's batch)
FIRST_TOKEN_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
#: one garbage collection (the design target: worst pause under 4.6 ms)
GC_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip

#: Worker.counts key -> (counter name without _total, help)
COUNTERS = {
    "admitted": ("prefixq_requests_admitted", "Requests handed to the engine (incl. reclaimed)."),
    "finished": ("prefixq_requests_finished", "Requests served without error."),
    "failed": (
        "prefixq_requests_failed",
        "Requests that got a failed result (engine refusal, invalid request, dead-lettered).",
    ),
    "dead": ("prefixq_dead_letters", "Entries this worker moved to the dead-letter stream."),
    "reclaimed": (
        "prefixq_requests_reclaimed",
        "Entries idle on another consumer that this worker took over.",
    ),
}


class FastHistogram:
    """Bucket counts and a sum, without a lock: written by one thread at a time (the event loop,
    or the GC callback for GC pauses) and read at scrape time, where a scrape racing an
    observation may see the sum one observation ahead of the counts.

    An observation is a bisect and two additions; prometheus_client's own Histogram takes a lock
    and scans its buckets (~2 us per observation), and a GC callback must never wait on a lock
    that the code it interrupted may hold."""

    __slots__ = ("bounds", "counts", "doc", "name", "sum")

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...]) -> None:
        self.name, self.doc, self.bounds = name, doc, bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # first bucket with value <= le
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def family(self, label_values: list[str]) -> HistogramMetricFamily:
        counts, total = list(self.counts), self.sum
        buckets: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), counts, strict=True):
            running += n
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
        h = HistogramMetricFamily(self.name, self.doc, labels=LABELS)
        h.add_metric(label_values, buckets, total)
        return h
