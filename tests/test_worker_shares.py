"""Recording a written group (lua/record_result.lua: one call per burst of the group) on a private
redis-server: each worker's share of a burst (the record's ``w:<worker>``) and the burst's counters
move once per call, exact also with redeliveries, results outside the burst and another burst of
the same id in the group, and never a record created."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from helpers import queued_entries
from prefixq.cli.redis_server import RedisServer
from prefixq.client import Producer
from prefixq.core import wire
from prefixq.core.entries import Entry
from prefixq.core.records import Result
from prefixq.core.settings import Settings
from prefixq.store.connection import async_client, lua
from prefixq.store.scripts import RECORD_LOST, record_call
from prefixq.worker.deliveries import Written
from prefixq.worker.shard import ShardStream

WORKER = "share-w"


@pytest.fixture
def quiet() -> Iterator[tuple[Settings, redis.Redis]]:
    """Settings and a client of a private redis-server whose command counters only this test
    moves."""
    with RedisServer() as srv:
        r = redis.Redis.from_url(srv.url)
        yield Settings(redis_url=srv.url, namespace="shares", shards=1), r
        r.close()


def written(r: redis.Redis, s: Settings, *sizes: int) -> tuple[list[str], list[Written]]:
    """Bursts of ``sizes`` requests, and a finished result of every entry queued on shard 0
    (theirs, and those of bursts submitted before)."""
    bursts = [
        str(Producer(s).submit([{"id": f"q{i}", "prompt": f"p {b} {i}"} for i in range(n)]))
        for b, n in enumerate(sizes)
    ]
    out = []
    for entry_id, fields in queued_entries(r, s):
        e = Entry.from_wire(wire.decode(fields[b"d"]))
        res = e.result(0, WORKER)
        res.text, res.finish_reason = "answer", "stop"
        out.append(Written(s.keys.stream(0), entry_id, e, res))
    return bursts, out


def record(s: Settings, groups: list[list[Written]]) -> list[list[int]]:
    """Each group through `ShardStream.record`, as the writer writes it."""

    async def main() -> list[list[int]]:
        ar = async_client(s)
        try:
            stream = ShardStream(ar, s, 0, WORKER)
            return [[int(x) for x in await stream.record(g)] for g in groups]
        finally:
            await ar.aclose()

    return asyncio.run(main())


def share(r: redis.Redis, s: Settings, burst: str) -> int:
    return int(r.hget(s.keys.burst(burst), f"w:{WORKER}") or 0)


def hincrbys(r: redis.Redis) -> int:
    return int(r.info("commandstats").get("cmdstat_hincrby", {}).get("calls", 0))


def test_a_group_counts_each_bursts_share_once_not_once_per_result(
    quiet: tuple[Settings, redis.Redis],
) -> None:
    """Given one written group of two bursts' results, interleaved, each burst's share is its
    number of results, and its counters move once per burst: as many HINCRBYs per call as for a
    result recorded alone."""
    s, r = quiet
    bursts, ws = written(r, s, 9, 7)
    (third,), every = written(r, s, 16)
    singles = [w for w in every if w.entry.burst == third]
    by_burst = {b: [w for w in ws if w.entry.burst == b] for b in bursts}
    group = [w for pair in zip(*by_burst.values(), strict=False) for w in pair]
    group += [w for w in ws if w not in group]

    before = hincrbys(r)
    last = {w.entry.burst: i for i, w in enumerate(group)}
    assert record(s, [group]) == [
        [2 if last[w.entry.burst] == i else 1 for i, w in enumerate(group)]
    ]
    grouped = hincrbys(r) - before
    before = hincrbys(r)
    record(s, [[w] for w in singles])
    one_by_one = hincrbys(r) - before

    assert [share(r, s, b) for b in bursts] == [9, 7] and share(r, s, third) == len(singles)
    assert len(singles) == len(group) and grouped * len(singles) == one_by_one * len(bursts)
    for b, n in zip(bursts, (9, 7), strict=True):
        got = r.hmget(s.keys.burst(b), "done", "failed", "status")
        assert got == [str(n).encode(), b"0", b"finished"]


def test_redelivered_results_in_a_group_are_not_counted_twice(
    quiet: tuple[Settings, redis.Redis],
) -> None:
    """Given a group whose last result of a burst is new while others were recorded before, and
    one whose last result was recorded before, each result of the burst counts once."""
    s, r = quiet
    (burst,), ws = written(r, s, 10)
    first, again = ws[:4], [*ws[:6], ws[9]]
    replies = record(s, [first, again, [*ws[6:9], ws[0]], ws])
    assert replies[0] == [1] * 4
    assert replies[1] == [0, 0, 0, 0, 1, 1, 1]
    assert replies[2] == [1, 1, 2, 3]  # the last new one ends the burst; then a redelivery
    assert replies[3] == [3] * 10
    assert share(r, s, burst) == 10
    assert r.hmget(s.keys.burst(burst), "done", "status") == [b"10", b"finished"]


def test_one_call_decides_each_result_as_if_recorded_alone(
    quiet: tuple[Settings, redis.Redis],
) -> None:
    """Given one call of a burst's results with an index outside the burst, an entry of another
    burst of the same id (created at another time), a failure, a redelivery in the same call and
    tokens, each gets the reply it would alone, and the counters hold exactly what was recorded."""
    s, r = quiet
    (burst,), ws = written(r, s, 3)
    for w in ws:
        w.result.prompt_tokens, w.result.cached_tokens = 10, 4
    bad = Result(id="x", index=7, text="no", finish_reason="stop")
    older = Result(id="q1", index=1, text="older", finish_reason="stop")
    failed = ws[2].result
    failed.error, failed.error_code = "boom", "expired"
    enq = ws[0].entry.enqueued
    items = [
        (ws[0].result, enq),
        (bad, enq),
        (older, enq - 60),
        (ws[0].result, enq),
        (failed, enq),
        (ws[1].result, 0.0),
    ]
    keys, args = record_call(s.keys, burst, items, s, repr(time.time()), WORKER)
    assert r.register_script(lua("record_result"))(keys=keys, args=args) == [1, -1, -2, 0, 1, 2]
    rec = r.hgetall(s.keys.burst(burst))
    assert (rec[b"done"], rec[b"failed"], rec[b"expired"], rec[b"status"]) == (
        b"2",
        b"1",
        b"1",
        b"expired",
    )
    assert (rec[b"prompt_tokens"], rec[b"cached_tokens"], rec[f"w:{WORKER}".encode()]) == (
        b"30",
        b"12",
        b"3",
    )
    assert sorted(r.hkeys(s.keys.results(burst))) == [b"0", b"1", b"2"]
    assert r.xlen(s.keys.events(burst)) == 3 and r.ttl(s.keys.burst(burst)) > 0


def test_recording_never_creates_a_record(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Given a burst whose record is gone (expired), recording a group for it leaves no record
    behind (every reply "record lost"); a finished burst's record keeps its TTL."""
    s = make_settings(shards=1)
    (gone, done), ws = written(r, s, 3, 2)
    r.delete(s.keys.burst(gone))
    replies = record(s, [ws])
    assert replies[0][:3] == [RECORD_LOST] * 3
    assert not r.exists(s.keys.burst(gone))
    assert share(r, s, done) == 2 and r.ttl(s.keys.burst(done)) > 0


def test_a_single_record_call_counts_its_own_result_as_before(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """`record_call` of one result (reclaim's dead letters, the tests) counts its own result
    when it is recorded, and not a redelivery of it."""
    s = make_settings(shards=1)
    (burst,), ws = written(r, s, 2)
    script = r.register_script(lua("record_result"))
    for w in (ws[0], ws[0]):
        keys, args = record_call(s.keys, burst, [(w.result, 0.0)], s, repr(time.time()), WORKER)
        script(keys=keys, args=args)
    assert share(r, s, burst) == 1
