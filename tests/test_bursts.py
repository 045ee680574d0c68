"""Cancel and deadlines on a real redis-server: every request without a result gets a failed one
exactly once (lua/finish_missing.lua), even while a worker records the same indexes."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
import redis.asyncio as aredis

from prefixq.client import Producer, results
from prefixq.core import wire
from prefixq.core.errors import BurstNotFound
from prefixq.core.keys import Keys
from prefixq.core.records import Result
from prefixq.core.settings import Settings
from prefixq.store import burst_end
from prefixq.store.connection import lua
from prefixq.store.lua_script import LuaScript
from prefixq.store.scripts import record_call


def submit(settings: Settings, n: int, **options: Any) -> str:
    reqs = [{"id": f"q{i}", "prompt": f"question {i}", "max_tokens": 4} for i in range(n)]
    return Producer(settings).submit(reqs, **options)


class FakeRecorder:
    """What a worker's writer does: lua/record_result.lua, one successful result per index."""

    def __init__(self, r: redis.Redis, settings: Settings, burst: str) -> None:
        self.r, self.settings, self.burst = r, settings, burst
        self.script = r.register_script(lua("record_result"))
        self.replies: dict[int, int] = {}

    def record(self, index: int) -> int:
        k, b = Keys(self.settings.namespace), self.burst
        res = Result(id=f"q{index}", index=index, text="answer", finish_reason="stop")
        keys, args = record_call(k, b, [(res, 0.0)], self.settings, repr(time.time()))
        (reply,) = self.script(keys=keys, args=args)
        self.replies[index] = reply
        return reply


def stored(r: redis.Redis, settings: Settings, burst: str) -> dict[int, Result]:
    raw = r.hgetall(Keys(settings.namespace).results(burst))
    return {int(i): Result.from_wire(wire.decode(v)) for i, v in raw.items()}


def meta(r: redis.Redis, settings: Settings, burst: str) -> dict[str, str]:
    h = r.hgetall(Keys(settings.namespace).burst(burst))
    return {k.decode(): v.decode() for k, v in h.items()}


def test_cancel_fails_what_is_missing_and_keeps_what_is_done(
    settings: Settings, r: redis.Redis
) -> None:
    """Given 5 requests, 2 answered: cancel records 3 cancelled results with their request ids,
    keeps the 2 answers, and the burst ends as cancelled with its counters."""
    burst = submit(settings, 5)
    worker = FakeRecorder(r, settings, burst)
    worker.record(1), worker.record(3)

    rep = burst_end.cancel(burst, settings)

    assert (rep.status, rep.total, rep.done, rep.failed, rep.cancelled) == ("cancelled", 5, 2, 3, 3)
    assert not rep.already_finished
    got = stored(r, settings, burst)
    assert {i: (x.id, x.error_code) for i, x in got.items()} == {
        0: ("q0", "cancelled"),
        1: ("q1", None),
        2: ("q2", "cancelled"),
        3: ("q3", None),
        4: ("q4", "cancelled"),
    }
    assert got[0].error and "cancelled" in got[0].error
    m = meta(r, settings, burst)
    assert (m["status"], m["failed"], m["cancelled"]) == ("cancelled", "3", "3")
    assert float(m["finished_at"]) > 0
    assert r.xlen(Keys(settings.namespace).events(burst)) == 5
    notices = r.xrange(Keys(settings.namespace).cancels)
    assert [f[b"b"].decode() for _, f in notices] == [burst]
    # a worker recording a cancelled index afterwards is told "already recorded, finished" (3)
    assert worker.record(0) == 3
    assert stored(r, settings, burst)[0].error_code == "cancelled"


def test_cancel_is_idempotent_and_leaves_finished_bursts_alone(
    settings: Settings, r: redis.Redis
) -> None:
    """A second cancel changes nothing and says the burst had finished; so does cancelling a
    burst whose requests all have results; an unknown burst is BurstNotFound."""
    burst = submit(settings, 3)
    burst_end.cancel(burst, settings)
    before = (meta(r, settings, burst), r.hgetall(Keys(settings.namespace).results(burst)))
    again = burst_end.cancel(burst, settings)
    assert again.already_finished and again.status == "cancelled" and again.cancelled == 0
    assert (meta(r, settings, burst), r.hgetall(Keys(settings.namespace).results(burst))) == before

    done = submit(settings, 2)
    worker = FakeRecorder(r, settings, done)
    assert [worker.record(0), worker.record(1)] == [1, 2]
    rep = burst_end.cancel(done, settings)
    assert rep.already_finished and (rep.status, rep.done, rep.failed) == ("finished", 2, 0)
    assert "cancelled" not in meta(r, settings, done)
    assert r.xlen(Keys(settings.namespace).cancels) == 1  # only the first burst's notice

    with pytest.raises(BurstNotFound, match="no burst 'nope'"):
        burst_end.cancel("nope", settings)


def test_cancel_racing_a_worker_records_each_index_exactly_once(
    settings: Settings, r: redis.Redis
) -> None:
    """Given 2,500 requests (three chunks) and a worker recording them from both ends while
    cancel runs, every index has exactly one result, the counters add up, and exactly one of the
    two completed the burst."""
    n = 2500
    burst = submit(settings, n)
    worker = FakeRecorder(r, settings, burst)
    for i in range(0, 200):  # some answered before the cancel
        worker.record(i)
    stop = threading.Event()

    def race() -> None:
        client = redis.Redis.from_url(settings.redis_url)
        w = FakeRecorder(client, settings, burst)
        for i in [*range(n - 1, n - 600, -1), *range(200, 800)]:
            if stop.is_set():
                break
            worker.replies[i] = w.record(i)
        client.close()

    t = threading.Thread(target=race)
    t.start()
    rep = burst_end.cancel(burst, settings)
    stop.set()
    t.join()

    got = stored(r, settings, burst)
    assert sorted(got) == list(range(n))
    answered = {i for i, x in got.items() if x.error is None}
    cancelled = {i for i, x in got.items() if x.error_code == "cancelled"}
    assert answered | cancelled == set(range(n)) and not answered & cancelled
    assert answered == {i for i, reply in worker.replies.items() if reply in (1, 2)}
    assert all(got[i].id == f"q{i}" for i in range(n))  # ids read across chunk boundaries
    m = meta(r, settings, burst)
    assert int(m["done"]) == len(answered) and int(m["failed"]) == len(cancelled)
    assert int(m["cancelled"]) == len(cancelled) == rep.cancelled
    assert int(m["done"]) + int(m["failed"]) == n
    completions = [i for i, reply in worker.replies.items() if reply == 2]
    assert len(completions) + rep.ended == 1  # exactly one of them completed the burst
    # the worker's record script marks a burst it completes "finished" even mid-cancel (the lead
    # is asked to make it "cancelled" when the record says "cancelling")
    assert m["status"] == "cancelled" if rep.ended else m["status"] in ("cancelled", "finished")
    print(f"worker recorded {len(answered)}, cancel recorded {len(cancelled)}")


def test_chunks_are_at_most_a_thousand_indexes(
    settings: Settings, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelling 2,345 missing requests calls the script with at most 1,000 indexes at a time
    (plus the marking and closing calls without any)."""
    burst = submit(settings, 2345)
    sizes: list[int] = []
    real = LuaScript.call

    def spy(self: LuaScript, r: Any, keys: Any, args: Any = ()) -> Any:
        if args and args[0] == "cancelled":
            sizes.append((len(args) - 3) // 2)
        return real(self, r, keys, args)

    monkeypatch.setattr(LuaScript, "call", spy)
    rep = burst_end.cancel(burst, settings)
    assert rep.cancelled == 2345
    assert [s for s in sizes if s] == [1000, 1000, 345]


def test_waiters_wake_up_when_a_burst_is_cancelled(settings: Settings, r: redis.Redis) -> None:
    """A client blocked in results.wait returns as soon as the cancel has recorded every
    missing result, with the burst's final status."""
    burst = submit(settings, 4)
    got: list[results.BurstStatus] = []
    waiter = threading.Thread(target=lambda: got.append(results.wait(burst, settings, timeout=30)))
    waiter.start()
    time.sleep(0.3)
    assert not got  # still waiting: nothing recorded yet
    t0 = time.monotonic()
    burst_end.cancel(burst, settings)
    waiter.join(10)
    assert got and got[0].status == "cancelled" and got[0].failed == 4
    assert time.monotonic() - t0 < 5
    lines = [x.to_json() for x in results.collect(burst, settings)]
    assert [(x["id"], x["error_code"]) for x in lines] == [(f"q{i}", "cancelled") for i in range(4)]


def test_expire_due_expires_past_deadlines_once_even_from_two_workers(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Bursts past their deadline get expired results for what is missing and leave the index
    (two workers running expire_due at once record each index once); a burst due later stays;
    a finished burst past its deadline only leaves the index."""
    settings = make_settings()
    keys = Keys(settings.namespace)
    now = time.time()
    late = submit(settings, 1500, deadline=now - 5)
    later = submit(settings, 3, deadline=now + 3600)
    done = submit(settings, 1, deadline=now - 5)
    FakeRecorder(r, settings, done).record(0)
    FakeRecorder(r, settings, late).record(7)

    async def two_workers() -> list[list[str]]:
        clients = [aredis.Redis.from_url(settings.redis_url) for _ in range(2)]
        try:
            return list(
                await asyncio.gather(*(burst_end.expire_due(c, settings, now) for c in clients))
            )
        finally:
            for c in clients:
                await c.aclose()

    reports = asyncio.run(two_workers())
    assert sorted(b for rep in reports for b in rep) in ([late], [late, late])
    got = stored(r, settings, late)
    assert len(got) == 1500 and got[7].error is None
    assert {x.error_code for i, x in got.items() if i != 7} == {"expired"}
    m = meta(r, settings, late)
    assert (m["status"], m["failed"], m["expired"], m["done"]) == ("expired", "1499", "1499", "1")
    assert meta(r, settings, done)["status"] == "finished"
    assert meta(r, settings, later)["status"] == "queued"
    assert [b.decode() for b in r.zrange(keys.deadlines, 0, -1)] == [later]
    notices = {f[b"b"].decode(): f.get(b"r") for _, f in r.xrange(keys.cancels)}
    assert notices == {late: b"expired"}  # workers abort what still runs of it
    assert asyncio.run(_expire_once(settings, now)) == []  # nothing left to do


async def _expire_once(settings: Settings, now: float) -> list[str]:
    client = aredis.Redis.from_url(settings.redis_url)
    try:
        return await burst_end.expire_due(client, settings, now)
    finally:
        await client.aclose()


def test_acancel_is_the_same_inside_an_event_loop(settings: Settings, r: redis.Redis) -> None:
    """The async twin cancels the same way and reports the same fields."""
    burst = submit(settings, 3)
    FakeRecorder(r, settings, burst).record(2)

    async def go() -> burst_end.CancelReport:
        client = aredis.Redis.from_url(settings.redis_url)
        try:
            return await burst_end.acancel(burst, settings, client)
        finally:
            await client.aclose()

    rep = asyncio.run(go())
    assert (rep.status, rep.done, rep.failed, rep.cancelled) == ("cancelled", 1, 2, 2)
    assert asyncio.run(go()).already_finished


def test_the_cancel_that_ends_a_burst_enqueues_its_on_complete_job_once(
    settings: Settings, r: redis.Redis
) -> None:
    """A burst with an RQ callback, cancelled twice with RQ's hook (as `prefixq cancel` does): one
    RQ job, whose id is the burst's callback job id; the hook runs only for the cancel that ends
    the burst."""
    from rq import Queue
    from rq.serializers import JSONSerializer

    from prefixq.integrations.rq_callbacks import callback_job_id, enqueue_on_complete

    calls: list[str] = []

    def hook(client: redis.Redis, s: Settings, burst: str) -> None:
        calls.append(burst)
        enqueue_on_complete(client, s, burst)

    q = Queue(f"rq-{settings.namespace}", connection=r, serializer=JSONSerializer)
    burst = submit(settings, 3, on_complete="rq_targets:mark_done", rq_queue=q.name)
    assert burst_end.cancel(burst, settings, on_burst_done=hook).ended
    burst_end.cancel(burst, settings, on_burst_done=hook)
    assert calls == [burst]
    assert q.job_ids == [callback_job_id(settings.namespace, burst)]


def test_prefixq_cancel_command(settings: Settings, r: redis.Redis) -> None:
    """`prefixq cancel BURST` cancels and says what it did; again, it says the burst had ended;
    an unknown burst exits 1 with the reason."""
    from helpers import cli

    burst = submit(settings, 2)
    first = cli(settings, "cancel", burst)
    assert first.returncode == 0, first.stderr
    assert f"burst {burst} cancelled: 2 requests cancelled" in first.stdout
    again = cli(settings, "cancel", burst, "--json")
    assert again.returncode == 0 and '"already_finished": true' in again.stdout
    missing = cli(settings, "cancel", "nope")
    assert missing.returncode == 1 and "no burst 'nope'" in missing.stderr
