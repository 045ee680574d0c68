"""A burst whose producer died part-way through its submit: its record exists, its head or its
chunks may not. Cancelling it and expiring it (store/burst_end.py) give every request one result
under the id that was submitted for its index, never an id made up from the index; a burst whose
ids were never recorded says so instead (docs/delivery.md, "Cancel and deadlines")."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
import redis.asyncio as aredis

from helpers import PY, cli, wait_until
from prefixq.client import Producer, results
from prefixq.client import producer as producer_module
from prefixq.core.errors import RedisUnavailable
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.store import burst_end
from prefixq.store.connection import async_client


class ProducerDied(BaseException):
    """The producer process ends here (kill -9): nothing after it runs, no clean-up."""


def _expire_due(s: Settings) -> list[str]:
    """One round of the workers' expiry (`burst_end.expire_due`) on its own client."""
    import asyncio

    async def expire() -> list[str]:
        c = async_client(s)
        try:
            return await burst_end.expire_due(c, s)
        finally:
            await c.aclose()

    return asyncio.run(expire())


def die_before_the_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """The producer dies after lua/create_burst.lua ran and before its head's pipeline went out."""

    async def dead(self: Any, *a: Any, **kw: Any) -> None:
        raise ProducerDied

    monkeypatch.setattr(producer_module._Submission, "_send", dead)


def shifted(n: int) -> list[dict[str, Any]]:
    """``n`` requests whose numeric ids are their index + 1: an id made up from an index is then
    either never submitted ("0") or another request's id."""
    return [{"id": str(i + 1), "prompt": f"hello {i}", "max_tokens": 4} for i in range(n)]


def test_cancel_of_a_burst_whose_producer_died_before_its_head_keeps_the_submitted_ids(
    make_settings: Callable[..., Settings], r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a producer that died after creating its burst's record and before sending its head,
    when the burst is cancelled, then each of its requests has one cancelled result carrying the
    id submitted for its index ("0" was never submitted; "1".."n" all were)."""
    s = make_settings()
    r.hset(Keys(s.namespace).config, "shards", 1)
    die_before_the_head(monkeypatch)
    with pytest.raises(ProducerDied):
        Producer(s).submit(shifted(30), burst_id="half")
    assert r.hget(Keys(s.namespace).burst("half"), "total") == b"30", "the record was created"
    assert r.xlen(Keys(s.namespace).stream(0)) == 0, "no entry went out"
    rep = burst_end.cancel("half", s)
    assert rep.cancelled == 30 and rep.status == "cancelled"
    got = results.collect("half", s)
    assert [g.id for g in got] == [str(i + 1) for i in range(30)]
    assert {g.error_code for g in got} == {"cancelled"}


def test_expiry_of_a_burst_whose_producer_died_before_its_head_keeps_the_submitted_ids(
    make_settings: Callable[..., Settings], r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given the same half-created burst with a deadline (indexed with its record), when its
    deadline passes, `expire_due` gives each request one expired result under its submitted id."""

    s = make_settings()
    keys = Keys(s.namespace)
    r.hset(keys.config, "shards", 1)
    die_before_the_head(monkeypatch)
    with pytest.raises(ProducerDied):
        Producer(s).submit(shifted(12), burst_id="late", deadline=time.time() - 1)

    assert _expire_due(s) == ["late"]
    got = results.collect("late", s)
    assert [g.id for g in got] == [str(i + 1) for i in range(12)]
    assert {g.error_code for g in got} == {"expired"}


#: a producer process that stops right after its burst's record is created (lua/create_burst.lua
#: answered), says so, and waits there to be killed
KILLED_AFTER_THE_RECORD = """
import sys, time
from prefixq.client import Producer, producer
from prefixq.core.settings import Settings

create = producer._Submission._create

async def created_then_wait(self, *a):
    await create(self, *a)
    print("created", flush=True)
    time.sleep(600)  # blocks the event loop: nothing more is sent

producer._Submission._create = created_then_wait
url, ns, deadline = sys.argv[1], sys.argv[2], float(sys.argv[3])
requests = [{"id": str(i + 1), "prompt": f"hello {i}", "max_tokens": 4} for i in range(12)]
Producer(Settings(redis_url=url, namespace=ns, shards=1)).submit(
    requests, burst_id="killed", deadline=deadline
)
"""


def test_a_burst_whose_producer_was_killed_after_its_record_expires_and_its_keys_go(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: Callable[..., Any]
) -> None:
    """Given a producer process killed (SIGKILL) right after its burst's record was created and
    before anything else was sent, when the burst's deadline passes, then a worker's expiry loop
    expires it: each of its requests has one expired result under its submitted id, the deadline
    index lets it go, and its keys are gone after ``result_ttl_s``."""
    s = make_settings(result_ttl_s=1)
    keys = Keys(s.namespace)
    r.hset(keys.config, "shards", 1)
    deadline = time.time() + 2
    argv = [PY, "-c", KILLED_AFTER_THE_RECORD, s.redis_url, s.namespace, repr(deadline)]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as producer:
        try:
            assert producer.stdout is not None
            assert producer.stdout.readline().strip() == "created", "the record was created"
        finally:
            producer.send_signal(signal.SIGKILL)
        assert producer.wait(10) == -signal.SIGKILL
    assert r.hget(keys.burst("killed"), "total") == b"12"
    assert r.xlen(keys.stream(0)) == 0, "no entry went out"
    fake_worker(s, name="expirer")
    wait_until(lambda: r.hget(keys.burst("killed"), "status") == b"expired", 15, "the expiry")
    assert time.time() >= deadline
    got = results.collect("killed", s)
    assert [g.id for g in got] == [str(i + 1) for i in range(12)]
    assert {g.error_code for g in got} == {"expired"}
    # the expiry drops the burst from the deadline index after it records the expired results
    # and the status (store/burst_end.py: expire_due), so a moment after the status is read
    wait_until(lambda: r.zscore(keys.deadlines, "killed") is None, 5, "the deadline index")
    pattern = f"{s.namespace}:{{bkilled}}*"
    wait_until(lambda: not list(r.scan_iter(match=pattern)), 10, "the burst's keys to go")


def test_a_submit_whose_burst_id_is_taken_cannot_expire_the_other_burst_early(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Given a burst with a deadline an hour away, when a second submit of the same id with a
    deadline already past is refused (BurstIdTaken, its deadline indexed before its create found
    the id taken), then `expire_due` does not expire the first burst: the record's deadline is the
    truth, and the index entry goes back to it."""

    from prefixq.core.errors import BurstIdTaken

    s = make_settings()
    keys = Keys(s.namespace)
    r.hset(keys.config, "shards", 1)
    later = time.time() + 3600
    Producer(s).submit(shifted(3), burst_id="taken", deadline=later)
    with pytest.raises(BurstIdTaken):
        Producer(s).submit(shifted(3), burst_id="taken", deadline=time.time() - 1)

    assert _expire_due(s) == []
    assert r.hget(keys.burst("taken"), "status") == b"queued"
    assert r.zscore(keys.deadlines, "taken") == pytest.approx(later)


def test_a_burst_whose_ids_were_only_partly_recorded_says_so_instead_of_making_ids_up(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Given a burst record of 5 requests whose id list holds only the first 3 (what an older
    producer's chunked id writes left when it died), when it is cancelled, then requests 0-2 carry
    their ids, and requests 3-4 carry none (null in `prefixq results`, which says why on stderr),
    never "3" and "4"."""
    s = make_settings()
    keys = Keys(s.namespace)
    r.hset(keys.config, "shards", 1)
    r.hset(keys.burst("old"), mapping={"total": 5, "done": 0, "failed": 0, "status": "queued"})
    r.rpush(keys.ids("old"), "a", "b", "c")
    assert burst_end.cancel("old", s).cancelled == 5
    got = results.collect("old", s)
    assert [g.id for g in got] == ["a", "b", "c", "", ""]
    assert all("never recorded" in (g.error or "") for g in got[3:])
    p = cli(s, "results", "old")
    assert p.returncode == 0, p.stderr
    lines = [json.loads(x) for x in p.stdout.splitlines()]
    assert [x["id"] for x in lines] == ["a", "b", "c", None, None]
    assert "2 of its 5 results have no id" in p.stderr and "never recorded" in p.stderr


def test_a_create_sent_again_by_a_retry_is_the_producers_own_not_a_taken_id(
    make_settings: Callable[..., Settings], r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a producer whose create round trip is sent twice (the client retries a pipeline
    whose reply was lost with the connection), the second create finds its own record and the
    submit goes on: no BurstIdTaken, and the burst is whole."""
    s = make_settings()
    r.hset(Keys(s.namespace).config, "shards", 1)
    create = producer_module._Submission._create

    async def twice(self: Any, *a: Any) -> None:
        await create(self, *a)
        await create(self, *a)

    monkeypatch.setattr(producer_module._Submission, "_create", twice)
    burst = Producer(s).submit(shifted(40), burst_id="again")
    assert burst == "again"
    assert r.lrange(Keys(s.namespace).ids("again"), 0, -1) == [
        str(i + 1).encode() for i in range(40)
    ]


def entry_calls(pipe: Any) -> list[int]:
    """Where a pipeline's lua/enqueue.lua calls are (one per shard of a chunk: its entries)."""
    stack = pipe.command_stack
    return [i for i, (a, _) in enumerate(stack) if a[0] == "EVAL" and ":enq:" in str(a[3])]


def lose_the_connection_mid_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """The producer's third chunk (after 4 + 16 requests; 64 requests, 32 per shard of 2) is half
    processed by Redis — its first shard's entries are added — before the connection drops, so
    its reply never comes."""
    real = aredis.client.Pipeline.execute
    chunks = []

    async def flaky(self: Any, raise_on_error: bool = True) -> Any:
        calls = entry_calls(self)
        if calls:
            chunks.append(len(calls))
        if len(chunks) == 3 and calls:
            self.command_stack = self.command_stack[: calls[0] + 1]
            await real(self, raise_on_error)
            raise redis.ConnectionError("Connection closed by server.")
        return await real(self, raise_on_error)

    monkeypatch.setattr(aredis.client.Pipeline, "execute", flaky)


def test_a_submit_that_fails_mid_chunk_reports_what_is_really_in_the_streams(
    make_settings: Callable[..., Settings], r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a submit whose connection drops while a chunk is half processed (20 requests sent
    and acknowledged, then the 32 of the next chunk's 64 that go to shard 0 in the streams without
    a reply), the error says 52 of its 200 requests were enqueued — what Redis holds — and not
    20."""
    s = make_settings(shards=2)
    r.hset(Keys(s.namespace).config, "shards", 2)
    lose_the_connection_mid_chunk(monkeypatch)
    with pytest.raises(RedisUnavailable, match="cancelled as a whole") as e:
        Producer(s).submit(shifted(200), burst_id="cut", placement="round-robin")
    assert "52 of its 200 requests" in str(e.value), str(e.value)


def test_a_submit_that_fails_mid_chunk_with_redis_gone_says_what_it_cannot_know(
    make_settings: Callable[..., Settings], r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given the same half-processed chunk, and Redis gone before the burst could be counted or
    cancelled, the error gives the bounds it knows (at least the 20 acknowledged, at most those
    plus the 64 of the chunk in flight), not 20 as if it were the count."""
    s = make_settings(shards=2)
    r.hset(Keys(s.namespace).config, "shards", 2)
    lose_the_connection_mid_chunk(monkeypatch)

    async def gone(*a: Any, **kw: Any) -> Any:
        raise redis.ConnectionError("Connection refused.")

    monkeypatch.setattr(producer_module, "acancel", gone)
    monkeypatch.setattr(producer_module, "count_enqueued", gone)
    with pytest.raises(RedisUnavailable, match="could not be cancelled") as e:
        Producer(s).submit(shifted(200), burst_id="cut", placement="round-robin")
    assert "at least 20 and at most 84 of its 200 requests" in str(e.value), str(e.value)


def test_a_submit_whose_queue_redis_refuses_is_cancelled_even_when_it_cannot_be_counted(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Given a shard's request stream holding a string (anything with write access may write
    one), when a burst is submitted, then its entries are refused (WRONGTYPE), the count of what
    was enqueued (which reads that stream) fails too, and the burst is still cancelled: status
    cancelled, every request a cancelled result (before: the failed count skipped the cancel, and
    the burst stayed queued, 0 of 4, for good)."""
    from prefixq.core.errors import PrefixqError

    s = make_settings(shards=1)
    keys = Keys(s.namespace)
    r.hset(keys.config, "shards", 1)
    r.set(keys.stream(0), "not a stream")
    with pytest.raises((PrefixqError, redis.RedisError)) as e:
        Producer(s).submit(shifted(4), burst_id="refused")
    assert "cancelled as a whole" in str(e.value), str(e.value)
    st = results.status("refused", s)
    assert st.status == "cancelled" and (st.done, st.failed) == (0, 4), st
    assert {x.error_code for x in results.collect("refused", s)} == {"cancelled"}


# ---- a pipeline sent again adds no entry twice (lua/enqueue.lua) --------------------------------
def carries_entries(pipe: Any) -> bool:
    """Whether a pipeline adds entries (lua/enqueue.lua; before it, XADDs)."""
    return bool(entry_calls(pipe)) or any(a[0] == "XADD" for a, _ in pipe.command_stack)


def entries_in_redis(r: redis.Redis, s: Settings, burst: str) -> tuple[int, int]:
    """(entries in the burst's streams on its 2 shards, distinct input indexes among them)."""
    import asyncio

    from prefixq.store.census import count_enqueued

    keys = Keys(s.namespace)
    streams = [k for shard in range(2) for k in (keys.stream(shard), keys.lane(shard, burst))]
    total = sum(r.xlen(k) for k in streams)

    async def distinct() -> int:
        c = async_client(s)
        try:
            return await count_enqueued(c, s, burst, shards=2, priority="normal")
        finally:
            await c.aclose()

    return total, asyncio.run(distinct())


def test_a_pipeline_sent_again_by_the_client_adds_each_entry_once(
    make_settings: Callable[..., Settings],
    r: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Given a client that sends each pipeline of entries twice (redis-py's cluster pipeline
    sends the whole pipeline again after a failover; here the first reply is dropped), when a
    burst of 200 requests on 2 shards (heads, lanes and doorbells) is submitted, then each
    request is in the streams once, the shards' load counters count it once, and an INFO line
    says how many entries were skipped."""
    s, clean = make_settings(shards=2), make_settings(shards=2)
    for x in (s, clean):
        r.hset(Keys(x.namespace).config, "shards", 2)
    Producer(clean).submit(shifted(200), burst_id="twice", placement="round-robin")
    real = aredis.client.Pipeline.execute

    async def twice(self: Any, raise_on_error: bool = True) -> Any:
        stack = list(self.command_stack)
        if not carries_entries(self):
            return await real(self, raise_on_error)
        await real(self, raise_on_error)
        self.command_stack = stack  # the pipeline that carries entries goes again, whole
        return await real(self, raise_on_error)

    monkeypatch.setattr(aredis.client.Pipeline, "execute", twice)
    with caplog.at_level(logging.INFO, logger="prefixq.client.enqueue"):
        Producer(s).submit(shifted(200), burst_id="twice", placement="round-robin")
    monkeypatch.undo()
    assert entries_in_redis(r, s, "twice") == (200, 200)
    assert r.hgetall(Keys(s.namespace).load) == r.hgetall(Keys(clean.namespace).load)
    skipped = [x.getMessage() for x in caplog.records if "enqueued already, skipped" in x.message]
    assert skipped and skipped[-1].endswith("(200 in this submit)"), skipped


def test_a_chunk_sent_again_through_a_failover_adds_each_entry_once(
    make_settings: Callable[..., Settings],
    r: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Given a producer on a Redis Cluster (its ride-through) whose third chunk is processed in
    full before its connection drops (as a master does before it fails over with its replica in
    sync), when the producer sends the chunk again, then the submit completes with each of its
    200 requests in the streams once, and one INFO line says the chunk's 64 were skipped."""
    from prefixq.client import enqueue

    s = make_settings(shards=2)
    r.hset(Keys(s.namespace).config, "shards", 2)
    monkeypatch.setattr(enqueue, "is_cluster", lambda _: True)
    real = aredis.client.Pipeline.execute
    chunks = []

    async def failover(self: Any, raise_on_error: bool = True) -> Any:
        if carries_entries(self):
            chunks.append(1)
            if len(chunks) == 3:
                await real(self, raise_on_error)
                raise redis.ConnectionError("Connection closed by server.")
        return await real(self, raise_on_error)

    monkeypatch.setattr(aredis.client.Pipeline, "execute", failover)
    with caplog.at_level(logging.INFO, logger="prefixq.client.enqueue"):
        Producer(s).submit(shifted(200), burst_id="over", placement="round-robin")
    monkeypatch.undo()
    assert len(chunks) == 5, "chunks of 4, 16, 64 (sent twice) and 116"
    assert entries_in_redis(r, s, "over") == (200, 200)
    skipped = [x.getMessage() for x in caplog.records if "enqueued already, skipped" in x.message]
    assert skipped == ["burst over: requests 21-84 sent again: 64 of them had been enqueued "
                       "already, skipped (64 in this submit)"]  # fmt: skip


def test_the_census_counts_a_request_that_finishes_while_it_reads_the_streams(
    settings: Settings, r: redis.Redis
) -> None:
    """Given a burst of 5 queued requests, when one of them finishes while the census reads the
    streams (its result recorded, then its entry deleted, as a worker does), it is still counted:
    5 of 5. Reading the results first counted it nowhere, and a refused submit said "0 of its 10
    requests had been enqueued" while 4 had run."""
    import asyncio

    from helpers import queue_keys
    from prefixq.core import wire
    from prefixq.core.entries import Entry
    from prefixq.store.census import count_enqueued

    s = settings.replace(shards=1)
    burst = Producer(s).submit([{"id": f"q{i}", "prompt": f"hi {i}"} for i in range(5)]).id

    def finish_index_0() -> None:
        for key in queue_keys(r, s):
            for eid, f in r.xrange(key):
                if b"d" in f and Entry.from_wire(wire.decode(f[b"d"])).index == 0:
                    r.hset(s.keys.results(burst), "0", b"x")
                    r.xdel(key, eid)
                    return
        raise AssertionError("no entry of index 0")

    class FinishingOnFirstRead:
        def __init__(self, c: Any) -> None:
            self.c, self.done = c, False

        def __getattr__(self, name: str) -> Any:
            return getattr(self.c, name)

        async def xrange(self, *a: Any, **kw: Any) -> Any:
            if not self.done:
                self.done = True
                finish_index_0()
            return await self.c.xrange(*a, **kw)

    async def census() -> int:
        c = async_client(s)
        try:
            return await count_enqueued(
                FinishingOnFirstRead(c),  # type: ignore[arg-type]
                s,
                burst,
                shards=1,
                priority="normal",
            )
        finally:
            await c.aclose()

    assert asyncio.run(census()) == 5
