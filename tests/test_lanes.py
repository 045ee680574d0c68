"""A lane's life on real Redis (prefixq.core.sharing, lua/close_lane.lua): closed only when it
holds no
entry and nothing more can come; a close that finds undelivered entries says so, and a worker
reads them although no doorbell announced them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import redis

from fake_engine import FakeEngine
from helpers import FakeWorker, wait_burst, wait_until
from prefixq.client import Producer
from prefixq.core import wire
from prefixq.core.entries import to_wire
from prefixq.core.keys import FIELD, GROUP, Keys
from prefixq.core.records import Request
from prefixq.core.settings import Settings
from prefixq.core.sharing import LaneInfo
from prefixq.store.connection import async_client
from prefixq.worker.shard import ShardStream


def lane(r: redis.Redis, s: Settings, burst: str, *, sealed: bool) -> str:
    keys = Keys(s.namespace)
    key = keys.lane(0, burst)
    r.xgroup_create(key, GROUP, id="0", mkstream=True)
    r.hset(keys.lanes(0), burst, LaneInfo("normal", "default", sealed).encode())
    return key


def close(s: Settings, lanes: list[tuple[str, str, bool]]) -> list[int]:
    async def go() -> list[int]:
        r = async_client(s)
        try:
            return await ShardStream(r, s, 0, "t").close_lanes(lanes)
        finally:
            await r.aclose()

    return asyncio.run(go())


def test_only_an_empty_lane_that_cannot_grow_is_closed(settings: Settings, r: redis.Redis) -> None:
    """Sealed and empty: closed with its index entry. Not sealed: left (its producer may still
    send). Holding a pending entry: left. Holding an entry nobody was delivered: left, and the
    caller is told to read it (-1). Of an ended burst and idle for a minute: closed although not
    sealed; idle for less: left."""
    s, keys = settings, Keys(settings.namespace)
    sealed = lane(r, s, "sealed", sealed=True)
    open_ = lane(r, s, "open", sealed=False)
    pending = lane(r, s, "pending", sealed=True)
    r.xadd(pending, {FIELD: b"x"})
    r.xreadgroup(GROUP, "w", {pending: ">"})
    waiting = lane(r, s, "waiting", sealed=True)
    r.xadd(waiting, {FIELD: b"x"})
    old = lane(r, s, "old", sealed=False)
    r.xadd(old, {FIELD: b"x"}, id="1000-0")  # added long ago, then acked and deleted
    r.xdel(old, "1000-0")
    recent = lane(r, s, "recent", sealed=False)
    r.xdel(recent, r.xadd(recent, {FIELD: b"x"}))
    got = close(
        s,
        [
            (sealed, "sealed", False),
            (open_, "open", False),
            (pending, "pending", False),
            (waiting, "waiting", False),
            (old, "old", True),
            (recent, "recent", True),
        ],
    )
    assert got == [1, 0, 0, -1, 1, 0]
    assert not r.exists(sealed) and not r.exists(old)
    assert {b.decode() for b in r.hkeys(keys.lanes(0))} == {"open", "pending", "waiting", "recent"}


def entry(burst: str, index: int) -> bytes:
    q = Request(id=f"q{index}", prompt="hi")
    d = to_wire(
        q,
        burst=burst,
        index=index,
        shard=0,
        enqueued=0.0,
        work=1,
        predicted_cached=0,
        prefix=None,
        prefix_ref=None,
        own={"p": "hi"},
    )
    return wire.encode(d)


def test_a_lane_with_entries_its_worker_missed_is_read_again(
    settings: Settings, r: redis.Redis, fake_worker: Callable[..., FakeWorker]
) -> None:
    """Given a sealed lane a worker found drained but could not close (an entry pending on
    another consumer), when an entry appears in it without a doorbell (a lost one), the worker's
    lane sweep learns it (the close says -1) and serves it."""
    s, keys = settings, Keys(settings.namespace)
    r.hset(keys.burst("m"), mapping={"total": 1, "done": 0, "failed": 0, "status": "queued"})
    key = lane(r, s, "m", sealed=True)
    r.xadd(key, {FIELD: entry("m", 5)})
    r.xreadgroup(GROUP, "ghost", {key: ">"})  # held elsewhere: the lane cannot close
    fw = fake_worker(s)
    wait_until(lambda: fw.worker is not None and "m" in fw.worker.sched.lanes, 10, "lane seen")
    assert fw.worker is not None
    wait_until(lambda: not fw.worker.sched.lanes["m"].remote, 10, "the lane drained")
    r.xadd(key, {FIELD: entry("m", 0)})  # no doorbell
    (res,) = wait_burst(r, s, "m", 10)
    assert res.error is None and res.worker == fw.name


def test_a_worker_admits_a_burst_in_its_enqueue_order_across_chunks(
    make_settings: Callable[..., Settings],
    fake_worker: Callable[..., FakeWorker],
    r: redis.Redis,
) -> None:
    """52 requests on 26 shared documents, grouped: the engine gets them exactly in enqueue order,
    chunk boundaries included. (When a chunk's last entry was its doorbell, it was admitted ahead
    of its chunk and split its document's pair.) The shared pass is off: its content order would
    enqueue the documents in another order than 0..25 (tests/test_shared_pass.py)."""
    s = make_settings(prefix_store_min_chars=16, shared_pass=False)
    engine = FakeEngine(max_num_seqs=256)
    fake_worker(s, name="order", engine=engine)
    reqs = [
        {"id": f"d{d}q{q}", "prefix": f"doc {d} " * 40, "prompt": f"q{q}", "max_tokens": 1}
        for q in range(2)
        for d in range(26)
    ]
    burst = Producer(s).submit(reqs)
    wait_burst(r, s, burst)
    got = [int(x.split(":")[1]) for x in engine.seen if x.startswith(f"{burst}:")]
    assert got == [q * 26 + d for d in range(26) for q in range(2)], got


def test_a_worker_that_starts_after_its_burst_was_sent_admits_it_in_enqueue_order(
    make_settings: Callable[..., Settings],
    fake_worker: Callable[..., FakeWorker],
    r: redis.Redis,
) -> None:
    """The whole burst (200 requests on 100 shared documents: chunks of 4, 16, 64 and 116) is in
    Redis before the worker starts, so its first read finds every chunk's doorbell in the intake
    and none of the lane entries they announce (it learns of the lane from them): each doorbell
    still goes into the engine after the lane entries enqueued before it, never ahead of them.
    (Admitted on sight, the three doorbells went right after the head and split their
    documents' pairs.) The shared pass is off, as above."""
    s = make_settings(prefix_store_min_chars=16, shared_pass=False)
    reqs = [
        {"id": f"d{d}q{q}", "prefix": f"doc {d} " * 40, "prompt": f"q{q}", "max_tokens": 1}
        for q in range(2)
        for d in range(100)
    ]
    burst = Producer(s).submit(reqs)
    engine = FakeEngine(max_num_seqs=256)
    fake_worker(s, name="late", engine=engine)
    wait_burst(r, s, burst)
    got = [int(x.split(":")[1]) for x in engine.seen if x.startswith(f"{burst}:")]
    assert got == [q * 100 + d for d in range(100) for q in range(2)], got


def test_a_worker_restarted_mid_burst_reads_on_without_idle_rounds(
    make_settings: Callable[..., Settings],
    fake_worker: Callable[..., FakeWorker],
    r: redis.Redis,
) -> None:
    """Given a 6,000-request burst half served by a worker that then stops, when a worker starts
    under the same name, then it serves the rest, every request once, without rounds that find
    nothing to read nor to pick (its lanes' entries wait for intake entries the first worker
    consumed; the pick finds that only after the round's plan: before, each such round slept
    50 ms, at nearly every batch: the rest of the burst went ~12 times slower)."""
    s = make_settings(max_inflight=8)
    burst = Producer(s).submit([{"id": f"q{i}", "prompt": f"w {i}"} for i in range(6000)])
    first = fake_worker(s, name="rs")
    wait_until(lambda: r.hlen(s.keys.results(burst)) >= 1500, 60, "a quarter of the burst")
    first.stop()
    again = fake_worker(s, name="rs")
    wait_burst(r, s, burst, 120)
    assert again.worker is not None
    idle = again.worker.reader.idle_rounds
    assert r.hlen(s.keys.results(burst)) == 6000
    assert idle <= 5, f"{idle} idle rounds of 50 ms"
