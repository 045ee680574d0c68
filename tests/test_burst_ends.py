"""Cancel and deadlines through the real worker loop (FakeEngine, real redis-server): queued
entries of an ended burst are not run, requests inside the engine are aborted, finished results
stay, every request has exactly one result, and the worker goes on serving."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis

from helpers import FakeWorker, queue_empty, wait_burst, wait_settled, wait_until
from ledger import LEDGER, account
from prefixq.client import Producer, results
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.store import burst_end


def slow(n: int, secs: float, tag: str = "q") -> list[dict[str, Any]]:
    return [
        {"id": f"{tag}{i}", "prompt": f"sleep:{secs} {tag} {i}", "max_tokens": 4} for i in range(n)
    ]


def ran(fw: FakeWorker, burst: str) -> int:
    """Requests of ``burst`` the engine was asked to run."""
    return sum(1 for rid in fw.engine.seen if rid.startswith(f"{burst}:"))


def test_cancel_mid_burst_aborts_in_flight_skips_queued_keeps_finished(
    make_settings: Callable[..., Settings],
    r: redis.Redis,
    fake_worker: Callable[..., FakeWorker],
) -> None:
    """Given a worker halfway through 60 slow requests, when the burst is cancelled, then the
    requests inside the engine end at once (aborted), the queued ones never reach the engine,
    the finished ones keep their results, every request has exactly one result, the queue is
    empty, and the next burst is served."""
    s = make_settings(max_inflight=4)
    fw = fake_worker(s)
    burst = Producer(s).submit(slow(60, 0.3))
    # requests inside the engine when it is cancelled (else the abort would test nothing): the
    # engine is empty for a moment between two windows of 4, so wait for it to hold some again
    wait_until(
        lambda: int(results.status(burst, s).done) >= 8 and fw.engine.active > 0,
        30,
        "8 results, and requests in the engine, before the cancel",
    )
    rep = burst_end.cancel(burst, s)
    LEDGER.fault(f"cancel of a running burst ({rep.cancelled} requests cancelled)")
    st = wait_burst(r, s, burst, 10)
    assert len(st) == 60
    got = {x.index: x for x in results.collect(burst, s)}
    codes = [got[i].error_code for i in range(60)]
    assert codes.count(None) >= 8 and codes.count("cancelled") >= 40
    assert set(codes) <= {None, "cancelled"}
    assert ran(fw, burst) <= 60 - codes.count("cancelled") + 4  # at most the window was aborted
    assert results.status(burst, s).status == "cancelled"
    wait_until(lambda: queue_empty(r, s) == (0, 0), 10, "the stream drained")
    out = account(r, s, burst, 60, what="cancelled mid-way")
    assert out.lost == 0 and out.duplicated == 0
    nxt = Producer(s).submit(slow(5, 0.0, "n"))
    assert len(wait_burst(r, s, nxt, 10)) == 5


def test_a_worker_started_after_a_cancel_runs_none_of_its_entries(
    make_settings: Callable[..., Settings],
    r: redis.Redis,
    fake_worker: Callable[..., FakeWorker],
) -> None:
    """Given a burst cancelled while no worker ran, when a worker starts, then it acks the
    burst's queued entries without running any, and the burst stays cancelled."""
    s = make_settings()
    r.hset(Keys(s.namespace).config, "shards", 1)
    burst = Producer(s).submit(slow(20, 0.1))
    burst_end.cancel(burst, s)
    assert queue_empty(r, s)[0] == 20, "the entries were not queued"
    fw = fake_worker(s)
    wait_until(lambda: queue_empty(r, s) == (0, 0), 10, "the cancelled entries acked")
    assert ran(fw, burst) == 0
    assert results.status(burst, s).status == "cancelled"
    out = account(r, s, burst, 20, what="cancelled before any worker")
    assert out.lost == 0 and out.duplicated == 0


def test_a_deadline_expires_the_requests_not_admitted_and_the_worker_serves_on(
    make_settings: Callable[..., Settings],
    r: redis.Redis,
    fake_worker: Callable[..., FakeWorker],
) -> None:
    """Given a burst of 40 requests of 0.2 s with a deadline 1 s away on one worker (4 at a
    time), then some finish before the deadline, the rest get an expired result without
    running, the burst ends as expired within a few seconds of its deadline, and the worker
    serves the next burst."""
    s = make_settings(max_inflight=4)
    fw = fake_worker(s)
    deadline = time.time() + 1.0
    burst = Producer(s).submit(slow(40, 0.2), deadline=deadline)
    wait_burst(r, s, burst, 15)
    ended = time.time()
    got = results.collect(burst, s)
    codes = [g.error_code for g in got]
    assert len(got) == 40 and 0 < codes.count(None) < 40
    assert set(codes) <= {None, "expired"}
    assert results.status(burst, s).status == "expired"
    assert ended - deadline < 5
    assert ran(fw, burst) <= codes.count(None) + 4
    LEDGER.fault(f"a deadline passed with {codes.count('expired')} requests not run")
    out = account(r, s, burst, 40, what="expired")
    assert out.lost == 0 and out.duplicated == 0
    nxt = Producer(s).submit(slow(5, 0.0, "n"))
    assert len(wait_burst(r, s, nxt, 10)) == 5


def test_a_burst_id_submitted_again_after_its_cancelled_burst_expired_runs_its_requests(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: Callable[..., FakeWorker]
) -> None:
    """Given a burst id whose burst was cancelled and whose record then expired (result_ttl_s),
    a new burst of that id (head and lane) is served: by the running worker that saw the cancel,
    and by a worker started later (which loads the old notice): every request gets its answer,
    none a `cancelled` result. (Workers remembered the id as cancelled and failed every request
    of the new burst at once.)"""
    s = make_settings(result_ttl_s=1)
    keys = Keys(s.namespace)
    slow = [{"id": f"q{i}", "prompt": f"sleep:30 q{i}", "max_tokens": 4} for i in range(40)]
    fresh = [{"id": f"q{i}", "prompt": f"q{i}", "max_tokens": 4} for i in range(40)]
    with fake_worker(s, name="w1"):
        Producer(s).submit(slow, burst_id="nightly")
        assert burst_end.cancel("nightly", s).cancelled == 40
        wait_until(lambda: not r.exists(keys.burst("nightly")), 10, "the record to expire")
        Producer(s).submit(fresh, burst_id="nightly")
        got = wait_burst(r, s, "nightly", 20)
        assert [x.error_code for x in got] == [None] * 40, {x.error for x in got}
    wait_until(lambda: not r.exists(keys.burst("nightly")), 10, "the record to expire")
    Producer(s).submit(fresh, burst_id="nightly")
    with fake_worker(s, name="w2"):
        got = wait_burst(r, s, "nightly", 20)
        assert [x.error_code for x in got] == [None] * 40, {x.error for x in got}


def test_queued_entries_of_an_expired_cancelled_burst_do_not_land_in_a_new_burst_of_its_id(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: Callable[..., FakeWorker]
) -> None:
    """Given a burst cancelled while its entries were still queued (no worker yet), whose record
    then expired, and a new burst submitted under the same id, a worker that reads the old
    entries first drops them (they are not the new burst's) and serves the new burst: each of its
    requests gets its own answer. (The old entries' `cancelled` results were recorded as the new
    burst's results of those indexes.)"""
    s = make_settings(result_ttl_s=1)
    keys = Keys(s.namespace)
    Producer(s).submit(
        [{"id": f"old{i}", "prompt": f"old {i}", "max_tokens": 4} for i in range(30)],
        burst_id="nightly",
    )
    assert burst_end.cancel("nightly", s).cancelled == 30
    wait_until(lambda: not r.exists(keys.burst("nightly")), 10, "the record to expire")
    Producer(s).submit(
        [{"id": f"new{i}", "prompt": f"new {i}", "max_tokens": 4} for i in range(30)],
        burst_id="nightly",
    )
    fake_worker(s)
    got = wait_burst(r, s, "nightly", 20)
    assert [(x.id, x.error_code) for x in got] == [(f"new{i}", None) for i in range(30)]
    wait_settled(r, s)


def test_a_deadline_that_ends_a_burst_in_a_worker_enqueues_its_on_complete_through_middleware(
    make_settings: Callable[..., Settings],
    r: redis.Redis,
    fake_worker: Callable[..., FakeWorker],
) -> None:
    """Given a 2-shard burst with an RQ on_complete whose shard-0 request a worker ran (RQ's
    middleware registered, as `prefixq worker` does) and whose shard-1 request no worker serves,
    when its deadline passes, then that worker's expiry ends the burst and the on_complete job is
    enqueued once: the expiry hands the end to the worker's middleware (store/burst_end imports
    no integration, and no result the worker records completes this burst)."""
    from rq import Queue
    from rq.serializers import JSONSerializer

    from prefixq.integrations.rq_callbacks import callback_job_id

    s = make_settings(shards=2)
    fake_worker(s, shard=0)
    q = Queue(f"rq-{s.namespace}", connection=r, serializer=JSONSerializer)
    burst = Producer(s).submit(
        slow(2, 0.0),
        placement="round-robin",
        deadline=time.time() + 1.5,
        on_complete="rq_targets:mark_done",
        rq_queue=q.name,
    )
    wait_until(lambda: r.hget(s.keys.burst(burst), "done") == b"1", 10, "shard 0's request ran")
    assert q.job_ids == []
    wait_burst(r, s, burst, 15)
    assert results.status(burst, s).status == "expired"
    wait_until(lambda: q.job_ids != [], 10, "the on_complete job was enqueued")
    assert q.job_ids == [callback_job_id(s.namespace, burst)]
