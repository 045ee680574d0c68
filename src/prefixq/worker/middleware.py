"""Integrations plug into a worker as `Middleware`, as dramatiq's do: the worker core imports none.

Whoever builds a `Worker` registers them (``Worker(..., middleware=[...])`` or
`Worker.add_middleware`): `prefixq worker` (cli/worker_process.py) adds the RQ completion callbacks
(prefixq.integrations.rq_callbacks.RqCompletion) and, with ``--metrics-port``, the Prometheus
exporter
(prefixq.integrations.metrics.MetricsExporter). Every hook is optional; the defaults do nothing.
Hooks see the
worker as a `Host`: its client and settings (an integration that needs more keeps its own
reference to the worker it was built for, as the metrics exporter does).
"""

from __future__ import annotations

from typing import Protocol

import redis.asyncio as aredis

from prefixq.core.records import Result
from prefixq.core.settings import Settings


class Host(Protocol):
    """What a middleware's hooks see of the worker."""

    @property
    def r(self) -> aredis.Redis: ...

    @property
    def settings(self) -> Settings: ...


class Middleware:
    """Hooks into a worker's life. ``after_result`` runs on the worker's event loop for every
    finished request: keep it to a few microseconds and never raise."""

    async def before_start(self, worker: Host) -> None:
        """Before the worker joins its group and starts its engine."""

    def after_result(self, result: Result) -> None:
        """A request finished (ok or failed); its result is about to be written."""

    async def after_burst_done(self, burst: str) -> None:
        """A result this worker recorded completed burst ``burst`` (may repeat for a redelivery
        of a finished burst's request: make it idempotent)."""

    async def after_stop(self, worker: Host) -> None:
        """After the worker has stopped (its engine closed), also after a failure."""
