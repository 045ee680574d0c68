"""A burst whose producer died part-way through its submit: its record exists, its head or its
chunks may not. Cancelling it and expiring it (store/burst_end.py) give every request one result
under the id that was submitted for its index, never an id made up from the index; a burst whose
ids were never recorded says so instead (docs/delivery.md, "Cancel and deadlines")."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
import redis.asyncio as aredis

from helpers import cli
from prefixq.client import Producer, results
from prefixq.client import producer as producer_module
from prefixq.core.errors import RedisUnavailable
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.store import burst_end


class ProducerDied(BaseException):
    """The producer process ends here (kill -9): nothing after it runs, no clean-up."""


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
    """Given the same half-created burst in the deadline index, when its deadline passes,
    `expire_due` gives each request one expired result under its submitted id."""
    import asyncio

    s = make_settings()
    keys = Keys(s.namespace)
    r.hset(keys.config, "shards", 1)
    die_before_the_head(monkeypatch)
    with pytest.raises(ProducerDied):
        Producer(s).submit(shifted(12), burst_id="late", deadline=time.time() + 3600)
    r.zadd(keys.deadlines, {"late": time.time() - 1})  # as the head's pipeline would have

    async def expire() -> list[str]:
        from prefixq.store.connection import async_client

        c = async_client(s)
        try:
            return await burst_end.expire_due(c, s)
        finally:
            await c.aclose()

    assert asyncio.run(expire()) == ["late"]
    got = results.collect("late", s)
    assert [g.id for g in got] == [str(i + 1) for i in range(12)]
    assert {g.error_code for g in got} == {"expired"}


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


def lose_the_connection_mid_chunk(monkeypatch: pytest.MonkeyPatch, landed: int) -> None:
    """The producer's third chunk (after 4 + 16 requests) is half processed by Redis — its first
    ``landed`` entries are added — before the connection drops, so its reply never comes."""
    real = aredis.client.Pipeline.execute
    chunks = []

    async def flaky(self: Any, raise_on_error: bool = True) -> Any:
        xadds = [i for i, (args, _) in enumerate(self.command_stack) if args[0] == "XADD"]
        if xadds:
            chunks.append(len(xadds))
        if len(chunks) == 3 and xadds:
            self.command_stack = self.command_stack[: xadds[landed - 1] + 1]
            await real(self, raise_on_error)
            raise redis.ConnectionError("Connection closed by server.")
        return await real(self, raise_on_error)

    monkeypatch.setattr(aredis.client.Pipeline, "execute", flaky)


def test_a_submit_that_fails_mid_chunk_reports_what_is_really_in_the_streams(
    make_settings: Callable[..., Settings], r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a submit whose connection drops while a chunk is half processed (20 requests sent
    and acknowledged, then 30 of the next chunk's 64 in the stream without a reply), the error
    says 50 of its 200 requests were enqueued — what Redis holds — and not 20."""
    s = make_settings()
    r.hset(Keys(s.namespace).config, "shards", 1)
    lose_the_connection_mid_chunk(monkeypatch, landed=30)
    with pytest.raises(RedisUnavailable, match="cancelled as a whole") as e:
        Producer(s).submit(shifted(200), burst_id="cut")
    assert "50 of its 200 requests" in str(e.value), str(e.value)


def test_a_submit_that_fails_mid_chunk_with_redis_gone_says_what_it_cannot_know(
    make_settings: Callable[..., Settings], r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given the same half-processed chunk, and Redis gone before the burst could be counted or
    cancelled, the error gives the bounds it knows (at least the 20 acknowledged, at most those
    plus the 64 of the chunk in flight), not 20 as if it were the count."""
    s = make_settings()
    r.hset(Keys(s.namespace).config, "shards", 1)
    lose_the_connection_mid_chunk(monkeypatch, landed=30)

    async def gone(*a: Any, **kw: Any) -> Any:
        raise redis.ConnectionError("Connection refused.")

    monkeypatch.setattr(producer_module, "acancel", gone)
    monkeypatch.setattr(producer_module, "count_enqueued", gone)
    with pytest.raises(RedisUnavailable, match="could not be cancelled") as e:
        Producer(s).submit(shifted(200), burst_id="cut")
    assert "at least 20 and at most 84 of its 200 requests" in str(e.value), str(e.value)
