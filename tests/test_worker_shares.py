"""Each worker's share of a burst (the record's ``w:<worker>``), counted once per burst and written
group by the writer's record calls (store/scripts.py), on a private redis-server: exact, also with
redeliveries in the group, and never a record created by counting."""

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
    number of results, counted with one HINCRBY per burst: as many fewer than the same results
    recorded one by one as the group has results beyond one per burst."""
    s, r = quiet
    bursts, ws = written(r, s, 9, 7)
    (third,), every = written(r, s, 16)
    singles = [w for w in every if w.entry.burst == third]
    by_burst = {b: [w for w in ws if w.entry.burst == b] for b in bursts}
    group = [w for pair in zip(*by_burst.values(), strict=False) for w in pair]
    group += [w for w in ws if w not in group]

    before = hincrbys(r)
    record(s, [group])
    grouped = hincrbys(r) - before
    before = hincrbys(r)
    record(s, [[w] for w in singles])
    one_by_one = hincrbys(r) - before

    assert [share(r, s, b) for b in bursts] == [9, 7] and share(r, s, third) == len(singles)
    assert len(singles) == len(group) and one_by_one - grouped == len(group) - len(bursts)


def test_redelivered_results_in_a_group_are_not_counted_twice(
    quiet: tuple[Settings, redis.Redis],
) -> None:
    """Given a group whose last result of a burst (the one that counts for the group) is new while
    others were recorded before, and one whose last result was recorded before, each result of
    the burst counts once."""
    s, r = quiet
    (burst,), ws = written(r, s, 10)
    first, again = ws[:4], [*ws[:6], ws[9]]
    replies = record(s, [first, again, [*ws[6:9], ws[0]], ws])
    assert replies[0] == [1] * 4
    assert share(r, s, burst) == 10
    assert r.hget(s.keys.burst(burst), "status") == b"finished"


def test_counting_never_creates_a_record(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Given a burst whose record is gone (expired), recording a group for it and correcting a
    count leave no record behind; a finished burst's record keeps its TTL when a count is
    corrected."""
    s = make_settings(shards=1)
    (gone, done), ws = written(r, s, 3, 2)
    r.delete(s.keys.burst(gone))
    replies = record(s, [ws])
    assert replies[0][:3] == [RECORD_LOST] * 3
    assert not r.exists(s.keys.burst(gone))
    assert share(r, s, done) == 2 and r.ttl(s.keys.burst(done)) > 0

    count = r.register_script(lua("count_results"))
    assert count(keys=[s.keys.burst(gone)], args=[WORKER, 1, "0"]) == 0
    assert not r.exists(s.keys.burst(gone))
    assert count(keys=[s.keys.burst(done)], args=[WORKER, -1, "0"]) == 1
    assert share(r, s, done) == 1 and r.ttl(s.keys.burst(done)) > 0
    # another burst of the same id (created at another time) is left alone
    assert count(keys=[s.keys.burst(done)], args=[WORKER, 1, repr(time.time() + 5)]) == 0
    assert share(r, s, done) == 1


def test_a_single_record_call_counts_its_own_result_as_before(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """`record_call` without a group (reclaim's dead letters, the tests) counts its own result
    when it is recorded, and not a redelivery of it."""
    s = make_settings(shards=1)
    (burst,), ws = written(r, s, 2)
    script = r.register_script(lua("record_result"))
    for w in (ws[0], ws[0]):
        keys, args = record_call(s.keys, burst, w.result, s, repr(time.time()))
        script(keys=keys, args=args)
    assert share(r, s, burst) == 1
