"""Moving a shard's queue across hash slots on a real Redis Cluster (tests/redis_cluster.py), with
the target's master killed -9 mid-move while its replica is behind (docs/delivery.md, "An elastic
fleet": take, put, done, each atomic in one slot and safe to repeat).

The target's replica is cut off first (SIGSTOP, replication link closed), so the put lands only
on the master that then dies. With ``min_replicas_acked=1`` the put's fence fails, the plan stays
in the source's slot, and the move finished after the promotion puts every entry once; with it
off, the plan is deleted after an unconfirmed put and the test REPORTS what the failover took
(what docs/delivery.md says each setting guarantees), asserting only that nothing is doubled.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import redis

from helpers import queued_entries
from ledger import LEDGER
from prefixq.client import Producer
from prefixq.core import wire
from prefixq.core.entries import Entry
from prefixq.core.errors import RedisUnavailable, ReplicasBehind, WritesLost
from prefixq.core.keys import FIELD, Keys
from prefixq.core.settings import Settings
from prefixq.store import entry_moves
from prefixq.store.connection import async_client
from prefixq.store.entry_moves import EntryMoves
from prefixq.worker.handover import Handover
from redis_cluster import OnShard, RedisCluster

pytestmark = pytest.mark.slow

N = 60
SOURCE, TARGET = 2, 3


def _move(s: Settings, expected: type[BaseException]) -> BaseException | None:
    """An operator's move of shard SOURCE to the live shards: the ``expected`` error it raised,
    or None when it returned."""

    async def move() -> BaseException | None:
        client = async_client(s)
        try:
            await Handover(client, s, name="mover").move_shard(SOURCE, 4, why="operator")
            return None
        except expected as e:
            return e
        finally:
            await client.aclose()

    return asyncio.run(move())


def _requests() -> list[dict[str, Any]]:
    return [
        {"id": f"m{i}", "prefix": f"document {i % 12} " * 30, "prompt": f"q{i}", "max_tokens": 4}
        for i in range(N)
    ]


def _submit(s: Settings) -> None:
    """Queue N requests on SOURCE, the set-up of every test here: its fence waits up to 30 s
    (under load a replica took more than the test's own 500 ms to confirm the submit, which
    failed before the move the test is about began)."""
    patient = s.replace(min_replicas_acked_timeout_ms=max(30_000, s.min_replicas_acked_timeout_ms))
    Producer(patient).submit(_requests(), placement=OnShard(SOURCE))


def _ids(cr: redis.Redis, s: Settings, shard: int) -> list[str]:
    return [Entry.from_wire(wire.decode(f[FIELD])).id for _, f in queued_entries(cr, s, shard)]


def _move_with_target_master_lost(
    cluster: RedisCluster, s: Settings, cr: redis.Redis
) -> tuple[BaseException | None, int]:
    """Queue N requests on SOURCE, mark TARGET live, cut TARGET's replica off, move SOURCE's
    queue (the put reaches only TARGET's master), then kill that master, promote its replica and
    restart the node; finally run the move's `finish` as the next mover would (again until its
    fences confirm). Returns the
    move's error (None: it returned) and how many entries the put had written before the kill."""
    keys = Keys(s.namespace)
    _submit(s)
    assert len(_ids(cr, s, SOURCE)) == N
    cr.hset(keys.live, str(TARGET), repr(time.time()))
    master = cluster.master_of(keys.intake(TARGET, "normal"))
    assert master is not cluster.master_of(keys.intake(SOURCE, "normal"))
    replica = cluster.replica_of(master)
    cluster.isolate(replica, master)

    err = _move(s, ReplicasBehind)
    written = len(_ids(cr, s, TARGET))
    cluster.kill(master)
    cluster.resume(replica)
    assert cluster.wait_failover(keys.intake(TARGET, "normal"), master) is replica
    cluster.restart(master)
    cluster.wait_whole(60)

    async def finish() -> None:
        """As the next live worker's looks do: again until the fences confirm (the restarted
        node may still be syncing with the new master: ReplicasBehind until it has)."""
        client = async_client(s)
        deadline = time.monotonic() + 60
        try:
            while True:
                try:
                    await EntryMoves(client, s).finish(SOURCE)
                    return
                except ReplicasBehind:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)
        finally:
            await client.aclose()

    asyncio.run(finish())
    return err, written


def test_a_move_whose_target_master_fails_over_puts_every_entry_once(
    cluster: RedisCluster, cluster_settings: Callable[..., Settings], cr: redis.Redis
) -> None:
    """With min_replicas_acked=1: the put's fence fails (the replica is cut off), so the plan is
    kept; the target's master dies with the put; after the promotion, finishing the move puts
    every entry on the target exactly once and leaves no plan."""
    s = cluster_settings(min_replicas_acked=1, min_replicas_acked_timeout_ms=500)
    err, written = _move_with_target_master_lost(cluster, s, cr)
    assert isinstance(err, ReplicasBehind), err
    assert written > 0, "the put wrote nothing on the master before it died"
    keys = Keys(s.namespace)
    assert cr.hlen(keys.moving(SOURCE)) == 0
    ids = Counter(_ids(cr, s, TARGET)) + Counter(_ids(cr, s, SOURCE))
    assert ids == Counter(f"m{i}" for i in range(N)), ids
    assert _ids(cr, s, SOURCE) == []
    LEDGER.fault(
        f"kill -9 of the target's master mid-move ({written} entries put on it, its replica "
        "cut off): every entry once after the promotion"
    )


def test_without_min_replicas_acked_the_same_failover_doubles_nothing_and_says_what_it_lost(
    cluster: RedisCluster, cluster_settings: Callable[..., Settings], cr: redis.Redis
) -> None:
    """With min_replicas_acked=0: the move completes (nothing confirms the put), the failover
    takes the put with it: the test prints how many entries were lost (shown, not asserted) and
    asserts that none is doubled."""
    s = cluster_settings(min_replicas_acked=0)
    err, written = _move_with_target_master_lost(cluster, s, cr)
    assert err is None
    ids = Counter(_ids(cr, s, TARGET)) + Counter(_ids(cr, s, SOURCE))
    assert max(ids.values(), default=1) == 1, ids
    print(f"  min_replicas_acked=0: {written} entries put, {N - sum(ids.values())} lost")


def test_a_failover_between_the_put_and_its_fence_keeps_the_plan(
    cluster: RedisCluster,
    cluster_settings: Callable[..., Settings],
    cr: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With min_replicas_acked=1, the put lands on the target's master only (its replica cut off),
    and that master fails over after the put and before its fence (the killed node back as the
    new master's replica, so WAIT 1 confirms there): the fence reads the entries moved in back,
    finds them missing (WritesLost), the plan stays, and finishing the move puts every entry on
    the target once. Before: the fence confirmed on the promoted replica, the plan was deleted,
    and the entries the put had written were gone from every shard."""
    s = cluster_settings(min_replicas_acked=1, min_replicas_acked_timeout_ms=1000)
    keys = Keys(s.namespace)
    _submit(s)
    cr.hset(keys.live, str(TARGET), repr(time.time()))
    intake = keys.intake(TARGET, "normal")
    master = cluster.master_of(intake)
    replica = cluster.replica_of(master)
    real = entry_moves.afence
    lost: list[int] = []

    def failover() -> None:
        cluster.kill(master)
        cluster.resume(replica)
        assert cluster.wait_failover(intake, master) is replica
        cluster.restart(master)
        cluster.wait_whole(60)

    async def afence(r: Any, settings: Settings, written: Any = None, **kw: Any) -> int:
        if not lost and written and keys.moved_in(TARGET) in written:
            await asyncio.to_thread(failover)
            for _ in range(50):  # the client follows the new slot map
                try:
                    lost.append(await r.xlen(intake))
                    break
                except redis.RedisError:
                    await asyncio.sleep(0.1)
        return await real(r, settings, written, **kw)

    monkeypatch.setattr(entry_moves, "afence", afence)
    cluster.isolate(replica, master)

    err = _move(s, RedisUnavailable)
    assert lost == [0], "the failover kept the put: the window was missed"
    assert isinstance(err, WritesLost), err
    assert cr.hlen(keys.moving(SOURCE)) > 0, "the plan was deleted after a lost put"
    monkeypatch.undo()

    async def finish() -> None:
        client = async_client(s)
        try:
            await EntryMoves(client, s).finish(SOURCE)
        finally:
            await client.aclose()

    asyncio.run(finish())
    assert Counter(_ids(cr, s, TARGET)) == Counter(f"m{i}" for i in range(N))
    assert _ids(cr, s, SOURCE) == [] and cr.hlen(keys.moving(SOURCE)) == 0
