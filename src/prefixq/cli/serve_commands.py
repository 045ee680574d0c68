"""``prefixq serve`` and ``prefixq dashboard``: the HTTP servers, until SIGINT or SIGTERM; both
with RQ's completion hook, the dashboard and ``/metrics`` (the namespaces' outstanding work, for
autoscalers), ``serve`` with the OpenAI Batch API too.
"""

from __future__ import annotations

import argparse

from prefixq.core.settings import Settings


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    """The OpenAI-compatible Batch API (docs/openai.md) and the dashboard (docs/dashboard.md),
    until SIGINT or SIGTERM."""
    return _serve(args, settings, batch_api=True)


def cmd_dashboard(args: argparse.Namespace, settings: Settings) -> int:
    """The dashboard (docs/dashboard.md) without the batch API, until SIGINT or SIGTERM."""
    return _serve(args, settings, batch_api=False)


def _serve(args: argparse.Namespace, settings: Settings, *, batch_api: bool) -> int:
    from prefixq.dashboard.api import mount
    from prefixq.integrations.rq_callbacks import aenqueue_on_complete
    from prefixq.integrations.serve_metrics import mount_metrics
    from prefixq.openai.serve import serve

    return serve(
        settings,
        host=args.host,
        port=args.port,
        on_burst_done=aenqueue_on_complete,
        batch_api=batch_api,
        extensions=[mount, mount_metrics],
    )
