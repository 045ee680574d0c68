"""Redis faults: redis-server killed and restarted (with and without its AOF), the consumer group
lost mid-burst or while a worker's engine starts (docs/delivery.md).

Workers are real `Worker` loops over the deterministic tests/fake_engine.py (the `fake_worker`
fixture); each test adds the faults it saw land and what its bursts lost or doubled to the ledger
(tests/ledger.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from fake_engine import FakeEngine
from helpers import FakeWorker, cli, queue_empty, requests, wait_burst, wait_until
from ledger import LEDGER, account
from prefixq.cli.redis_server import RedisServer, free_port
from prefixq.client import Producer
from prefixq.core.errors import RedisUnavailable
from prefixq.core.keys import GROUP, Keys
from prefixq.core.settings import Settings

pytestmark = pytest.mark.slow

MakeWorker = Callable[..., FakeWorker]


def test_redis_kill_9_mid_burst_with_aof_burst_completes(
    r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """Given a burst enqueued on a redis-server with AOF (appendfsync everysec) and given time to
    fsync (>1 s; Redis 7.0 has no WAITAOF), when redis-server is killed with SIGKILL mid-burst
    (checked: results still missing right before the kill, and served after it) and restarted on
    the same port, nothing it had recorded is lost, the worker and the waiter reconnect and every
    request ends with exactly one result."""
    total = 200  # 5 s of work at 4 in flight: the kill lands after ~1.5 s
    with RedisServer(appendonly=True) as srv:
        s = Settings(
            redis_url=srv.url,
            namespace="aof",
            shards=1,
            max_inflight=4,
            heartbeat_s=0.5,
            claim_idle_s=3.0,
        )
        keys = Keys(s.namespace)
        rr = redis.Redis.from_url(srv.url)
        try:
            with fake_worker(s, name="aofw"):
                burst = Producer(s).submit(requests(total, lambda i: f"sleep:0.1 aof {i}"))
                time.sleep(1.5)  # everysec: the whole enqueued burst is on disk now
                wait_until(lambda: rr.hlen(keys.results(burst)) >= 20, 30, "20 results")
                before = rr.hlen(keys.results(burst))
                assert before <= total - 40, f"the burst is nearly done ({before}/{total})"
                srv.kill()
                killed_at = time.time()
                time.sleep(1.0)
                srv.start()
                print("  redis-server restarted on the same port from its AOF")
                kept = wait_until(lambda: _hlen(rr, keys.results(burst)), 30, "Redis back")
                wait_burst(rr, s, burst, 90)
                out = account(rr, s, burst, total)
            after = sum(1 for x in out.results.values() if x.timings.finished > killed_at)
            print(f"  {before}/{total} recorded before the kill, {after} finished after it")
            assert kept >= before, "the AOF kept every result recorded before the kill"
            assert after >= total - before - 8, "the burst ran on after Redis came back"
            LEDGER.fault(f"kill -9 redis-server mid-burst ({before}/{total} results recorded)")
            assert (out.lost, out.duplicated, out.failed) == (0, 0, 0)
            assert queue_empty(rr, s) == (0, 0)
        finally:
            rr.close()


def _hlen(r: redis.Redis, key: str) -> int:
    """HLEN, or 0 while Redis is unreachable or still loading its AOF."""
    try:
        return int(r.hlen(key))
    except (redis.ConnectionError, redis.BusyLoadingError):
        return 0


def redis_down(url: str) -> bool:
    """True when nothing answers at ``url`` (one try, no retries)."""
    c = redis.Redis.from_url(url, retry_on_error=[], socket_connect_timeout=1)
    try:
        c.ping()
    except redis.ConnectionError:
        return True
    finally:
        c.close()
    return False


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
                assert redis_down(srv.url)
                restart = threading.Timer(1.5, srv.start)
                restart.start()
                t0 = time.monotonic()
                burst = Producer(s).submit(requests(10))
                took = time.monotonic() - t0
                restart.join()
                print(f"  submit went through after {took:.1f}s of retries")
                wait_burst(rr, s, burst, 60)
                out = account(rr, s, burst, 10)
            assert took >= 1.0, "the submit waited for Redis to come back"
            LEDGER.fault("kill -9 redis-server; restarted 1.5 s later, during a submit")
            assert (out.lost, out.duplicated, out.done) == (0, 0, 10)
        finally:
            rr.close()


def test_lost_consumer_group_is_recreated_and_nothing_is_lost(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """Given a worker mid-burst, when its consumer group disappears (XGROUP DESTROY: what a Redis
    restart without persistence does to it), the worker joins again (NOGROUP), is delivered the
    entries not yet done, and the burst completes with one result per request."""
    s, total = make_settings(max_inflight=2), 60
    keys = Keys(s.namespace)
    with fake_worker(s, name="ng"):
        burst = Producer(s).submit(requests(total, lambda i: f"sleep:0.05 group {i}"))
        wait_until(lambda: r.hlen(keys.results(burst)) >= 6, 30, "6 results")
        before = r.hlen(keys.results(burst))
        # the group of the burst's lane (most of its entries) and of the intake (its head)
        assert r.xgroup_destroy(keys.lane(0, burst), GROUP) == 1, "the lane's group existed"
        assert r.xgroup_destroy(keys.stream(0), GROUP) == 1, "the intake's group existed"
        destroyed_at = time.time()
        assert before <= total - 20, f"the burst is nearly done ({before}/{total})"
        wait_burst(r, s, burst, 60)
        out = account(r, s, burst, total)
    after = sum(1 for x in out.results.values() if x.timings.admitted > destroyed_at)
    print(f"  {before}/{total} recorded before the group was lost, {after} admitted after")
    assert after >= total - before - 4, "served after the worker joined again"
    LEDGER.fault("XGROUP DESTROY of the shard's consumer group mid-burst")
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
    deleted: list[int] = []

    class SlowStart(FakeEngine):
        async def start(self) -> None:
            await asyncio.to_thread(
                wait_until, lambda: r.exists(keys.stream(0)) == 1, 30, "the group joined"
            )
            # the stream and its group, as an empty restart leaves them
            deleted.append(r.delete(keys.stream(0)))
            await super().start()

    with fake_worker(s, name="gl", engine=SlowStart(lethal=False)):
        assert deleted == [1], "the group was deleted before the worker served"
        LEDGER.fault("stream and group deleted while the engine starts")
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
                assert rr.exists(s.keys.stream(0)) == 1
                srv.kill()
                time.sleep(0.5)
                srv.start()
                assert rr.exists(s.keys.stream(0)) == 0, "Redis came back empty"
                LEDGER.fault("kill -9 redis-server without persistence (restarts empty)")
                burst = Producer(s).submit(requests(5))
                wait_burst(rr, s, burst, 60)
                out = account(rr, s, burst, 5)
            assert (out.lost, out.duplicated, out.done) == (0, 0, 5)
        finally:
            rr.close()


def test_producer_gives_up_with_redis_unavailable_and_the_cli_exits_1(tmp_path: Path) -> None:
    """Given no Redis at the URL, a producer retries with backoff (8 times, capped at 2 s: about
    7 s) and then raises RedisUnavailable saying it cannot reach Redis; `prefixq submit` exits 1
    with that message."""
    s = Settings(redis_url=f"redis://127.0.0.1:{free_port()}/0", namespace="gone", shards=1)
    assert redis_down(s.redis_url)
    t0 = time.monotonic()
    with pytest.raises(RedisUnavailable, match=r"cannot reach Redis at redis://127\.0\.0\.1"):
        Producer(s).submit(requests(1))
    took = time.monotonic() - t0
    print(f"  producer gave up after {took:.1f}s")
    assert took >= 5.0, "it retried before giving up"
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "prompt": "hi"}\n')
    t0 = time.monotonic()
    p = cli(s, "submit", str(src))
    print(f"  prefixq submit: exit {p.returncode} after {time.monotonic() - t0:.1f}s")
    assert p.returncode == 1, p.stderr
    assert "prefixq: error: cannot reach Redis at" in p.stderr
    assert time.monotonic() - t0 >= 5.0


def test_script_cache_flushed_mid_burst_reloads_quietly(
    make_settings: Callable[..., Settings],
    r: redis.Redis,
    fake_worker: MakeWorker,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Given a worker recording results of three bursts at once, when Redis's script cache is
    emptied over and over mid-burst (SCRIPT FLUSH: what a promoted replica looks like), every
    script is loaded again quietly (a DEBUG line, no WARNING or ERROR naming NOSCRIPT: nothing for
    an operator to act on) and every request ends with exactly one result."""
    caplog.set_level(logging.DEBUG, logger="prefixq")
    s, total = make_settings(max_inflight=8, write_batch=16), 120
    stop = threading.Event()
    flushes: list[float] = []

    def flush() -> None:
        c = redis.Redis.from_url(s.redis_url)
        try:
            while not stop.wait(0.03):
                c.script_flush()
                flushes.append(time.time())
        finally:
            c.close()

    with fake_worker(s, name="ns"):
        flusher = threading.Thread(target=flush, daemon=True)
        bursts = [
            Producer(s).submit(requests(total, lambda i, b=b: f"sleep:0.01 ns{b} {i}"))
            for b in range(3)
        ]
        flusher.start()
        try:
            for burst in bursts:
                wait_burst(r, s, burst, 60)
        finally:
            stop.set()
            flusher.join()
        outs = [account(r, s, burst, total) for burst in bursts]
    reloads = [x for x in caplog.records if "NOSCRIPT" in x.getMessage()]
    loud = [x.getMessage() for x in reloads if x.levelno >= logging.WARNING]
    print(f"  {len(flushes)} flushes, {len(reloads)} scripts reloaded after NOSCRIPT")
    LEDGER.fault(f"SCRIPT FLUSH mid-burst ({len(flushes)} times)")
    assert reloads, "a flush landed between a script's load and its call"
    assert not loud, loud[:3]
    for out in outs:
        assert (out.lost, out.duplicated, out.done) == (0, 0, total)
    assert queue_empty(r, s) == (0, 0)
