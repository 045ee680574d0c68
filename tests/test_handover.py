"""Moving a shard's queued work to live shards (worker/handover.py, store/entry_moves.py) on a
real redis-server, with bursts submitted by the real producer and no engine: whole prefix groups,
exactly once, retried moves adding nothing, deliveries carried, priorities kept."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from typing import Any

import pytest
import redis

from helpers import cli, queue_keys, queued_entries, wait_burst
from prefixq.client import Producer
from prefixq.core import wire
from prefixq.core.entries import Entry
from prefixq.core.keys import CARRIED, FIELD, GROUP, LANE, POS, Keys
from prefixq.core.settings import Settings
from prefixq.integrations.metric_series import COUNTERS
from prefixq.integrations.worker_metrics import WorkerMetrics
from prefixq.ops.fleet_stats import fleet
from prefixq.store.connection import async_client
from prefixq.store.deployment import ajoin
from prefixq.store.entry_moves import EntryMoves
from prefixq.store.liveness import alive_mask, beat_commands
from prefixq.worker.fleet import FleetWatch
from prefixq.worker.handover import Handover, MoveReport


def _burst(docs: int, per_doc: int, *, doc_chars: int = 3000) -> list[dict[str, Any]]:
    reqs = []
    for d in range(docs):
        doc = f"document {d} " + ("lorem ipsum dolor sit amet " * doc_chars)[:doc_chars]
        for q in range(per_doc):
            reqs.append(
                {"id": f"d{d}q{q}", "prefix": doc, "prompt": f"question {q}?", "max_tokens": 4}
            )
    return reqs


def _entries(r: redis.Redis, s: Settings, shard: int) -> list[tuple[bytes, dict[bytes, bytes]]]:
    return queued_entries(r, s, shard)


def _decoded(fields: dict[bytes, bytes]) -> Entry:
    return Entry.from_wire(wire.decode(fields[FIELD]))


def _mark_live(r: redis.Redis, s: Settings, *shards: int) -> None:
    for k in shards:
        r.hset(Keys(s.namespace).live, str(k), repr(time.time()))


def _move(s: Settings, source: int, shards: int, why: str = "orphaned") -> MoveReport:
    async def go() -> MoveReport:
        client = async_client(s)
        try:
            return await Handover(client, s, name="test").move_shard(source, shards, why=why)
        finally:
            await client.aclose()

    return asyncio.run(go())


def _delivered(
    r: redis.Redis, s: Settings, consumer: str, count: int, priority: str = "normal"
) -> tuple[int, str, list[bytes]]:
    """(the shard holding the queued entries, its intake of ``priority``, the ids of that intake)
    after ``count`` of them were delivered to ``consumer``."""
    shard = next(k for k in range(s.shards) if _entries(r, s, k))
    stream = Keys(s.namespace).intake(shard, priority)
    r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    ids = [eid for eid, _ in r.xrange(stream)]
    r.xreadgroup(GROUP, consumer, {stream: ">"}, count=count)
    return shard, stream, ids


@pytest.fixture
def three(make_settings: Any) -> Settings:
    return make_settings(shards=3, placement="hash")


def test_an_orphaned_shards_queue_moves_whole_groups_to_live_shards_exactly_once(
    r: redis.Redis, make_settings: Any
) -> None:
    three = make_settings(shards=3)
    _mark_live(r, three, 0, 1, 2)
    Producer(three).submit(_burst(12, 5))
    before = {k: len(_entries(r, three, k)) for k in range(3)}
    assert before[1] > 0
    r.hdel(Keys(three.namespace).live, "1")
    rep = _move(three, 1, 3)
    assert rep.requests == before[1]
    assert _entries(r, three, 1) == []
    after = {k: _entries(r, three, k) for k in (0, 2)}
    assert sum(map(len, after.values())) == sum(before.values())
    ids = Counter(_decoded(f).id for rows in after.values() for _, f in rows)
    assert set(ids.values()) == {1} and len(ids) == 60
    # every document's questions on one shard: a group is never split by the move
    home: dict[str, set[int]] = {}
    for k, rows in after.items():
        for _, f in rows:
            home.setdefault(_decoded(f).id.split("q")[0], set()).add(k)
    assert all(len(v) == 1 for v in home.values())
    moved = [f for rows in after.values() for _, f in rows if CARRIED in f]
    assert len(moved) == before[1]
    assert all(LANE not in f and POS not in f and f[CARRIED] == b"0" for f in moved)
    recs = r.xrange(Keys(three.namespace).moves)
    assert sum(int(f[b"requests"]) for _, f in recs) == before[1]
    assert {f[b"why"] for _, f in recs} == {b"orphaned"}
    # the prefix map followed: a later question on a moved document goes where it went
    moved_doc = next(
        d
        for d, ks in home.items()
        if any(
            _decoded(f).id.startswith(d + "q") and CARRIED in f
            for rows in after.values()
            for _, f in rows
        )
    )
    doc_index = int(moved_doc[1:])
    Producer(three).submit([{**_burst(12, 1)[doc_index], "id": "later"}])
    assert {
        k for k in (0, 2) for _, f in _entries(r, three, k) if _decoded(f).id == "later"
    } == home[moved_doc]


def test_nothing_moves_without_a_live_shard_or_under_another_movers_lease(
    r: redis.Redis, three: Settings
) -> None:
    Producer(three).submit(_burst(6, 2))
    n = len(_entries(r, three, 1))
    assert _move(three, 1, 3).skipped == "no live shard to move to"
    _mark_live(r, three, 0)
    r.set(Keys(three.namespace).mover(1), "someone", px=5000)
    assert _move(three, 1, 3).skipped == "another mover holds the lease"
    assert len(_entries(r, three, 1)) == n


def test_a_mover_that_dies_after_taking_leaves_a_plan_the_next_one_finishes_once(
    r: redis.Redis, three: Settings
) -> None:
    Producer(three).submit(_burst(6, 3))
    keys = Keys(three.namespace)
    rows = [(key, eid) for key in keys.intakes(1) for eid, _ in r.xrange(key)]
    assert rows

    async def take_then_die() -> None:
        client = async_client(three)
        try:
            moves = EntryMoves(client, three)
            for key, eid in rows:
                assert await moves.take(1, key, [eid], 2) == 1
            plans = await moves.planned(1)
            assert len(plans) == len(rows)
            # put, then "die" before the plan is dropped: the plan is still there
            await moves._put_batch(2, plans)
        finally:
            await client.aclose()

    asyncio.run(take_then_die())
    assert r.hlen(keys.moving(1)) == len(rows)
    on_two = len(_entries(r, three, 2))
    _mark_live(r, three, 2)
    _move(three, 1, 3)  # finishes the plan first: adds nothing twice
    assert r.hlen(keys.moving(1)) == 0
    ids = Counter(_decoded(f).id for _, f in _entries(r, three, 2))
    assert set(ids.values()) == {1}
    assert len(_entries(r, three, 2)) >= on_two


def test_an_unreadable_plan_goes_to_the_dead_letters_once_and_readable_ones_are_kept(
    r: redis.Redis, three: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """Given a shard's plan hash holding a plan no mover wrote (garbage) beside a real one, a
    look returns the real plan, moves the garbage to the shard's dead letters (raw, with its
    field and reason) and out of the hash; the next look reports nothing (before: it stayed for
    good, an ERROR line at every look)."""
    Producer(three).submit(_burst(3, 3))
    keys = Keys(three.namespace)
    key, eid = next((k, e) for k in keys.intakes(1) for e, _ in r.xrange(k))
    r.hset(keys.moving(1), b"junk\n1-1", b"\xc1 not msgpack")

    async def look_twice() -> tuple[int, int]:
        client = async_client(three)
        try:
            moves = EntryMoves(client, three)
            assert await moves.take(1, key, [eid], 2) == 1
            first = await moves.planned(1)
            return len(first), len(await moves.planned(1))
        finally:
            await client.aclose()

    with caplog.at_level("ERROR", logger="prefixq.store.entry_moves"):
        assert asyncio.run(look_twice()) == (1, 1)
    assert r.hkeys(keys.moving(1)) != [] and not r.hexists(keys.moving(1), b"junk\n1-1")
    dead = r.xrange(keys.dead(1))
    assert len(dead) == 1 and dead[0][1][FIELD] == b"\xc1 not msgpack"
    assert dead[0][1][b"entry"] == b"junk\n1-1"
    assert dead[0][1][b"reason"].startswith(b"unreadable move plan")
    assert sum("unreadable" in m.getMessage() for m in caplog.records) == 1


def test_a_delivered_entry_is_not_taken_and_takes_none_of_its_group(
    r: redis.Redis, three: Settings
) -> None:
    Producer(three).submit(_burst(1, 4))
    shard, stream, ids = _delivered(r, three, "live-worker", 1)

    async def take() -> int:
        client = async_client(three)
        try:
            return await EntryMoves(client, three).take(shard, stream, ids, (shard + 1) % 3)
        finally:
            await client.aclose()

    assert asyncio.run(take()) == 0
    assert [eid for eid, _ in r.xrange(stream)] == ids


def test_a_steal_leaves_a_group_the_victim_has_started_and_takes_whole_untouched_ones(
    r: redis.Redis, make_settings: Any
) -> None:
    """Given shard 0's queue of 3 documents x 4 questions, of which the victim read the first two
    entries, when an idle thief steals from it, then the started document's other questions stay
    on shard 0 (its prefix is cached there) and only untouched documents move, whole."""
    s = make_settings(shards=2, placement="affinity")
    _mark_live(r, s, 0)  # placement puts every new document on the one live shard
    Producer(s).submit(_burst(3, 4))
    streams = queue_keys(r, s, 0)
    stream = max(streams, key=lambda k: r.xlen(k) if r.exists(k) else 0)
    with contextlib.suppress(redis.ResponseError):  # BUSYGROUP: the producer made it
        r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    ((_, read),) = r.xreadgroup(GROUP, "victim", {stream: ">"}, count=2)
    started = {_decoded(f).id.split("q")[0] for _, f in read}
    assert len(started) == 1
    _mark_live(r, s, 1)

    async def steal() -> MoveReport:
        client = async_client(s)
        try:
            h = Handover(client, s, name="thief")
            return await h.steal(0, 1, victim_load=1e9, thief_load=0.0, why="steal")
        finally:
            await client.aclose()

    rep = asyncio.run(steal())
    moved = {_decoded(f).id for _, f in _entries(r, s, 1)}
    docs = {m.split("q")[0] for m in moved}
    assert rep.requests == len(moved) > 0 and not docs & started
    assert all(f"{d}q{q}" in moved for d in docs for q in range(4))  # whole documents
    left = {_decoded(f).id for _, f in _entries(r, s, 0)}
    assert {f"{d}q{q}" for d in started for q in range(4)} <= left  # read or not, all stay


def test_entries_pending_on_a_dead_consumer_move_with_their_deliveries(
    r: redis.Redis, three: Settings
) -> None:
    Producer(three).submit(_burst(2, 2), priority="high")
    keys = Keys(three.namespace)
    shard, high, ids = _delivered(r, three, "dead-worker", 100, "high")
    target = (shard + 1) % 3
    n = len(ids)
    assert n > 0
    _mark_live(r, three, target)
    rep = _move(three, shard, 3)
    assert rep.requests >= n
    moved = r.xrange(keys.intake(target, "high"))
    assert len(moved) >= n
    carried = sorted(int(f[CARRIED]) for _, f in moved if CARRIED in f)
    assert carried.count(1) == n  # one delivery each on the dead consumer
    assert r.xpending(high, GROUP)["pending"] == 0


def test_entries_pending_on_a_consumer_with_a_heartbeat_stay(
    r: redis.Redis, three: Settings
) -> None:
    Producer(three).submit(_burst(1, 3))
    keys = Keys(three.namespace)
    shard, stream, _ = _delivered(r, three, "busy-worker", 100)
    r.hset(keys.heartbeat(shard, "busy-worker"), "pid", 1)
    _mark_live(r, three, (shard + 1) % 3)
    assert _move(three, shard, 3).requests == 0
    assert r.xpending(stream, GROUP)["pending"] == 3


def test_alive_mask_treats_every_shard_as_live_when_none_is() -> None:
    now = time.time()
    assert alive_mask({}, 3, 15.0, now) == [True, True, True]
    assert alive_mask({b"1": repr(now).encode()}, 3, 15.0, now) == [False, True, False]
    assert alive_mask({b"1": repr(now - 60).encode()}, 3, 15.0, now) == [True, True, True]


def _shard_of(r: redis.Redis, s: Settings, rid: str, shards: int) -> int:
    for k in range(shards):
        for _, f in _entries(r, s, k):
            if _decoded(f).id == rid:
                return k
    raise AssertionError(f"{rid} is in no shard's queue")


def test_placement_skips_shards_without_a_live_worker_and_moves_their_map_entries(
    r: redis.Redis, make_settings: Any
) -> None:
    s = make_settings(shards=3)
    keys = Keys(s.namespace)
    _mark_live(r, s, 0, 1, 2)
    Producer(s).submit(_burst(6, 1))
    homes = {f"d{d}q0": _shard_of(r, s, f"d{d}q0", 3) for d in range(6)}
    dead = homes["d0q0"]
    r.hset(keys.live, str(dead), repr(time.time() - 3600))
    before = {k: len(_entries(r, s, k)) for k in range(3)}
    # the same documents again, and new ones: none goes to the dead shard
    burst = [
        {"id": f"again{d}", "prefix": req["prefix"], "prompt": "more?", "max_tokens": 4}
        for d, req in enumerate(_burst(6, 1))
    ] + [{**req, "id": f"new-{req['id']}"} for req in _burst(12, 1, doc_chars=2500)]
    Producer(s).submit(burst)
    assert len(_entries(r, s, dead)) == before[dead]
    # a document whose map entry named the dead shard now names where its question went, and a
    # third burst follows it there
    moved_to = _shard_of(r, s, "again0", 3)
    assert moved_to != dead
    Producer(s).submit([{"id": "third0", "prefix": _burst(1, 1)[0]["prefix"], "prompt": "x?"}])
    assert _shard_of(r, s, "third0", 3) == moved_to
    # documents on live shards stay where their cache is
    for d, home in homes.items():
        if home != dead:
            assert _shard_of(r, s, f"again{d[1:-2]}", 3) == home


def _join(s: Settings) -> int:
    async def go() -> int:
        client = async_client(s)
        try:
            return (await ajoin(client, s)).shard
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_a_joining_worker_takes_the_lowest_shard_without_a_worker_then_grows_the_count(
    r: redis.Redis, make_settings: Any
) -> None:
    s = make_settings(shards=3)
    keys = Keys(s.namespace)
    r.hset(keys.config, "shards", 3)
    beating = {0, 2}  # live workers beat (a joiner waits for a shard whose beats stopped)
    with _beating(r, s, beating):
        assert _join(s) == 1  # the gap
        assert _join(s) == 3  # 1 is held for the first joiner: every shard served, it grows
        assert r.hget(keys.config, "shards") == b"4"
        # two joiners at once never take the same shard
        beating.update({1, 3})
        got = sorted(asyncio.run(_two_joins(s)))
    assert got == [4, 5] and r.hget(keys.config, "shards") == b"6"


@contextlib.contextmanager
def _beating(r: redis.Redis, s: Settings, shards: set[int]) -> Any:
    """``shards`` (a set the test may grow) beat every 0.1 s while inside, as live workers do."""
    import threading

    done = threading.Event()

    def beat() -> None:
        while not done.is_set():
            _mark_live(r, s, *sorted(shards))
            done.wait(0.1)

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join(5)


async def _two_joins(s: Settings) -> list[int]:
    clients = [async_client(s), async_client(s)]
    try:
        return [j.shard for j in await asyncio.gather(*(ajoin(c, s) for c in clients))]
    finally:
        for c in clients:
            await c.aclose()


def test_prefixq_handover_moves_a_shard_by_hand(r: redis.Redis, three: Settings) -> None:
    Producer(three).submit(_burst(6, 2))
    n = len(_entries(r, three, 1))
    _mark_live(r, three, 0, 2)
    out = cli(three, "handover", "--shard", "1", "--json")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert (sum(rep["moved"].values()), rep["why"]) == (n, "operator")
    assert _entries(r, three, 1) == []
    bad = cli(three, "handover", "--shard", "7")
    assert bad.returncode == 2 and "does not exist" in bad.stderr


def test_an_entry_moved_with_its_attempts_used_up_is_dead_lettered_not_run(
    r: redis.Redis, settings: Settings, fake_worker: Any
) -> None:
    """An entry whose carried deliveries already reach max_attempts (a move off a dead worker)
    is dead-lettered when read, its request failed once, and the engine never sees it."""
    burst = Producer(settings).submit([{"id": "tired", "prompt": "hello there", "max_tokens": 2}])
    keys = Keys(settings.namespace)
    ((eid, fields),) = r.xrange(keys.stream(0))
    r.xdel(keys.stream(0), eid)
    r.xadd(keys.stream(0), {**fields, CARRIED: str(settings.max_attempts)})
    fw = fake_worker(settings)
    (res,) = wait_burst(r, settings, burst, 15)
    assert res.error is not None and "dead-lettered" in res.error
    assert f"max_attempts={settings.max_attempts}" in res.error
    assert [rid for rid in fw.engine.seen if not rid.startswith("warmup-")] == []
    assert r.xlen(keys.dead(0)) == 1


def test_a_look_of_any_live_worker_finishes_a_plan_left_on_any_shard(
    r: redis.Redis, three: Settings
) -> None:
    """A mover that failed after taking (its plan left in the source's hash) is finished by the
    next look of any live worker, whichever shard it is: nothing stays taken and unqueued."""
    Producer(three).submit(_burst(4, 2))
    keys = Keys(three.namespace)
    shard = next(k for k in range(3) if _entries(r, three, k))
    rows = [(key, eid) for key in keys.intakes(shard) for eid, _ in r.xrange(key)]
    target = (shard + 1) % 3

    async def take_and_look() -> None:
        client = async_client(three)
        try:
            moves = EntryMoves(client, three)
            for key, eid in rows:
                assert await moves.take(shard, key, [eid], target) == 1
            _mark_live(r, three, 0, 1, 2)
            watch = FleetWatch(client, three, shard=(shard + 2) % 3, name="other")
            await watch.look()
        finally:
            await client.aclose()

    asyncio.run(take_and_look())
    assert r.hlen(keys.moving(shard)) == 0
    moved = [f for _, f in _entries(r, three, target) if CARRIED in f]
    assert len(moved) == len(rows)


def test_a_looks_moves_are_counted_for_the_metrics_by_why(
    r: redis.Redis, make_settings: Any
) -> None:
    """A live worker's look that moves an orphaned shard's queue counts the move in its fleet
    totals, which `WorkerMetrics` serves per ``why`` beside the shards it saw live and orphaned."""
    three = make_settings(shards=3, orphan_after_s=5.0)
    _mark_live(r, three, 0, 1, 2)
    Producer(three).submit(_burst(12, 3))
    queued = len(_entries(r, three, 1))
    assert queued > 0
    keys = Keys(three.namespace)
    r.hdel(keys.live, "1")
    r.hset(keys.orphans, "1", repr(time.time() - 60))  # without a worker for a minute

    async def look() -> FleetWatch:
        client = async_client(three)
        try:
            watch = FleetWatch(client, three, shard=0, name="w0")
            await watch.look()
            return watch
        finally:
            await client.aclose()

    watch = asyncio.run(look())
    assert _entries(r, three, 1) == []
    counted = ("engine_up", "inflight", "max_inflight", *COUNTERS)
    m = WorkerMetrics(0, "w0", lambda now: dict.fromkeys(counted, 0), fleet=watch)
    got = {(s.name, s.labels.get("why", "")): s.value for fam in m.collect() for s in fam.samples}
    assert got[("prefixq_fleet_shards", "")] == 3
    assert got[("prefixq_fleet_live_shards", "")] == 2
    assert got[("prefixq_fleet_orphaned_shards", "")] == 1
    assert got[("prefixq_moves_total", "orphaned")] == 1
    assert got[("prefixq_moved_requests_total", "orphaned")] == queued
    recorded = sum(int(f[b"tokens"]) for _, f in r.xrange(keys.moves))
    assert got[("prefixq_moved_prompt_tokens_total", "orphaned")] == recorded > 0
    assert ("prefixq_moves_total", "steal") not in got
    totals = fleet(r, three, 3, time.time())["moves"]  # inspect's: the totals hash
    assert totals["orphaned"]["requests"] == queued and totals["orphaned"]["tokens"] == recorded


def test_a_fleet_watch_waits_out_a_full_redis_with_one_warning(
    r: redis.Redis, make_settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis refusing writes (maxmemory reached) skips the looks with one warning, not a
    traceback per heartbeat (it logged one every look: the soak counts those as failures); the
    look after Redis takes writes again records the shard as usual."""
    s = make_settings(shards=2, heartbeat_s=0.05, orphan_after_s=5.0)
    keys = Keys(s.namespace)
    _mark_live(r, s, 0)  # shard 1 never had a worker: a look records when it was first seen

    async def watch(seconds: float) -> None:
        client = async_client(s)
        stop = asyncio.Event()
        try:
            task = asyncio.create_task(FleetWatch(client, s, shard=0, name="w0").run(stop))
            await asyncio.sleep(seconds)
            stop.set()
            await task
        finally:
            await client.aclose()

    r.config_set("maxmemory", 1)
    try:
        with caplog.at_level("WARNING", logger="prefixq.worker.fleet"):
            asyncio.run(watch(0.5))
    finally:
        r.config_set("maxmemory", 0)
    fleet_logs = [x for x in caplog.records if x.name == "prefixq.worker.fleet"]
    assert [x.levelname for x in fleet_logs] == ["WARNING"], [x.getMessage() for x in fleet_logs]
    assert "refuses" in fleet_logs[0].getMessage() and "OOM" in fleet_logs[0].getMessage()
    assert not r.hexists(keys.orphans, "1")
    asyncio.run(watch(0.2))
    assert r.hexists(keys.orphans, "1")


def test_a_joiner_that_served_and_died_leaves_its_shard_to_the_next_joiner(
    r: redis.Redis, make_settings: Any
) -> None:
    """Given a joiner that took shard 1, beat (its engine was up) and was then killed -9, when
    another worker joins within the first one's hold, then it takes shard 1 (the lowest without
    a live worker), not a new shard: a heartbeat ends the hold."""
    s = make_settings(shards=3, heartbeat_ttl_s=3.0)
    keys = Keys(s.namespace)
    r.hset(keys.config, "shards", 3)
    _mark_live(r, s, 0, 2)
    assert _join(s) == 1
    pipe = r.pipeline(transaction=False)
    beat_commands(pipe, keys, 1, time.time() - 10)  # its last beat, 10 s ago: dead since
    pipe.execute()
    assert _join(s) == 1
    assert r.hget(keys.config, "shards") == b"3"


@pytest.mark.parametrize("garbage", ["no-ttl", "long-ttl", "wrong-type"])
def test_a_lease_no_mover_set_does_not_block_the_shards_moves(
    r: redis.Redis, three: Settings, garbage: str
) -> None:
    """Given an orphaned shard whose mover lease key holds what no mover writes (a value without
    a TTL, one longer than a mover's lease, or another type: a restore, a hand edit), when a
    live worker moves the shard, then it takes the lease over and the queue moves."""
    Producer(three).submit(_burst(6, 2))
    n = len(_entries(r, three, 1))
    assert n
    _mark_live(r, three, 0)
    lease = Keys(three.namespace).mover(1)
    if garbage == "no-ttl":
        r.set(lease, "garbage")
    elif garbage == "long-ttl":
        r.set(lease, "garbage", ex=30 * 24 * 3600)
    else:
        r.hset(lease, "x", "y")
    rep = _move(three, 1, 3)
    assert (rep.skipped, rep.requests) == ("", n)
    assert _entries(r, three, 1) == [] and not r.exists(lease)


def test_a_hand_over_waits_for_a_steal_under_way_on_its_shard_then_moves_the_rest(
    r: redis.Redis, three: Settings
) -> None:
    """Given a stopping worker of shard 1 (``--hand-over``) while an idle worker holds shard 1's
    mover lease for a steal (1.5 s left), when it hands its queue over, then it waits for the
    lease and moves the rest, rather than leaving it to wait ``orphan_after_s``."""
    Producer(three).submit(_burst(6, 2))
    n = len(_entries(r, three, 1))
    assert n
    _mark_live(r, three, 0, 1, 2)
    r.set(Keys(three.namespace).mover(1), "a-thief:token", px=1500)

    async def hand_over() -> MoveReport | None:
        client = async_client(three)
        try:
            return await FleetWatch(client, three, shard=1, name="w1").hand_over()
        finally:
            await client.aclose()

    rep = asyncio.run(hand_over())
    assert rep is not None and (rep.skipped, rep.requests) == ("", n)
    assert _entries(r, three, 1) == []


def test_a_join_reads_garbage_in_the_live_and_joins_hashes_as_no_beat_and_no_hold(
    r: redis.Redis, make_settings: Any
) -> None:
    """Given fields of the live and joins hashes that are not times (a hand edit), when a worker
    joins, then it reads them as no heartbeat and no hold (as the producers and movers read the
    live hash) instead of failing the join's script."""
    s = make_settings(shards=3)
    keys = Keys(s.namespace)
    r.hset(keys.config, "shards", 3)
    _mark_live(r, s, 0, 2)
    r.hset(keys.live, "1", "garbage")
    r.hset(keys.joins, "1", "not a time")
    assert _join(s) == 1


def test_a_group_taken_in_part_is_counted_for_what_moved(
    r: redis.Redis, make_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given an orphaned shard's one group, 2 entries pending on a dead consumer and 2 never
    delivered, when a worker reads one of the latter between the move's two takes, then the 2
    taken entries move and the report, the moves stream and the load estimate count them (the
    rest stays: a raced group)."""
    three = make_settings(shards=3)  # affinity: the 4 questions are one group
    _mark_live(r, three, 0, 1, 2)
    Producer(three).submit(_burst(1, 4))
    shard, stream, _ = _delivered(r, three, "dead-worker", 2)
    keys = Keys(three.namespace)
    r.hdel(keys.live, str(shard))
    load_before = float(r.hget(keys.load, str(shard)) or 0)
    real_take = EntryMoves.take

    async def racing_take(self: EntryMoves, *args: Any, **kw: Any) -> int:
        if kw.get("pending_on") is None:  # a live worker reads one of the new part first
            r.xreadgroup(GROUP, "live-worker", {stream: ">"}, count=1)
        return await real_take(self, *args, **kw)

    monkeypatch.setattr(EntryMoves, "take", racing_take)
    rep = _move(three, shard, 3)
    assert (rep.requests, rep.raced) == (2, 1)
    assert len(_entries(r, three, shard)) == 2
    recs = r.xrange(keys.moves)
    assert sum(int(f[b"requests"]) for _, f in recs) == 2
    assert float(r.hget(keys.load, str(shard)) or 0) < load_before
