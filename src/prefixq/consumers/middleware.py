"""Integrations plug into a worker as `Middleware`, as dramatiq's do: the worker core imports none.

Whoever builds a `Worker` registers them (``Worker(..., middleware=[...])`` or
`Worker.add_middleware`): `prefixq worker` (consumers/run.py) adds the RQ completion callbacks
(prefixq.rq_jobs.RqCompletion) and, with ``--metrics-port``, the Prometheus exporter
(prefixq.metrics.MetricsExporter). Every hook is optional; the defaults do nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefixq.records import Result

if TYPE_CHECKING:
    from prefixq.consumers.worker import Worker


class Middleware:
    """Hooks into a worker's life. ``after_result`` runs on the worker's event loop for every
    finished request: keep it to a few microseconds and never raise."""

    async def before_start(self, worker: Worker) -> None:
        """Before the worker joins its group and starts its engine."""

    def after_result(self, result: Result) -> None:
        """A request finished (ok or failed); its result is about to be written."""

    async def after_burst_done(self, burst: str) -> None:
        """A result this worker recorded completed burst ``burst`` (may repeat for a redelivery
        of a finished burst's request: make it idempotent)."""

    async def after_stop(self, worker: Worker) -> None:
        """After the worker has stopped (its engine closed), also after a failure."""
