"""Prometheus metrics of one worker (``prefixq worker --metrics-port N``), every one labelled with
``shard`` and ``worker``: `MetricsExporter` (a worker middleware) and `WorkerMetrics` (one
`CollectorRegistry` per worker, no module state).

The invariant: nothing here makes the worker's event loop wait. Per finished request the
`after_result` hook calls `WorkerMetrics.observe` once (about a microsecond: `FastHistogram`
takes no lock); `GcWatch`'s callback observes GC pauses without a lock; everything else is read
at scrape time in the HTTP server's thread (the worker's `health()`, the token totals, the
histograms, the scheduler's per-tenant counters) or every ``heartbeat_s`` by an asyncio task with
its own Redis connection (the shard's queues, read by the same code as `inspect`:
prefixq.ops.queues). docs/operations.md, "Metrics", lists the series and their costs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from redis.exceptions import ResponseError

from prefixq.core.errors import SetupError
from prefixq.core.records import Result
from prefixq.core.settings import Settings
from prefixq.ops.queues import Queue, aread
from prefixq.store.connection import TRANSIENT, async_client
from prefixq.worker.loopwatch import Latency
from prefixq.worker.middleware import Middleware
from prefixq.worker.view import WorkerView

if TYPE_CHECKING:
    import redis.asyncio as aredis

    from prefixq.worker.gcwatch import GcWatch
    from prefixq.worker.scheduler import Scheduler

log = logging.getLogger(__name__)

LABELS = ("shard", "worker")
#: the loop-lag histogram's first bucket, seconds (worker/loopwatch.py's 0.01 ms)
LAG_BASE_S = 0.00001
_PER_TENANT = " Per priority and tenant, on the worker's shard."
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
    ) -> None:
        self.label_values = [str(shard), worker]
        self._health = health
        self._sched = sched
        self._loop_lag = loop_lag
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


class MetricsExporter(Middleware):
    """Serves ``/metrics`` over HTTP (a daemon thread) and refreshes the queue gauges every
    ``refresh_s`` (default: ``heartbeat_s``). A worker middleware (worker/middleware.py):
    registered on a worker, it starts with it, observes each finished request and stops after
    it; ``async with exporter:`` starts it at once and closes it.

    It is given what it reads, not the worker: the settings, the worker's shard and name, its
    ``health(now)`` (the heartbeat's fields), its scheduler (queued and in-flight per priority
    and tenant), its GC watch (whose observer it sets while it serves) and its event loop's lag:
    prefixq.cli.worker_process.metrics_exporter builds one for a worker."""

    def __init__(
        self,
        port: int,
        *,
        settings: Settings,
        shard: int,
        name: str,
        health: Callable[[float], Mapping[str, Any]],
        sched: Scheduler | None = None,
        gc: GcWatch | None = None,
        loop_lag: Latency | None = None,
        addr: str = "0.0.0.0",
        refresh_s: float | None = None,
    ) -> None:
        self.settings, self.shard, self.gc = settings, shard, gc
        self.keys = settings.keys
        self.port = port
        self.addr = addr
        self.refresh_s = refresh_s if refresh_s is not None else settings.heartbeat_s
        self.metrics = WorkerMetrics(shard, name, health, sched, loop_lag)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None
        self._r: aredis.Redis | None = None
        self._failing = False

    # ---- middleware hooks -----------------------------------------------------------------
    async def before_start(self, worker: WorkerView) -> None:
        await self.start()

    def after_result(self, result: Result) -> None:
        self.metrics.observe(result)

    async def after_stop(self, worker: WorkerView) -> None:
        await self.close()

    # ---- life -----------------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def start(self) -> None:
        """Serve and refresh (once; later calls do nothing)."""
        if self._server is not None:
            return
        try:
            self._server, self._thread = start_http_server(
                self.port, self.addr, registry=self.metrics.registry
            )
        except OSError as e:
            raise SetupError(
                f"cannot serve metrics on {self.addr}:{self.port}: {e.strerror or e}"
            ) from None
        self.port = self._server.server_port
        if self.gc is not None:
            self.gc.observer = self.metrics.gc_pause.observe
        self._r = async_client(self.settings)
        self._task = asyncio.create_task(self._refresh_loop(), name="metrics-refresh")
        log.info("metrics on http://%s:%d/metrics", self.addr, self.port)

    async def close(self) -> None:
        """Stop serving (idempotent)."""
        task, server, thread, r = self._task, self._server, self._thread, self._r
        self._task = self._server = self._thread = self._r = None
        if task is not None:
            task.cancel()
            await asyncio.wait([task], timeout=5)  # never hold up the worker's exit
        if server is not None:
            if self.gc is not None:
                self.gc.observer = None
            await asyncio.to_thread(server.shutdown)
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)
        if r is not None:
            await r.aclose()

    async def _refresh_loop(self) -> None:
        while True:
            try:
                await self.refresh()
                if self._failing:
                    log.info("queue metrics read again")
                self._failing = False
            except (*TRANSIENT, ResponseError) as e:
                if not self._failing:
                    log.warning("queue metrics not refreshed: %s (retrying)", e)
                self._failing = True
            except Exception:  # a bug here must not silently freeze the gauges for good
                if not self._failing:
                    log.exception("queue metrics not refreshed (retrying)")
                self._failing = True
            await asyncio.sleep(self.refresh_s)

    async def refresh(self) -> None:
        """Read the shard's queues from Redis into the gauges (four round trips)."""
        assert self._r is not None, "use `async with MetricsExporter(...)`"
        r = self._r
        q = await aread(r, self.keys, self.shard)
        dead = await r.xlen(self.keys.dead(self.shard))
        # one assignment, so a scrape in the HTTP thread sees the old state or the new one
        self.metrics.queue = QueueState(
            q.waiting, q.pending, q.oldest_waiting_s, dead, time.time(), tuple(q.queues())
        )
