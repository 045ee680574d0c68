"""A burst's ``on_complete`` callback: an RQ job enqueued once the burst has ended.

``Producer.submit(..., on_complete="pkg.module:func", rq_queue="name")`` stores the callback in the
burst record. Whoever ends the burst — the worker that records its last result (`RqCompletion`,
a worker middleware), `prefixq reclaim`, a cancel or an expiry (prefixq.store.burst_end) — enqueues
the RQ
job ``pkg.module.func(burst_id)`` on that queue, exactly once: the claim (``HSETNX callback_job``)
and RQ's enqueue commands run in one MULTI/EXEC, watched on the burst record, so any number of
calls for one burst enqueue one job, and a call that fails midway enqueues nothing and claims
nothing. Only RQ's public API is used, with its JSON serializer (never pickle).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re

import redis
import redis.asyncio as aredis
from redis.exceptions import WatchError
from rq import Queue
from rq.serializers import JSONSerializer

from prefixq.core.checks import callback_path
from prefixq.core.errors import ConfigError, ValidationError
from prefixq.core.settings import Settings
from prefixq.store.burst_end import OnBurstDone
from prefixq.store.connection import cluster_mode, is_cluster, sync_client
from prefixq.store.redis_errors import TRANSIENT, describe
from prefixq.store.redis_url import redact
from prefixq.worker.middleware import Middleware
from prefixq.worker.view import WorkerView

__all__ = [
    "ENDED",
    "RQ_ON_COMPLETE",
    "RqCompletion",
    "aenqueue_on_complete",
    "callback_job_id",
    "callback_path",
    "enqueue_on_complete",
]

log = logging.getLogger(__name__)

#: statuses of a burst that has ended: its callback may run (a cancel or a deadline ends a burst
#: as surely as its last result does)
ENDED = (b"finished", b"cancelled", b"expired")


def callback_job_id(namespace: str, burst: str) -> str:
    """The RQ job id of a burst's callback: fixed per (namespace, burst), in RQ's id alphabet."""
    digest = hashlib.blake2b(f"{namespace}\0{burst}".encode(), digest_size=6).hexdigest()
    return f"prefixq-done-{re.sub(r'[^A-Za-z0-9_-]', '_', burst)[:64]}-{digest}"


def enqueue_on_complete(client: redis.Redis, settings: Settings, burst: str) -> str | None:
    """Enqueue the burst's ``on_complete`` RQ job unless it was already; returns the new job's id.

    Returns None when the burst has no callback, has not ended (finished, cancelled or
    expired), or its callback was already
    enqueued (``callback_job`` is set). The claim and RQ's enqueue commands run in one MULTI/EXEC
    under WATCH of the burst record, so concurrent calls enqueue one job between them.
    """
    meta = settings.keys.burst(burst)
    if is_cluster(client) or settings.rq_url != settings.redis_url:
        return _enqueue_apart(client, settings, burst)
    with client.pipeline(transaction=True) as pipe:
        while True:
            try:
                pipe.watch(meta)
                spec, queue_name, claimed, status = pipe.hmget(
                    meta, "on_complete", "rq_queue", "callback_job", "status"
                )
                func = _due(burst, spec, claimed, status)
                if func is None:
                    return None
                job_id = callback_job_id(settings.namespace, burst)
                queue = Queue(
                    (queue_name or b"default").decode(),
                    connection=client,
                    serializer=JSONSerializer,
                )
                # Given a pipeline still WATCHing, RQ (2.0 and later) starts its MULTI before it
                # queues any command; RQ 2.0-2.2 refuse a pipeline already in MULTI.
                queue.enqueue(
                    func,
                    burst,
                    job_id=job_id,
                    pipeline=pipe,
                    meta=_job_meta(settings, burst),
                )
                if not pipe.explicit_transaction:
                    pipe.multi()
                pipe.hsetnx(meta, "callback_job", job_id)
                pipe.execute()
            except WatchError:
                continue  # the record changed between WATCH and EXEC: look again
            _enqueued(burst, func, job_id, queue)
            return job_id


def _due(burst: str, spec: bytes | None, claimed: bytes | None, status: bytes | None) -> str | None:
    """The callback to enqueue for ``burst``, from its record's ``on_complete``,
    ``callback_job`` and ``status``: None when it has none, it was enqueued already, the burst
    has not ended, or the spec is not a callable's path (a record written before submit
    checked it)."""
    if spec is None:
        return None
    if claimed is not None:
        log.debug("burst %s: callback already enqueued as %s", burst, claimed)
        return None
    if status not in ENDED:
        log.info("burst %s is %s, not ended: no callback yet", burst, status)
        return None
    try:
        return callback_path(spec.decode(errors="replace"))
    except ValidationError as e:
        log.error("burst %s: its callback is not enqueued: %s", burst, e)
        return None


def _enqueue_apart(client: redis.Redis, settings: Settings, burst: str) -> str | None:
    """`enqueue_on_complete` when RQ's queues are in another Redis than the burst (a Redis
    Cluster holds the data, `rq_redis_url` a plain Redis: RQ cannot use a cluster). No MULTI can
    span both, so the claim comes first: HSETNX ``callback_job`` on the burst record (one caller
    wins), then the winner enqueues on RQ's Redis. A process killed between the two loses that
    callback (at most once, where the single-Redis path is exactly once; docs/rq.md)."""
    meta = settings.keys.burst(burst)
    spec, queue_name, claimed, status = client.hmget(
        meta, "on_complete", "rq_queue", "callback_job", "status"
    )
    func = _due(burst, spec, claimed, status)
    if func is None:
        return None
    job_id = callback_job_id(settings.namespace, burst)
    if not client.hsetnx(meta, "callback_job", job_id):
        return None  # another caller claimed it
    rq = rq_client(settings)
    try:
        queue = Queue((queue_name or b"default").decode(), connection=rq, serializer=JSONSerializer)
        queue.enqueue(func, burst, job_id=job_id, meta=_job_meta(settings, burst))
    finally:
        rq.close()
    _enqueued(burst, func, job_id, queue)
    return job_id


def _job_meta(settings: Settings, burst: str) -> dict[str, str]:
    """The callback job's RQ meta: which burst of which namespace it is for."""
    return {"prefixq_namespace": settings.namespace, "prefixq_burst": burst}


def _enqueued(burst: str, func: str, job_id: str, queue: Queue) -> None:
    what = "burst %s: enqueued on_complete %s as RQ job %s on queue %s"
    log.info(what, burst, func, job_id, queue.name)


def rq_client(settings: Settings) -> redis.Redis:
    """A blocking client on the Redis of RQ's queues (`Settings.rq_url`), which must not be a
    Redis Cluster (ConfigError)."""
    url = settings.rq_url
    if cluster_mode(url):
        raise ConfigError(
            f"RQ cannot use a Redis Cluster ({redact(url)}): set rq_redis_url "
            "(PREFIXQ_RQ_REDIS_URL) to a plain Redis for RQ's queues; prefixq's data stays on "
            "the cluster (docs/rq.md)"
        )
    return sync_client(settings.replace(redis_url=url))


async def aenqueue_on_complete(r: aredis.Redis, settings: Settings, burst: str) -> str | None:
    """`enqueue_on_complete` from an event loop; returns the new RQ job's id or None.

    A burst without ``on_complete`` costs one HMGET on ``r``; otherwise RQ's blocking client runs
    in a thread (``asyncio.to_thread``) on its own short-lived connection.
    """
    meta = settings.keys.burst(burst)
    spec, claimed = await r.hmget(meta, "on_complete", "callback_job")
    if spec is None or claimed is not None:
        return None
    return await asyncio.to_thread(_enqueue_with_own_client, settings, burst)


def _enqueue_with_own_client(settings: Settings, burst: str) -> str | None:
    client = sync_client(settings)
    try:
        return enqueue_on_complete(client, settings, burst)
    except TRANSIENT as e:
        raise describe(settings, e) from e
    finally:
        client.close()


#: the RQ callback as the hook a `Producer` (and its `Burst` handles) runs when a cancel ends a
#: burst: ``Producer(settings, on_burst_done=RQ_ON_COMPLETE)``
RQ_ON_COMPLETE = OnBurstDone(done=enqueue_on_complete, adone=aenqueue_on_complete)


class RqCompletion(Middleware):
    """A worker middleware (worker/middleware.py): enqueues a burst's ``on_complete`` RQ job
    when a result the worker recorded completes the burst (`aenqueue_on_complete`, idempotent)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.r: aredis.Redis | None = None

    async def before_start(self, worker: WorkerView) -> None:
        self.r = worker.r  # the worker's own client

    async def after_burst_done(self, burst: str) -> None:
        if self.r is not None:
            await aenqueue_on_complete(self.r, self.settings, burst)
