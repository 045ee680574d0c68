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

**A fence proves the writes it guards** (``present``: hash fields that must exist; ``counted``:
counters that must be at least so high, such as a submission's count of entries on a shard;
``members``: set members that must exist, such as the entries moved onto a shard; ``scored``:
sorted-set members, such as a burst's deadline index entry; ``keys``: keys that must
exist, such as the stored prefixes a burst's entries refer to). WAIT confirms
what the master it runs on holds, not what an earlier command wrote: if the slot map changes
between the write and the fence (the master dies, its replica, which never got the write, is
promoted, and the client's map follows), a bare fence runs on the new master, its replicas confirm
it, and the caller acks writes that are gone. So the fence's pipeline first reads the writes back
(``HMGET``, ``GET``, ``SMISMEMBER``, ``ZMSCORE``, ``EXISTS``) on the same connection, then
``SET`` + ``WAIT``: writes all there and n replicas confirming means the replicas hold them (the
SET comes after the read on that master's one replication stream, so WAIT covers what the read
saw), whichever node wrote them; a
write missing is `WritesLost` and the caller writes again (a producer's submit fails); a node that
no longer serves the slot answers MOVED (transient: the caller retries). It costs no round trip
more: the read rides in the fence's pipeline. docs/delivery.md, "Redis Cluster and failover".
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aredis
from redis.asyncio.cluster import PipelineCommand

from prefixq.core.errors import ReplicasBehind, WritesLost
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


#: hash fields a fence must find before it confirms: {hash key: fields}
Present = Mapping[str, Collection[int | str]]
#: counters a fence must find at least this high: {string key: least value}
Counted = Mapping[str, int]
#: set (or sorted-set) members a fence must find: {set key: members}
Members = Mapping[str, Collection[bytes | str]]


@dataclass(frozen=True, slots=True)
class _Proof:
    """One read a fence's pipeline makes before its SET and WAIT, and what it must find: a hash's
    fields (``hash``), a counter at least ``least`` (``count``), a set's members (``set``), a
    sorted set's members (``zset``), a key (``key``)."""

    kind: str
    key: str
    items: tuple[int | str | bytes, ...] = ()
    least: int = 0

    def command(self) -> tuple[Any, ...]:
        if self.kind == "hash":
            return ("HMGET", self.key, *self.items)
        if self.kind == "count":
            return ("GET", self.key)
        if self.kind == "zset":
            return ("ZMSCORE", self.key, *self.items)
        if self.kind == "key":
            return ("EXISTS", self.key)
        return ("SMISMEMBER", self.key, *self.items)

    def missing(self, got: Any) -> list[str]:
        """What of this proof the reply ``got`` lacks, for the error."""
        if self.kind == "count":
            have = int(got or 0)
            return [] if have >= self.least else [f"{self.key} ({have} of {self.least})"]
        if self.kind == "key":
            return [] if got else [self.key]
        lost = (it for it, v in zip(self.items, got, strict=True) if v is None or v == 0)
        return [f"{self.key} {it.decode() if isinstance(it, bytes) else it}" for it in lost]


def _proofs(
    present: Present, counted: Counted, members: Members, scored: Members, keys: Collection[str]
) -> list[_Proof]:
    return [
        *(_Proof("hash", k, tuple(f)) for k, f in present.items() if f),
        *(_Proof("count", k, least=n) for k, n in counted.items() if n > 0),
        *(_Proof("set", k, tuple(m)) for k, m in members.items() if m),
        *(_Proof("zset", k, tuple(m)) for k, m in scored.items() if m),
        *(_Proof("key", k) for k in keys),
    ]


def _check(replies: list[Any], proofs: Sequence[_Proof], where: str, settings: Settings) -> None:
    """Raise what ``replies`` (one per read of ``proofs``, then SET's and WAIT's) say went wrong:
    an error reply, a write missing (`WritesLost`), fewer replicas than asked (`ReplicasBehind`)."""
    for got in replies:
        if isinstance(got, Exception):
            raise got
    missing = [m for p, got in zip(proofs, replies, strict=False) for m in p.missing(got)]
    if missing:
        raise WritesLost(
            f"{len(missing)} writes to confirm are missing on {where} (a failover between the "
            f"write and its fence lost them): {', '.join(missing[:5])}"
        )
    n = settings.min_replicas_acked
    got = replies[-1]
    if int(got) < n:
        raise ReplicasBehind(
            f"only {int(got)} of the {n} replicas min_replicas_acked asks for confirmed the "
            f"writes on {where} within {settings.min_replicas_acked_timeout_ms} ms (a replica "
            "down or behind; a failover now could lose them)"
        )


def _commands(key: str, settings: Settings, proofs: Sequence[_Proof] = ()) -> list[tuple[Any, ...]]:
    """The fence's pipeline: the proofs' reads, then SET and WAIT (one connection)."""
    n = settings.min_replicas_acked
    return [
        *(p.command() for p in proofs),
        ("SET", key, n, "PX", _TTL_MS),
        ("WAIT", n, settings.min_replicas_acked_timeout_ms),
    ]


def _targets(
    r: Any, written: Iterable[str] | None, proofs: Sequence[_Proof]
) -> list[tuple[Any, list[_Proof]]]:
    """The masters to fence, each with the proofs its pipeline reads: those serving ``written``
    and the proofs' keys (``written`` None: every master)."""
    nodes: dict[str, tuple[Any, list[_Proof]]] = {}
    if written is None:
        nodes = {n.name: (n, []) for n in r.get_primaries()}
    for key in [*(written or ()), *(p.key for p in proofs)]:
        node = r.get_node_from_key(key)
        nodes.setdefault(node.name, (node, []))
    for p in proofs:
        nodes[r.get_node_from_key(p.key).name][1].append(p)
    return list(nodes.values())


async def afence(
    r: aredis.Redis,
    settings: Settings,
    written: Iterable[str] | None = None,
    *,
    present: Present | None = None,
    counted: Counted | None = None,
    members: Members | None = None,
    scored: Members | None = None,
    keys: Collection[str] = (),
) -> int:
    """Fence (asyncio client) the masters of the keys ``written`` (None: every master), after
    reading back on each ``present``'s hash fields, ``counted``'s counters, ``members``'s set
    members, ``scored``'s sorted-set members and the ``keys`` (`WritesLost` when one is missing
    or a counter is short); nothing when ``min_replicas_acked`` is 0. Returns the number of
    masters fenced."""
    if settings.min_replicas_acked <= 0:
        return 0
    proofs = _proofs(present or {}, counted or {}, members or {}, scored or {}, keys)
    if not is_cluster(r):
        pipe = r.pipeline(transaction=False)  # one connection: WAIT follows its SET
        for cmd in _commands(settings.keys.fence(0), settings, proofs):
            pipe.execute_command(*cmd)
        replies = await pipe.execute(raise_on_error=False)
        _check(replies, proofs, redact(settings.redis_url), settings)
        return 1
    await r.initialize()  # the slot map (a no-op once the client has one)
    nodes = _targets(r, written, proofs)

    async def one(node: Any, proofs: list[_Proof]) -> None:
        cmds = [
            PipelineCommand(i, *c)
            for i, c in enumerate(_commands(fence_key(r, settings.keys, node), settings, proofs))
        ]
        await node.execute_pipeline(cmds)  # one connection of that node
        _check([c.result for c in cmds], proofs, f"master {node.name}", settings)

    await asyncio.gather(*(one(n, p) for n, p in nodes))
    return len(nodes)


def fence(r: redis.Redis, settings: Settings, written: Iterable[str] | None = None) -> int:
    """`afence` with a blocking client."""
    if settings.min_replicas_acked <= 0:
        return 0
    if not is_cluster(r):
        pipe = r.pipeline(transaction=False)
        for cmd in _commands(settings.keys.fence(0), settings):
            pipe.execute_command(*cmd)
        _check(pipe.execute(raise_on_error=False), [], redact(settings.redis_url), settings)
        return 1
    nodes = _targets(r, written, [])
    for node, _ in nodes:
        pipe = r.get_redis_connection(node).pipeline(transaction=False)
        for cmd in _commands(fence_key(r, settings.keys, node), settings):
            pipe.execute_command(*cmd)
        _check(pipe.execute(raise_on_error=False), [], f"master {node.name}", settings)
    return len(nodes)
