"""The fence proves the write it guards (store/fence.py): a failover of a real Redis Cluster
(tests/redis_cluster.py) that lands between a worker's record and its fence.

`min_replicas_acked`'s WAIT confirms what the master it runs on holds. A worker records a result
on the master of its burst, then fences; if that master dies in between and its replica, which
never got the record, is promoted (and the worker's slot map follows), a fence that only WAITs
confirms on the new master, and the entry is acked while its result is gone. The test makes that
window wide on purpose: the replica is cut off before the worker records, and the worker's writer
is held between its record and its fence (a patch of `ResultWriter._fenced`) while the test kills
the master -9, lets the replica take over and brings the killed node back as its replica.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis

from helpers import wait_burst
from prefixq.client import Producer
from prefixq.client.enqueue import BurstWriter
from prefixq.client.producer import HEAD
from prefixq.client.submit_args import new_burst_id
from prefixq.core.errors import WritesLost
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.worker.writer import ResultWriter
from redis_cluster import ClusterFakeWorker, Node, OnShard, RedisCluster

pytestmark = pytest.mark.slow

SHARD = 1


def burst_id_off(cluster: RedisCluster, keys: Keys, master: Node) -> str:
    """A fresh burst id whose record and results another master than ``master`` serves."""
    for _ in range(200):
        b = new_burst_id()
        if cluster.master_of(keys.results(b)) is not master:
            return b
    raise AssertionError(f"no burst id off {master} in 200 tries")


class FailoverBeforeFence:
    """Patches `ResultWriter._fenced`: its first call first fails the results' master over (in a
    thread: the cluster tools block), makes the worker's client follow the new slot map, and
    checks the record is gone from the new master; then the fence runs as it would."""

    def __init__(self, cluster: RedisCluster, results_key: str, master: Node) -> None:
        self.cluster, self.key, self.master = cluster, results_key, master
        self.replica = cluster.replica_of(master)
        self.calls = 0
        self.lost_before_fence: int | None = None

    def cut(self) -> None:
        """Cut the replica off: what the master records from now on never reaches it."""
        self.cluster.isolate(self.replica, self.master)

    def _failover(self) -> None:
        c = self.cluster
        c.kill(self.master)
        c.resume(self.replica)
        new = c.wait_failover(self.key, self.master)
        assert new is self.replica, f"{new} took over, not the replica {self.replica}"
        c.restart(self.master)  # rejoins as the new master's replica: WAIT 1 can confirm there
        c.wait_whole()

    def patch(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real: Callable[..., Awaitable[bool]] = ResultWriter._fenced
        hook = self

        async def fenced(writer: ResultWriter, done: Any, backoff: Any) -> bool:
            hook.calls += 1
            if hook.calls == 1:
                await asyncio.to_thread(hook._failover)
                # the worker's next command to that slot (its reader's, its heartbeat's: here
                # the writer's own) finds the old connection dead and the slot map changed
                # (up to 30 s: on a loaded 2-core machine the client's new slot map took more
                # than the 5 s this once allowed, and the probe read nothing though the fence
                # then found the write lost and recorded it again, as the test wants)
                deadline = time.monotonic() + 30
                while hook.lost_before_fence is None and time.monotonic() < deadline:
                    try:
                        hook.lost_before_fence = await writer.stream.r.hlen(hook.key)
                    except redis.RedisError:
                        await asyncio.sleep(0.1)
            return await real(writer, done, backoff)

        monkeypatch.setattr(ResultWriter, "_fenced", fenced)


def test_a_failover_between_record_and_fence_does_not_ack_a_lost_result(
    cluster: RedisCluster,
    cluster_settings: Callable[..., Settings],
    cr: redis.Redis,
    cluster_worker: Callable[..., ClusterFakeWorker],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With min_replicas_acked=1, the master holding a burst's results records one, loses it in a
    failover before the worker's fence runs, and the promoted replica (replicated by the restarted
    node) confirms the fence: the worker finds the result missing, records it again, and the burst
    finishes with it (before: the fence confirmed on the new master, the entry was acked, and the
    result was lost for good)."""
    s = cluster_settings(min_replicas_acked=1, min_replicas_acked_timeout_ms=1000)
    keys = Keys(s.namespace)
    queue_master = cluster.master_of(keys.intake(SHARD, "normal"))
    burst = burst_id_off(cluster, keys, queue_master)
    master = cluster.master_of(keys.results(burst))
    hook = FailoverBeforeFence(cluster, keys.results(burst), master)
    hook.patch(monkeypatch)
    Producer(s).submit(
        [{"id": "only", "prompt": "alpha beta", "max_tokens": 8}],
        placement=OnShard(SHARD),
        burst_id=burst,
    )
    hook.cut()  # after the submit's own fence: the worker's record never reaches the replica
    cluster_worker(s, shard=SHARD, name="w1")
    got = wait_burst(cr, s, burst, timeout=30)
    assert hook.lost_before_fence == 0, "the failover kept the record: the window was missed"
    assert [(r.id, r.text) for r in got] == [("only", "beta alpha")]
    assert hook.calls >= 2, "the fence confirmed the lost result at once"
    assert "missing on master" in caplog.text


class FailoverAfterSend:
    """Patches `BurstWriter.send`: after its ``after``-th call returns (the chunk is answered),
    fails the shard's master over as `FailoverBeforeFence` does and makes the producer's client
    follow, recording how many entries the promoted replica holds."""

    def __init__(self, cluster: RedisCluster, intake: str, master: Node, after: int) -> None:
        self.failover = FailoverBeforeFence(cluster, intake, master)
        self.intake, self.after = intake, after
        self.calls = 0
        self.held_after: int | None = None

    def patch(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real: Callable[..., Awaitable[None]] = BurstWriter.send
        hook = self

        async def send(writer: BurstWriter, *args: Any, **kw: Any) -> None:
            await real(writer, *args, **kw)
            hook.calls += 1
            if hook.calls == hook.after:
                await asyncio.to_thread(hook.failover._failover)
                for _ in range(50):
                    try:
                        hook.held_after = await writer.r.xlen(hook.intake)
                        break
                    except redis.RedisError:
                        await asyncio.sleep(0.1)

        monkeypatch.setattr(BurstWriter, "send", send)


@pytest.mark.parametrize("n", [HEAD, 5 * HEAD], ids=["lost-last-chunk", "lost-earlier-chunk"])
def test_a_failover_after_a_chunk_was_sent_fails_the_submit(
    cluster: RedisCluster,
    cluster_settings: Callable[..., Settings],
    cr: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    n: int,
) -> None:
    """With min_replicas_acked=1, the master of a shard's queue answers a burst's head and loses
    it in a failover (its replica, cut off, never got it) before the submit's fence: the submit
    fails with WritesLost and the burst is cancelled, whether the head was its last chunk (the
    fence reads the shard's count back) or a later chunk went to the promoted replica (that chunk
    finds the entries before it missing). Before: the fence confirmed on the new master and
    submit returned a burst missing its head, which no worker would ever answer."""
    s = cluster_settings(min_replicas_acked=1, min_replicas_acked_timeout_ms=1000)
    keys = Keys(s.namespace)
    intake = keys.intake(SHARD, "normal")
    master = cluster.master_of(intake)
    burst = burst_id_off(cluster, keys, master)
    hook = FailoverAfterSend(cluster, intake, master, after=1)
    hook.patch(monkeypatch)
    hook.failover.cut()
    reqs = [{"id": f"r{i}", "prompt": f"alpha {i}", "max_tokens": 4} for i in range(n)]
    with pytest.raises(WritesLost, match="missing"):
        Producer(s).submit(reqs, placement=OnShard(SHARD), burst_id=burst)
    assert hook.held_after == 0, "the failover kept the head: the window was missed"
    assert cr.hget(keys.burst(burst), "status") == b"cancelled"
