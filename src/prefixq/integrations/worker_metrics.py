"""`WorkerMetrics`: one worker's metrics, fed and scraped (one `CollectorRegistry` per worker,
no module state). `observe` runs on the worker's event loop once per finished request; `collect`
runs at scrape time in the HTTP server's thread and reads only plain attributes, the worker's
`health()`, the scheduler's per-tenant counters and `QueueState`, the shard's queues as
prefixq.integrations.metrics.MetricsExporter last read them from Redis.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from prefixq.core.records import Result
from prefixq.integrations.metric_series import (
    COUNTERS,
    FIRST_TOKEN_BUCKETS,
    GC_BUCKETS,
    LABELS,
    LAG_BASE_S,
    LATENCY_BUCKETS,
    FastHistogram,
)
from prefixq.ops.queues import Queue
from prefixq.worker.loopwatch import Latency

if TYPE_CHECKING:
    from prefixq.worker.fleet import FleetWatch
    from prefixq.worker.scheduler import Scheduler

_PER_TENANT = " Per priority and tenant, on the worker's shard."


@dataclass(slots=True)
class QueueState:
    """The shard's queue as last read from Redis (replaced whole, never mutated)."""

    waiting: int = 0
    pending: int = 0
    oldest_waiting_s: float = 0.0
    dead_letters: int = 0
    read_at: float = 0.0  # epoch s of the last successful read; 0 = never
    #: per priority and tenant
    queues: tuple[Queue, ...] = ()


class WorkerMetrics:
    """The registry of one worker and what feeds it. `observe` runs on the event loop; `collect`
    in the HTTP server's thread (reads only plain attributes and the worker's `health()`)."""

    def __init__(
        self,
        shard: int,
        worker: str,
        health: Callable[[float], Mapping[str, Any]],
        sched: Scheduler | None = None,
        loop_lag: Latency | None = None,
        fleet: FleetWatch | None = None,
    ) -> None:
        self.label_values = [str(shard), worker]
        self._health = health
        self._sched = sched
        self._loop_lag = loop_lag
        self._fleet = fleet
        self.registry = CollectorRegistry()
        self.queue_wait = FastHistogram(
            "prefixq_queue_wait_seconds",
            "Enqueued (producer clock) -> admitted into the engine, per successful request.",
            LATENCY_BUCKETS,
        )
        self.first_token = FastHistogram(
            "prefixq_first_token_seconds",
            "Admitted -> first output token, per successful request.",
            FIRST_TOKEN_BUCKETS,
        )
        self.end_to_end = FastHistogram(
            "prefixq_end_to_end_seconds",
            "Enqueued (producer clock) -> finished, per successful request.",
            LATENCY_BUCKETS,
        )
        self.gc_pause = FastHistogram(
            "prefixq_gc_pause_seconds",
            "Garbage-collector pauses in the worker after warm-up (idle-time collections apart).",
            GC_BUCKETS,
        )
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.predicted_tokens = 0
        self.output_tokens = 0
        #: failed results per error code (Result.error_code)
        self.errors: dict[str, int] = {}
        self.queue = QueueState()
        self.registry.register(self)

    # ---- feeding (event loop; gc_pause.observe from the GC callback) -------------------------
    def observe(self, result: Result) -> None:
        """One finished request; failed ones are counted by code, not timed."""
        if result.error is not None:
            code = result.error_code or "unknown"
            self.errors[code] = self.errors.get(code, 0) + 1
            return
        t = result.timings
        if t.enqueued > 0:
            self.queue_wait.observe(max(0.0, t.admitted - t.enqueued))
            self.end_to_end.observe(max(0.0, t.finished - t.enqueued))
        if t.first_token > 0:
            self.first_token.observe(max(0.0, t.first_token - t.admitted))
        self.prompt_tokens += result.prompt_tokens
        self.cached_tokens += result.cached_tokens
        self.predicted_tokens += result.predicted_cached_tokens
        self.output_tokens += result.output_tokens

    # ---- scraping (HTTP server thread) ------------------------------------------------------
    def collect(self) -> Iterable[Metric]:
        now = time.time()
        h = self._health(now)
        yield self._gauge(
            "prefixq_engine_up", "1 while the worker's engine serves.", h["engine_up"]
        )
        yield self._gauge("prefixq_inflight", "Requests inside the engine now.", h["inflight"])
        yield self._gauge(
            "prefixq_max_inflight", "Most requests kept inside the engine.", h["max_inflight"]
        )
        for key, (name, doc) in COUNTERS.items():
            yield self._counter(name, doc, h[key])
        prompt, cached = self.prompt_tokens, self.cached_tokens
        yield self._counter(
            "prefixq_prompt_tokens", "Prompt tokens of successful requests.", prompt
        )
        yield self._counter(
            "prefixq_cached_tokens",
            "Prompt tokens of successful requests served from the prefix cache.",
            cached,
        )
        yield self._counter(
            "prefixq_predicted_cached_tokens",
            "Prompt tokens of successful requests the producer predicted cached (its prefix map).",
            self.predicted_tokens,
        )
        yield self._counter(
            "prefixq_output_tokens", "Output tokens of successful requests.", self.output_tokens
        )
        errors = CounterMetricFamily(
            "prefixq_request_errors",
            "Failed results this worker recorded, per error code.",
            labels=[*LABELS, "code"],
        )
        for code, n in sorted(dict(self.errors).items()):  # copied whole (a C-level copy)
            errors.add_metric([*self.label_values, code], float(n))
        yield errors
        yield self._gauge(
            "prefixq_cached_token_ratio",
            "cached_tokens / prompt_tokens since the worker started (0 before any).",
            cached / prompt if prompt else 0.0,
        )
        q = self.queue
        if q.read_at:
            yield self._gauge(
                "prefixq_queue_depth",
                "Entries of the shard's stream not yet delivered to any worker.",
                q.waiting,
            )
            yield self._gauge(
                "prefixq_queue_pending",
                "Entries of the shard delivered to a worker and not yet acknowledged.",
                q.pending,
            )
            yield self._gauge(
                "prefixq_queue_oldest_age_seconds",
                "Age of the shard's oldest undelivered entry (0 when none waits).",
                q.oldest_waiting_s,
            )
            yield self._gauge(
                "prefixq_dead_letter_stream_length",
                "Entries in the shard's dead-letter stream.",
                q.dead_letters,
            )
            yield self._gauge(
                "prefixq_queue_stats_age_seconds",
                "Seconds since the queue gauges above were read from Redis.",
                max(0.0, now - q.read_at),
            )
            yield from self._per_tenant(q.queues)
        for hist in (self.queue_wait, self.first_token, self.end_to_end, self.gc_pause):
            yield hist.family(self.label_values)
        if self._loop_lag is not None:
            yield self._lag_family(self._loop_lag)
        if self._fleet is not None:
            yield from self._fleet_families(self._fleet)
        sched = self._sched
        if sched is not None:
            rows = sorted(sched.per_tenant().items())
            for i, (name, doc, kind) in enumerate(
                (
                    ("prefixq_tenant_inflight", "Requests inside the engine.", "g"),
                    ("prefixq_tenant_admitted", "Requests handed to the engine.", "c"),
                    ("prefixq_tenant_queue_wait_seconds", "Queue waits summed.", "c"),
                )
            ):
                fam = self._family(name, doc + _PER_TENANT, kind)
                for (prio, tenant), values in rows:
                    fam.add_metric([*self.label_values, prio, tenant], float(values[i]))
                yield fam

    def _lag_family(self, lag: Latency) -> HistogramMetricFamily:
        """The event loop's lag (worker/loopwatch.py) as a histogram: its log-scale buckets
        (0.01 ms x 2**i) made cumulative, in seconds."""
        counts, total = list(lag.buckets), lag.total / 1000
        buckets: list[tuple[str, float]] = []
        running = 0
        for i, n in enumerate(counts):
            running += n
            le = "+Inf" if i == len(counts) - 1 else repr(LAG_BASE_S * 2**i)
            buckets.append((le, float(running)))
        h = HistogramMetricFamily(
            "prefixq_loop_lag_seconds",
            "How late the worker's event loop woke up for a 10 ms sleep (work waiting behind it).",
            labels=LABELS,
        )
        h.add_metric(self.label_values, buckets, total)
        return h

    def _fleet_families(self, fleet: FleetWatch) -> Iterable[Metric]:
        """The fleet as this worker saw it at its last look, and what it moved, per ``why``."""
        for name, doc, value in (
            ("prefixq_fleet_shards", "Shards of the deployment.", fleet.shards),
            ("prefixq_fleet_live_shards", "Shards with a live worker.", fleet.live_shards),
            (
                "prefixq_fleet_orphaned_shards",
                "Shards without a live worker for orphan_after_s (their queues move).",
                fleet.orphaned_shards,
            ),
        ):
            yield self._gauge(name, doc + " As this worker last looked.", value)
        totals = sorted(dict(fleet.totals).items())
        for name, doc, attr in (
            ("prefixq_moves", "Moves of queued work this worker made", "moves"),
            ("prefixq_moved_requests", "Requests this worker moved between shards", "requests"),
            (
                "prefixq_moved_prompt_tokens",
                "Estimated uncached prompt tokens of the requests this worker moved",
                "tokens",
            ),
        ):
            fam = CounterMetricFamily(
                name, doc + ", per why (orphaned, steal, drain).", labels=[*LABELS, "why"]
            )
            for why, t in totals:
                fam.add_metric([*self.label_values, why], float(getattr(t, attr)))
            yield fam

    def _per_tenant(self, queues: tuple[Queue, ...]) -> Iterable[Metric]:
        for name, doc, attr in (
            ("prefixq_tenant_queue_depth", "Entries not yet delivered.", "waiting"),
            ("prefixq_tenant_queue_pending", "Entries delivered, not acked.", "pending"),
            (
                "prefixq_tenant_oldest_wait_seconds",
                "Oldest waiting entry's age.",
                "oldest_waiting_s",
            ),
        ):
            fam = self._family(name, doc + _PER_TENANT, "g")
            for x in queues:
                fam.add_metric([*self.label_values, x.priority, x.tenant], float(getattr(x, attr)))
            yield fam

    @staticmethod
    def _family(name: str, doc: str, kind: str) -> GaugeMetricFamily | CounterMetricFamily:
        cls = GaugeMetricFamily if kind == "g" else CounterMetricFamily
        return cls(name, doc, labels=[*LABELS, "priority", "tenant"])

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=LABELS)
        g.add_metric(self.label_values, float(value))
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=LABELS)
        c.add_metric(self.label_values, float(value))
        return c
