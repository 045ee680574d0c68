"""The producer's fence proves every write the submit promises (store/fence.py), on a real Redis
Cluster (tests/redis_cluster.py): a stored prefix lost with its master between its write and the
submit's fence fails the submit, and a deadline is on its index's replica before the record is
written.

The fence read back the burst record and the shards' counts only: a stored prefix lost with its
master (its replica cut off, then promoted) went unnoticed, and submit returned with
min_replicas_acked=1 while the entries referred to a prefix that was gone (their requests failed
"stored prefix not found"); and a deadline's index entry could be lost the same way, leaving a
burst that never expires. The window is opened on purpose: the replica is cut off before the
write, and the failover runs right after the write is answered (an adversarial probe's
scenarios, 5 December).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from prefixq.client import Producer
from prefixq.client.enqueue import BurstWriter
from prefixq.client.submit_args import new_burst_id
from prefixq.core import wire
from prefixq.core.entries import digest
from prefixq.core.errors import WritesLost
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from redis_cluster import Node, OnShard, RedisCluster

pytestmark = pytest.mark.slow

SHARD = 1


def _fail_over(cluster: RedisCluster, key: str, master: Node, replica: Node) -> None:
    """Kill ``master`` -9, let its (cut-off) ``replica`` take ``key``'s slots, bring the old
    master back as a replica."""
    cluster.kill(master)
    cluster.resume(replica)
    assert cluster.wait_failover(key, master) is replica
    cluster.restart(master)
    cluster.wait_whole()


async def _follow(r: Any, key: str) -> int:
    """The producer's client follows the new slot map; whether ``key`` is there now."""
    for _ in range(100):
        try:
            return int(await r.exists(key))
        except redis.RedisError:
            await asyncio.sleep(0.1)
    raise AssertionError("the client never followed the failover")


def _burst_off(cluster: RedisCluster, keys: Keys, master: Node) -> str:
    """A burst id whose record is not on ``master``."""
    return next(
        b for b in iter(new_burst_id, None) if cluster.master_of(keys.burst(b)) is not master
    )


def test_a_stored_prefix_lost_before_the_fence_fails_the_submit(
    cluster: RedisCluster,
    cluster_settings: Callable[..., Settings],
    cr: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = cluster_settings(min_replicas_acked=1, min_replicas_acked_timeout_ms=1000)
    keys = Keys(s.namespace)
    qmaster = cluster.master_of(keys.intake(SHARD, "normal"))
    for d in range(200):  # a document whose prefix key lives on another master than the queue
        doc = f"document {d} " + "lorem ipsum " * 100
        pkey = keys.prefix(digest(wire.pack({"x": doc})))
        if cluster.master_of(pkey) is not qmaster:
            break
    pmaster = cluster.master_of(pkey)
    replica = cluster.replica_of(pmaster)
    burst = _burst_off(cluster, keys, pmaster)
    state: dict[str, Any] = {}
    real = BurstWriter.send

    async def send(writer: BurstWriter, count: int, chunk: Any, **kw: Any) -> None:
        if chunk[0].new_prefixes and "cut" not in state:
            state["cut"] = cluster.isolate(replica, pmaster)
            await real(writer, count, chunk, **kw)
            await asyncio.to_thread(_fail_over, cluster, pkey, pmaster, replica)
            state["after"] = await _follow(writer.r, pkey)
            return
        await real(writer, count, chunk, **kw)

    monkeypatch.setattr(BurstWriter, "send", send)
    reqs = [{"id": f"q{i}", "prefix": doc, "prompt": f"question {i}", "max_tokens": 4}
            for i in range(12)]  # fmt: skip
    with pytest.raises(WritesLost, match="missing"):
        Producer(s).submit(reqs, placement=OnShard(SHARD), burst_id=burst)
    assert state.get("after") == 0, f"the failover kept the prefix: the window was missed {state}"
    assert cr.hget(keys.burst(burst), "status") == b"cancelled"


class _Died(BaseException):
    """The producer's process ends here (as a kill -9 would)."""


def test_with_min_replicas_acked_no_record_exists_whose_deadline_is_not_on_a_replica(
    cluster: RedisCluster,
    cluster_settings: Callable[..., Settings],
    cr: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two faults at once: a producer dies between its burst's record and its head (so it never
    fences), and the deadline index's master fails over before its replica got the entry. With
    min_replicas_acked=1 the entry is confirmed on the replica before the record is written: the
    index's replica cut off, the submit fails (ReplicasBehind) before any record exists. Before:
    the record was written, the entry lost with its master, and the burst never expired."""
    from prefixq.client import producer as producer_mod
    from prefixq.core.errors import ReplicasBehind

    s = cluster_settings(min_replicas_acked=1, min_replicas_acked_timeout_ms=500)
    keys = Keys(s.namespace)
    dmaster = cluster.master_of(keys.deadlines)
    burst = _burst_off(cluster, keys, dmaster)
    replica = cluster.replica_of(dmaster)

    async def dead(*a: Any, **kw: Any) -> None:
        raise _Died

    monkeypatch.setattr(producer_mod._Submission, "_send", dead)
    cluster.isolate(replica, dmaster)
    try:
        reqs = [{"id": f"q{i}", "prompt": f"hi {i}", "max_tokens": 4} for i in range(6)]
        with pytest.raises(ReplicasBehind):
            Producer(s).submit(reqs, burst_id=burst, deadline=time.time() + 60)
        assert not cr.exists(keys.burst(burst)), "a record whose deadline no replica holds"
    finally:
        cluster.heal()
