"""Prometheus metrics of one worker (``prefixq worker --metrics-port N``), every one labelled with
``shard`` and ``worker``: `MetricsExporter` (a worker middleware, here) serves `WorkerMetrics`
(one `CollectorRegistry` per worker, no module state: prefixq.integrations.worker_metrics) and
refreshes its queue gauges; the series' labels, buckets and `FastHistogram` are in
prefixq.integrations.metric_series.

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
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server
from redis.exceptions import ResponseError

from prefixq.core.errors import SetupError
from prefixq.core.records import Result
from prefixq.core.settings import Settings
from prefixq.integrations.worker_metrics import QueueState, WorkerMetrics
from prefixq.ops.queues import aread
from prefixq.store.connection import async_client
from prefixq.store.redis_errors import TRANSIENT
from prefixq.worker.loopwatch import Latency
from prefixq.worker.middleware import Middleware
from prefixq.worker.view import WorkerView

if TYPE_CHECKING:
    import redis.asyncio as aredis

    from prefixq.worker.fleet import FleetWatch
    from prefixq.worker.gcwatch import GcWatch
    from prefixq.worker.scheduler import Scheduler

log = logging.getLogger(__name__)


class MetricsExporter(Middleware):
    """Serves ``/metrics`` over HTTP (a daemon thread) and refreshes the queue gauges every
    ``refresh_s`` (default: ``heartbeat_s``). A worker middleware (worker/middleware.py):
    registered on a worker, it starts with it, observes each finished request and stops after
    it; ``async with exporter:`` starts it at once and closes it.

    It is given what it reads, not the worker: the settings, the worker's shard and name, its
    ``health(now)`` (the heartbeat's fields), its scheduler (queued and in-flight per priority
    and tenant), its GC watch (whose observer it sets while it serves), its event loop's lag and
    its fleet watch (the shards it saw live and what it moved): prefixq.cli.worker_process.
    metrics_exporter builds one for a worker."""

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
        fleet: FleetWatch | None = None,
        addr: str = "0.0.0.0",
        refresh_s: float | None = None,
    ) -> None:
        self.settings, self.shard, self.gc = settings, shard, gc
        self.keys = settings.keys
        self.port = port
        self.addr = addr
        self.refresh_s = refresh_s if refresh_s is not None else settings.heartbeat_s
        self.metrics = WorkerMetrics(shard, name, health, sched, loop_lag, fleet)
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
