"""`min_replicas_acked`: confirming writes with WAIT before they are promised.

Redis replicates asynchronously: a write a master acknowledged is lost if the master dies before
its replica has it and the replica is promoted. With ``min_replicas_acked`` = n > 0, a producer
fences before `submit` returns (every master: its entries, burst record, prefixes and indexes
spread over all of them), a worker before it acks a group's entries (the masters that hold the
group's burst records and results). A fence is, on ONE connection to the master,
``SET <fence key on that master> n PX ..`` then ``WAIT n timeout``: WAIT waits until the replicas
have everything that connection wrote, and a master's replication is one ordered stream, so the
fence's SET comes after every earlier write of every client. Fewer than n replicas within
``min_replicas_acked_timeout_ms`` is `ReplicasBehind`: the producer's submit fails (nothing
claimed submitted), a worker does not ack (the entries are delivered again and their results,
already recorded, count once). A single Redis with replicas works the same way (one fence).

A fence's key carries a hash tag ``{f<i>}`` whose slot that master serves, found once per master
by trying i = 0, 1, ... (a few tries: 3 masters split the 16384 slots).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import redis
import redis.asyncio as aredis
from redis.asyncio.cluster import PipelineCommand

from prefixq.core.errors import ReplicasBehind
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.store.connection import is_cluster
from prefixq.store.redis_url import redact

__all__ = ["afence", "fence", "fence_key"]

#: how long a fence key lives, ms (it only needs to outlive its WAIT)
_TTL_MS = 60_000
#: tags tried to find one on a given master
_MAX_TAGS = 100_000


def fence_key(r: Any, keys: Keys, node: Any) -> str:
    """A fence key whose slot ``node`` (a cluster master) serves now."""
    for i in range(_MAX_TAGS):
        key = keys.fence(i)
        if r.get_node_from_key(key).name == node.name:
            return key
    raise ReplicasBehind(f"no fence key found on master {node.name}")  # pragma: no cover


def _check(got: Any, where: str, settings: Settings) -> None:
    n = settings.min_replicas_acked
    if isinstance(got, Exception):
        raise got
    if int(got) < n:
        raise ReplicasBehind(
            f"only {int(got)} of the {n} replicas min_replicas_acked asks for confirmed the "
            f"writes on {where} within {settings.min_replicas_acked_timeout_ms} ms (a replica "
            "down or behind; a failover now could lose them)"
        )


def _commands(key: str, settings: Settings) -> list[tuple[Any, ...]]:
    n = settings.min_replicas_acked
    return [("SET", key, n, "PX", _TTL_MS), ("WAIT", n, settings.min_replicas_acked_timeout_ms)]


def _targets(r: Any, written: Iterable[str] | None) -> list[Any]:
    """The masters to fence: those serving ``written`` (None: every master)."""
    if written is None:
        return list(r.get_primaries())
    nodes: dict[str, Any] = {}
    for key in written:
        node = r.get_node_from_key(key)
        nodes.setdefault(node.name, node)
    return list(nodes.values())


async def afence(r: aredis.Redis, settings: Settings, written: Iterable[str] | None = None) -> int:
    """Fence (asyncio client) the masters of the keys ``written`` (None: every master); nothing
    when ``min_replicas_acked`` is 0. Returns the number of masters fenced."""
    if settings.min_replicas_acked <= 0:
        return 0
    if not is_cluster(r):
        pipe = r.pipeline(transaction=False)  # one connection: WAIT follows its SET
        for cmd in _commands(settings.keys.fence(0), settings):
            pipe.execute_command(*cmd)
        _check((await pipe.execute(raise_on_error=False))[-1], redact(settings.redis_url), settings)
        return 1
    await r.initialize()  # the slot map (a no-op once the client has one)
    nodes = _targets(r, written)

    async def one(node: Any) -> None:
        cmds = [
            PipelineCommand(i, *c)
            for i, c in enumerate(_commands(fence_key(r, settings.keys, node), settings))
        ]
        await node.execute_pipeline(cmds)  # one connection of that node
        _check(
            cmds[0].result if isinstance(cmds[0].result, Exception) else cmds[1].result,
            f"master {node.name}",
            settings,
        )

    await asyncio.gather(*(one(n) for n in nodes))
    return len(nodes)


def fence(r: redis.Redis, settings: Settings, written: Iterable[str] | None = None) -> int:
    """`afence` with a blocking client."""
    if settings.min_replicas_acked <= 0:
        return 0
    if not is_cluster(r):
        pipe = r.pipeline(transaction=False)
        for cmd in _commands(settings.keys.fence(0), settings):
            pipe.execute_command(*cmd)
        _check(pipe.execute(raise_on_error=False)[-1], redact(settings.redis_url), settings)
        return 1
    nodes = _targets(r, written)
    for node in nodes:
        pipe = r.get_redis_connection(node).pipeline(transaction=False)
        for cmd in _commands(fence_key(r, settings.keys, node), settings):
            pipe.execute_command(*cmd)
        replies = pipe.execute(raise_on_error=False)
        _check(
            replies[0] if isinstance(replies[0], Exception) else replies[1],
            f"master {node.name}",
            settings,
        )
    return len(nodes)
