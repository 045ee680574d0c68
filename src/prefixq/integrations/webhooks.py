"""Webhook delivery inside a worker: `WebhookSender`, a worker middleware that runs a deliverer
(prefixq.ops.webhook_delivery) for the worker's namespace while the worker runs, so the
``on_complete_url`` of bursts submitted from Python or RQ is called with no ``prefixq serve``
running. `prefixq worker` adds it when the ``webhooks`` setting configures its namespace (the
deliverer needs the namespace's signing secret); docs/operations.md, "Receiving webhooks".
"""

from __future__ import annotations

import contextlib
import logging

from prefixq.core.settings import Settings
from prefixq.core.webhooks import WebhookConfig
from prefixq.ops.webhook_delivery import delivering
from prefixq.store.connection import async_client
from prefixq.worker.middleware import Middleware
from prefixq.worker.view import WorkerView

__all__ = ["WebhookSender", "configured"]

log = logging.getLogger(__name__)


def configured(settings: Settings) -> bool:
    """Whether the settings give the namespace a signing secret or an endpoint."""
    hooks = WebhookConfig.parse(settings.webhooks).of(settings.namespace)
    return hooks.key is not None or bool(hooks.endpoints)


class WebhookSender(Middleware):
    """Runs a deliverer of the worker's namespace from `before_start` to `after_stop`, on a Redis
    client of its own (the worker's stays the worker's)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._stack = contextlib.AsyncExitStack()

    async def before_start(self, worker: WorkerView) -> None:
        r = async_client(self.settings)
        self._stack.push_async_callback(r.aclose)
        await self._stack.enter_async_context(
            delivering(r, self.settings, [self.settings.namespace])
        )
        log.info("webhooks: delivering namespace %s's outbox", self.settings.namespace)

    async def after_stop(self, worker: WorkerView) -> None:
        await self._stack.aclose()
