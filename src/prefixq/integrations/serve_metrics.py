"""``GET /metrics`` of ``prefixq serve`` and ``prefixq dashboard``: the outstanding work of every
namespace the server serves, summed over all its shards, in Prometheus text.

What it is for: scaling the workers on the work waiting for them (KEDA's Prometheus trigger,
deploy/k8s/worker-scaledobject.yaml; docs/operations.md, "Running on Kubernetes"). A worker's own
gauges (prefixq.integrations.metrics) describe its shard only and vanish with it, so a fleet scaled
to zero would export nothing to scale up on; the server runs whether or not any worker does, and
its figure covers every stream of every shard (intakes and per-burst lanes), which no single-stream
trigger can read. Computed at scrape time in the thread pool, by the same code as ``prefixq
inspect`` (prefixq.ops.queues: three or four round trips per shard; a cancelled or expired
burst's queued entries are no work and not counted). Like ``/health`` it needs no API key (it
says how much work waits, never whose or what).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import redis
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from prefixq.core.keys import Keys
from prefixq.openai.app import Served
from prefixq.ops.queues import read

__all__ = ["LABEL", "SERIES", "mount_metrics", "outstanding"]

#: the one label of every series: not ``namespace``, which Kubernetes scrape configurations give
#: every target (its Kubernetes namespace), renaming ours to ``exported_namespace``
LABEL = "prefixq_namespace"
#: the series, in the order of `outstanding`'s figures
SERIES = (
    ("prefixq_shards", "Shards of the namespace (the count recorded in Redis)."),
    (
        "prefixq_outstanding_requests",
        "Requests queued or in a worker (delivered, not yet acked), all shards.",
    ),
    ("prefixq_queued_requests", "Requests not yet delivered to any worker, all shards."),
    (
        "prefixq_oldest_queued_age_seconds",
        "Age of the oldest request not yet delivered, all shards (0 when none waits).",
    ),
)


class _Figures:
    """A collector over one read of the namespaces' queues (one scrape)."""

    def __init__(self, rows: Sequence[tuple[str, int, int, int, float]]) -> None:
        self.rows = rows

    def collect(self) -> Iterable[Metric]:
        for i, (name, doc) in enumerate(SERIES, start=1):
            g = GaugeMetricFamily(name, doc, labels=[LABEL])
            for row in self.rows:
                g.add_metric([row[0]], float(row[i]))
            yield g


def outstanding(r: redis.Redis, namespace: str) -> tuple[int, int, int, float]:
    """(shards, queued + in a worker, queued, oldest queued age s) of a namespace, all shards;
    zeros for a namespace no worker has started in."""
    keys = Keys(namespace)
    raw = r.hget(keys.config, "shards")
    shards = int(raw) if raw is not None and raw.isdigit() else 0
    waiting = pending = 0
    oldest = 0.0
    for k in range(shards):
        q = read(r, keys, k)
        waiting += q.waiting
        pending += q.pending
        oldest = max(oldest, q.oldest_waiting_s)
    return shards, waiting + pending, waiting, oldest


def mount_metrics(app: FastAPI, served: Served) -> None:
    """Add ``GET /metrics`` to ``app`` (an extension of prefixq.openai.app.create_app)."""
    namespaces = sorted(set(served.keyring.namespaces))

    def render() -> bytes:
        r = served.blocking_redis
        rows = [(ns, *outstanding(r, ns)) for ns in namespaces]
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Figures(rows))
        return generate_latest(registry)

    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> Response:
        served.keyring.guard_host(request.headers.get("host"))
        return Response(await run_in_threadpool(render), media_type=CONTENT_TYPE_LATEST)
