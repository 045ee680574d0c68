"""``prefixq serve``: the OpenAI-compatible Batch API on uvicorn, with what extensions add (the
CLI adds the dashboard); ``prefixq dashboard`` is the dashboard alone (``batch_api=False``).

Without API keys the server refuses any address but a loopback one: anyone who can reach it could
run batches on the GPUs and read every file. A files directory that is not the one the namespace's
other servers share is refused too (openai/files_volume.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from prefixq.core.errors import ConfigError
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.core.webhooks import WebhookConfig
from prefixq.openai.auth import KeyRing, is_loopback
from prefixq.openai.files import files_root
from prefixq.openai.files_volume import claim_volume
from prefixq.store.burst_end import AsyncBurstDone
from prefixq.store.connection import sync_client

if TYPE_CHECKING:
    from prefixq.openai.app import Extension

__all__ = ["serve"]

log = logging.getLogger(__name__)


def serve(
    settings: Settings,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    on_burst_done: AsyncBurstDone | None = None,
    batch_api: bool = True,
    extensions: Sequence[Extension] = (),
) -> int:
    """Check the settings and Redis, then serve until SIGINT/SIGTERM; returns the exit code.
    ``on_burst_done``, ``batch_api``, ``extensions``: see `create_app`."""
    import uvicorn

    from prefixq.openai.app import create_app

    keyring = KeyRing.from_settings(settings)
    if keyring.open and not is_loopback(host):
        raise ConfigError(
            f"no API keys are configured, so the server listens on a loopback address only, not "
            f"{host!r}: set PREFIXQ_API_KEYS (KEY or KEY=NAMESPACE, comma-separated) or use "
            "--host 127.0.0.1"
        )
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port must be 0 to 65535, not {port}")
    WebhookConfig.parse(settings.webhooks)  # a file that cannot be read: one line, exit 2
    root = files_root(settings)
    if batch_api:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"files_dir {root}: cannot be a folder here: {e.strerror}") from None
    r = sync_client(settings)
    try:
        r.ping()
        if batch_api:  # replicas must share the files directory: refuse one that does not
            for ns in keyring.namespaces:
                claim_volume(r, Keys(ns), root)
    finally:
        r.close()
    if keyring.open:
        log.warning(
            "no API keys configured (PREFIXQ_API_KEYS): any caller is accepted; listening on "
            "%s only",
            host,
        )
    else:
        log.info("%d API keys; namespaces %s", len(keyring.keys), ", ".join(keyring.namespaces))
    if batch_api:
        log.info(
            "OpenAI Batch API on http://%s:%d/v1 (namespace %s, files in %s)",
            host,
            port,
            settings.namespace,
            root,
        )
    if extensions:
        log.info(
            "dashboard on http://%s:%d/%s",
            host,
            port,
            " (read-only)" if settings.dashboard_read_only else "",
        )
    try:
        uvicorn.run(
            create_app(
                settings, on_burst_done=on_burst_done, batch_api=batch_api, extensions=extensions
            ),
            host=host,
            port=port,
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=10,
        )
    except SystemExit as e:  # uvicorn's exit when it cannot start (it logged why: port in use)
        if e.code not in (0, None):
            log.error("the server did not start")
            return 1
    return 0
