"""Integrations plug into a worker as `Middleware`, as dramatiq's do: the worker core imports none.

Whoever builds a `Worker` registers them (``Worker(..., middleware=[...])`` or
`Worker.add_middleware`): `prefixq worker` (cli/worker_process.py) adds the RQ completion callbacks
(prefixq.integrations.rq_callbacks.RqCompletion) and, with ``--metrics-port``, the Prometheus
exporter (prefixq.integrations.metrics.MetricsExporter). Every hook is optional; the defaults do
nothing. Hooks see the worker as a `WorkerView` (worker/view.py); an integration that needs more is
given its collaborators by whoever builds it (cli/worker_process.py builds the metrics exporter so).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prefixq.core.records import Result

if TYPE_CHECKING:
    from prefixq.worker.view import WorkerView


class Middleware:
    """Hooks into a worker's life. ``after_result`` runs on the worker's event loop for every
    finished request: keep it to a few microseconds and never raise."""

    async def before_start(self, worker: WorkerView) -> None:
        """Before the worker joins its group and starts its engine."""

    def after_result(self, result: Result) -> None:
        """A request finished (ok or failed); its result is about to be written."""

    async def after_burst_done(self, burst: str) -> None:
        """A result this worker recorded completed burst ``burst`` (may repeat for a redelivery
        of a finished burst's request: make it idempotent)."""

    async def after_stop(self, worker: WorkerView) -> None:
        """After the worker has stopped (its engine closed), also after a failure."""
