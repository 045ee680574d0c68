"""Redis faults: redis-server killed and restarted (with and without its AOF), the consumer group
lost mid-burst or while a worker's engine starts (docs/delivery.md).

Workers are real `Worker` loops over the deterministic tests/fake_engine.py (the `fake_worker`
fixture); each test adds the faults it saw land and what its bursts lost or doubled to the ledger
(tests/ledger.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest
import redis

from fake_engine import FakeEngine
from helpers import FakeWorker, queue_empty, requests, wait_burst, wait_until
from ledger import LEDGER, account
from prefixq.keys import GROUP, Keys
from prefixq.producer import Producer
from prefixq.redis_server import RedisServer
from prefixq.settings import Settings

pytestmark = pytest.mark.slow

MakeWorker = Callable[..., FakeWorker]


def test_redis_kill_9_mid_burst_with_aof_burst_completes(
    r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """Given a burst enqueued on a redis-server with AOF (appendfsync everysec) and given time to
    fsync (>1 s; Redis 7.0 has no WAITAOF), when redis-server is killed with SIGKILL mid-burst and
    restarted on the same port, the worker and the waiter reconnect and every request ends with
    exactly one result."""
    with RedisServer(appendonly=True) as srv:
        s = Settings(
            redis_url=srv.url,
            namespace="aof",
            shards=1,
            max_inflight=4,
            heartbeat_s=0.5,
            claim_idle_s=3.0,
        )
        rr = redis.Redis.from_url(srv.url)
        try:
            with fake_worker(s, name="aofw"):
                burst = Producer(s).submit(requests(120, lambda i: f"sleep:0.05 aof {i}"))
                time.sleep(1.5)  # everysec: the whole enqueued burst is on disk now
                done = wait_until(
                    lambda: int(rr.hget(Keys(s.namespace).burst(burst), "done") or 0) >= 20,
                    30,
                    "20 results",
                )
                assert done
                before = rr.hlen(Keys(s.namespace).results(burst))
                srv.kill()
                LEDGER.fault(f"kill -9 redis-server mid-burst ({before}/120 results recorded)")
                time.sleep(1.0)
                srv.start()
                print("  redis-server restarted on the same port from its AOF")
                wait_burst(rr, s, burst, 90)
                out = account(rr, s, burst, 120)
            assert (out.lost, out.duplicated, out.failed) == (0, 0, 0)
            assert queue_empty(rr, s) == (0, 0)
        finally:
            rr.close()


def test_producer_and_worker_retry_while_redis_restarts(fake_worker: MakeWorker) -> None:
    """Given redis-server down (killed), when a producer submits while it is being restarted,
    the producer's retries with backoff carry the burst through; the worker, which saw Redis
    vanish while idle, resumes and serves it."""
    with RedisServer(appendonly=True) as srv:
        s = Settings(redis_url=srv.url, namespace="retry", shards=1, heartbeat_s=0.5)
        rr = redis.Redis.from_url(srv.url)
        try:
            with fake_worker(s, name="rw"):
                srv.kill()
                LEDGER.fault("kill -9 redis-server; restarted 1.5 s later, during a submit")
                restart = threading.Timer(1.5, srv.start)
                restart.start()
                t0 = time.monotonic()
                burst = Producer(s).submit(requests(10))
                took = time.monotonic() - t0
                restart.join()
                print(f"  submit went through after {took:.1f}s of retries")
                wait_burst(rr, s, burst, 60)
                out = account(rr, s, burst, 10)
            assert took >= 1.0
            assert (out.lost, out.duplicated, out.done) == (0, 0, 10)
        finally:
            rr.close()


def test_lost_consumer_group_is_recreated_and_nothing_is_lost(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """Given a worker mid-burst, when its consumer group disappears (XGROUP DESTROY: what a Redis
    restart without persistence does to it), the worker joins again (NOGROUP), is delivered the
    entries not yet done, and the burst completes with one result per request."""
    s = make_settings(max_inflight=2)
    with fake_worker(s, name="ng"):
        burst = Producer(s).submit(requests(30, lambda i: f"sleep:0.05 group {i}"))
        wait_until(lambda: r.hlen(Keys(s.namespace).results(burst)) >= 6, 30, "6 results")
        r.xgroup_destroy(Keys(s.namespace).stream(0), GROUP)
        LEDGER.fault("XGROUP DESTROY of the shard's consumer group mid-burst")
        wait_burst(r, s, burst, 60)
        out = account(r, s, burst, 30)
    assert (out.lost, out.duplicated, out.failed) == (0, 0, 0)
    assert queue_empty(r, s) == (0, 0)


def test_group_lost_while_the_engine_starts_worker_rejoins(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """Given a worker that joined its group and is starting its engine, when the group disappears
    (Redis restarted empty) before it serves, its start-up dead-letter pass finds nothing pending
    instead of failing, and it serves a burst."""
    s = make_settings()
    keys = Keys(s.namespace)

    class SlowStart(FakeEngine):
        async def start(self) -> None:
            await asyncio.to_thread(
                wait_until, lambda: r.exists(keys.stream(0)) == 1, 30, "the group joined"
            )
            r.delete(keys.stream(0))  # the stream and its group, as an empty restart leaves them
            LEDGER.fault("stream and group deleted while the engine starts")
            await super().start()

    with fake_worker(s, name="gl", engine=SlowStart(lethal=False)):
        burst = Producer(s).submit(requests(5))
        wait_burst(r, s, burst, 60)
        out = account(r, s, burst, 5)
    assert (out.lost, out.duplicated, out.done) == (0, 0, 5)


def test_redis_restart_without_persistence_worker_rejoins(fake_worker: MakeWorker) -> None:
    """Given a worker on a redis-server without AOF, when the server is killed and restarted
    empty, the worker recreates its stream and group and serves the next burst."""
    with RedisServer(appendonly=False) as srv:
        s = Settings(redis_url=srv.url, namespace="empty", shards=1, heartbeat_s=0.5)
        rr = redis.Redis.from_url(srv.url)
        try:
            with fake_worker(s, name="ew"):
                srv.kill()
                LEDGER.fault("kill -9 redis-server without persistence (restarts empty)")
                time.sleep(0.5)
                srv.start()
                burst = Producer(s).submit(requests(5))
                wait_burst(rr, s, burst, 60)
                out = account(rr, s, burst, 5)
            assert (out.lost, out.duplicated, out.done) == (0, 0, 5)
        finally:
            rr.close()
