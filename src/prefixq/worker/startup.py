"""A worker's start: what it checks and records in Redis before it serves, and the engine's
warm-up. Every Redis step is retried until Redis takes it (unreachable, out of memory, loading:
a worker started too early waits instead of dying); refused credentials or permissions are a
`ConfigError` at once (exit 2: a restart cannot fix them)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

from prefixq.core.errors import ConfigError
from prefixq.core.settings import Settings
from prefixq.engine.protocol import EmbedRequest, Engine, EngineRequest
from prefixq.store.connection import is_cluster
from prefixq.store.policy import acheck_policy
from prefixq.store.retry import retry
from prefixq.store.topology import alayout_lines
from prefixq.worker.shard import ShardStream

log = logging.getLogger(__name__)


async def register(stream: ShardStream, settings: Settings) -> None:
    """Check the server's eviction policy (store/policy.py), make sure the deployment's shard
    count is recorded, and join the shard's group. A worker without ``--shards`` on a Redis that
    has none, with a ``--shards`` above the recorded count, or for a shard outside it is a
    ConfigError (producers would never send it work, or send work no worker serves)."""
    r, keys, s = stream.r, stream.keys, settings
    await retry(
        "reading the eviction policy", lambda: acheck_policy(r, settings), settings=settings
    )
    count = 0

    async def shards() -> None:
        nonlocal count
        if settings.shards:
            await r.hsetnx(keys.config, "shards", settings.shards)
        raw = await r.hget(keys.config, "shards")
        if raw is None:
            raise ConfigError(
                f"no shard count in Redis for namespace {settings.namespace!r}: start the "
                "first worker of a deployment with --shards N (or PREFIXQ_SHARDS)"
            )
        count = int(raw)
        # what the live workers wait before moving a dead shard's queue: `inspect` and the
        # dashboard call a shard orphaned by it, whatever their own settings say
        await r.hset(keys.config, "orphan_after_s", repr(settings.orphan_after_s))

    await retry("recording the shard count", shards, settings=settings)
    if settings.shards and settings.shards > count:  # below it: a deployment grown by --join
        raise ConfigError(
            f"--shards {settings.shards} but namespace {settings.namespace!r} has {count} shards "
            f"in Redis ({keys.config}); drop the setting, use {count}, or use another namespace"
        )
    if not 0 <= stream.shard < count:
        raise ConfigError(
            f"shard {stream.shard} does not exist (namespace {settings.namespace!r} has shards "
            f"0..{count - 1})"
        )

    async def task() -> None:  # what the shard serves, before its engine is up: producers
        await r.hset(keys.tasks, str(stream.shard), settings.task)  # place by it at once

    await retry("recording what the shard serves", task, settings=settings)
    await retry("checking the worker's name", lambda: name_free(stream, settings), settings=s)
    if is_cluster(r):
        for line in await alayout_lines(r, keys, count):
            log.info("%s", line)
    await stream.join()


async def name_free(stream: ShardStream, settings: Settings) -> None:
    """A ConfigError when another process serves the shard under this worker's name (its
    heartbeat hash is there and beats again while this one waits): two workers under one
    consumer name read each other's pending entries as their own (both serve the backlog a
    restart resumes) and show as one worker. The name is this worker's when its heartbeat
    expires without a beat (``heartbeat_ttl_s``: a predecessor that died, kill -9), or at once
    when the heartbeat names a process of this host that is gone (a restart on the same host).
    A live worker whose beats are late (a loaded machine) is waited for, never taken over."""
    hb = stream.keys.heartbeat(stream.shard, stream.consumer)
    fields = ("beat", "pid", "host", "every_s")
    first = await stream.r.hmget(hb, fields)
    if first[0] is None:
        return
    pid, host = _who(first)
    if _gone_here(pid, host):
        await stream.r.delete(hb)
        return
    try:
        every = float(first[3] or settings.heartbeat_s)
    except ValueError:
        every = settings.heartbeat_s
    log.info(
        "worker name %r on shard %d: pid %s on host %s beat under it; waiting up to %.1fs for "
        "its next beat (none: it is gone and the name is this worker's)",
        stream.consumer,
        stream.shard,
        pid,
        host,
        settings.heartbeat_ttl_s,
    )
    give_up = time.monotonic() + settings.heartbeat_ttl_s + 0.5
    while time.monotonic() < give_up:
        await asyncio.sleep(min(0.2, max(0.02, every / 4)))
        again = await stream.r.hmget(hb, fields)
        if again[0] is None:  # expired or unregistered: gone
            return
        if again[0] != first[0]:
            pid, host = _who(again)
            raise ConfigError(
                f"worker name {stream.consumer!r} is in use on shard {stream.shard}: pid {pid} "
                f"on host {host} serves under it (its heartbeat beats); give each worker of a "
                "shard its own --name, or stop the other one first"
            )
    await stream.r.delete(hb)  # a hash that outlived its TTL without a beat: not a worker's


def _who(row: list[bytes | None]) -> tuple[str, str]:
    """The pid and host of a heartbeat's ``beat, pid, host, ...`` fields ("?": missing)."""
    pid, host = (v.decode(errors="replace") if v else "?" for v in row[1:3])
    return pid, host


def _gone_here(pid: str, host: str) -> bool:
    """Whether the heartbeat's process ran on this host and is gone (or is this process: a
    container restarted under the same pid), so its name is free without waiting."""
    if host != socket.gethostname() or not pid.isascii() or not pid.isdigit():
        return False
    if int(pid) == os.getpid():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):  # alive under another user, or no pid at all: not known
        return False
    return False


async def record_engine(stream: ShardStream, settings: Settings, engine: Engine) -> None:
    """Tell producers the engine's KV block size (predicted hits are rounded to it)."""
    await retry(
        "recording the engine's block size",
        lambda: stream.r.hset(stream.keys.config, "block_size", engine.block_size),
        settings=settings,
    )


async def warm_up(engine: Engine, request_id: str, task: str = "generate") -> float:
    """One tiny request through the engine (an embedding for an engine that embeds), then an
    empty prefix cache; returns seconds."""
    t0 = time.perf_counter()
    if task == "embed":
        await engine.embed(EmbedRequest(request_id, [[1] * 8]))
        await engine.reset_prefix_cache()
        return time.perf_counter() - t0
    await engine.generate(
        EngineRequest(
            request_id=request_id,
            prompt_token_ids=[1] * 8,
            sampling={"max_tokens": 2, "ignore_eos": True},
        )
    )
    await engine.reset_prefix_cache()
    return time.perf_counter() - t0
