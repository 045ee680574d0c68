"""The KV budget's waiting requests (worker/kv_budget.py) at the worker's edges: up to four windows
of admitted requests wait for room outside the engine (worker/worker.py `room`), and a stop, a
cancel, a deadline, the budget switched off, the heartbeat and the engine's window must each still
see them for what they are. Fake-engine workers against a real redis-server."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from fake_engine import FakeEngine
from helpers import (
    FakeWorker,
    control_command,
    pending_on,
    queue_empty,
    queued_entries,
    wait_burst,
    wait_until,
)
from ledger import account
from prefixq.client import Producer
from prefixq.core import wire
from prefixq.core.entries import Entry
from prefixq.core.keys import CARRIED
from prefixq.core.settings import Settings
from prefixq.store.burst_end import cancel
from prefixq.worker import ends
from prefixq.worker.admission import Admission
from prefixq.worker.kv_budget import KvBudget

MakeWorker = Callable[..., FakeWorker]


def _docs(n: int, secs: float, tag: str = "doc") -> list[str]:
    """``n`` documents whose requests take ``secs`` each in the FakeEngine."""
    return [f"sleep:{secs} {tag}{d} " + f"the {d}th text of the corpus " * 20 for d in range(n)]


def _burst(tag: str, docs: list[str], questions: int = 2) -> list[dict[str, Any]]:
    """``questions`` about each of ``docs``, the documents interleaved (enqueued in this order:
    each next request is another group, so it waits for the budget; a document asked once has
    no group, and waits only while a group is inside)."""
    return [
        {"id": f"{tag}-d{d}-q{q}", "prefix": doc, "prompt": f" question {q}?"}
        for q in range(questions)
        for d, doc in enumerate(docs)
    ]


def _submit(s: Settings, reqs: list[dict[str, Any]], **kw: Any) -> str:
    return asyncio.run(Producer(s).asubmit(reqs, order="input", **kw)).id


def _tokens(r: redis.Redis, s: Settings) -> int:
    """The largest prefix (prompt tokens) among the entries queued now."""
    return max(
        e.work + e.predicted_cached
        for e in (Entry.from_wire(wire.decode(f[b"d"])) for _, f in queued_entries(r, s))
    )


def _engine(kv_tokens: int) -> FakeEngine:
    engine = FakeEngine(max_num_seqs=64)
    engine.kv_tokens = kv_tokens  # type: ignore[attr-defined]  # the budget is sized on it
    return engine


def _budget(fw: FakeWorker) -> KvBudget:
    assert fw.worker is not None
    return fw.worker.admission.budget


def _settled(b: KvBudget) -> bool:
    return (b.used, b.waiting, len(b._inside)) == (0, 0, 0)


def test_drained_requests_cancelled_at_once_leave_the_waiting_count_at_zero() -> None:
    """A stop's drain cancels every late request at once: the one inside leaves and lets the
    next waiting group in, whose request is cancelled too. Each waiting request is uncounted
    once (it was counted twice and `waiting` went below 0)."""

    async def go() -> None:
        b = KvBudget(0.5, 200)  # one group of 100 at a time
        gate = asyncio.Event()

        async def hold(g: int) -> None:
            e = Entry("b", 0, f"r{g}", {}, None, None, {}, 0.0, 0, 100, 0)
            e.group = g
            async with b.hold(e, 0):
                await gate.wait()

        tasks = [asyncio.create_task(hold(g)) for g in (1, 2, 3, 4)]
        await asyncio.sleep(0)
        assert b.waiting == 3
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert _settled(b), (b.used, b.waiting, b._inside)

    asyncio.run(go())


def test_a_stop_with_requests_waiting_at_the_budget_ends_in_grace_and_a_peer_serves_each_once(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """Given a worker (window 2, the budget one document) holding ten requests, most waiting at
    the budget, when it stops (grace 1 s), it exits within the grace period, its budget back to
    nothing, and a peer serves what it left: every request has one result."""
    s = make_settings(
        prefix_store_min_chars=16,
        kv_inflight_share=0.5,
        max_inflight=2,
        grace_s=1.0,
        heartbeat_s=0.5,
    )
    burst = _submit(s, _burst("a", _docs(12, 0.4), 2))
    kv = 2 * _tokens(r, s)
    fw = fake_worker(s, engine=_engine(kv), name="w1")
    b = _budget(fw)
    wait_until(lambda: b.waiting >= 8, 10, "eight requests waiting at the budget")
    t0 = time.monotonic()
    fw.stop()
    assert time.monotonic() - t0 < s.grace_s + 1.0
    assert _settled(b), (b.used, b.waiting, b._inside)
    assert queue_empty(r, s)[0] > 0  # what did not finish is given back (or pending) for the peer
    with fake_worker(s, engine=_engine(kv), name="w2"):
        wait_burst(r, s, burst, 60)
    out = account(r, s, burst, 24, what="stopped with waiting requests")
    assert (out.lost, out.duplicated, out.failed) == (0, 0, 0)


class _Counting(FakeEngine):
    """Counts the requests its engine began."""

    def __init__(self, kv_tokens: int) -> None:
        super().__init__(max_num_seqs=64)
        self.kv_tokens = kv_tokens
        self.began = 0

    async def generate(self, request: Any) -> Any:
        self.began += 1
        return await super().generate(request)


def test_a_stop_gives_the_requests_waiting_at_the_budget_back_uncharged_instead_of_running_them(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """Given a worker (window 2, the budget one document, grace 30 s) with the documents of its
    next eight requests waiting at the budget, when it stops, it ends once the two inside its
    engine finish (0.8 s) instead of running the eight in its grace period (one document at a
    time: 3 s and more: a rolling restart waited for up to four windows of work never started),
    and gives the waiting ones back to the intake with no delivery charged, as it does entries
    read and not started: nothing is left pending on it (they were, and a peer's reclaim charged
    each a delivery: a few restarts in a row made them run alone, on their last allowed one).
    A peer serves them: every request has one result."""
    s = make_settings(
        prefix_store_min_chars=16, kv_inflight_share=0.5, max_inflight=2, grace_s=30.0
    )
    burst = _submit(s, _burst("a", _docs(12, 0.8), 2))
    kv = 2 * _tokens(r, s)
    engine = _Counting(kv)
    fw = fake_worker(s, engine=engine, name="w1")
    b = _budget(fw)
    wait_until(lambda: b.waiting >= 8, 10, "eight requests waiting at the budget")
    t0 = time.monotonic()
    fw.stop()
    took = time.monotonic() - t0
    assert took < 2.5, f"the stop took {took:.1f} s: it ran the waiting requests"
    assert engine.began <= 4, engine.began
    assert _settled(b), (b.used, b.waiting, b._inside)
    assert pending_on(r, s, "w1") == 0, "requests never started were left pending"
    queued = queued_entries(r, s)
    served = [x for x in engine.seen if x.startswith(burst)]  # not its warm-up request
    assert len(queued) == 24 - len(served), (len(queued), served)
    carried = [int(f.get(CARRIED, b"0")) for _, f in queued]
    assert carried == [0] * len(queued), carried  # no delivery charged for the stop
    with fake_worker(s, engine=_engine(kv), name="w2"):
        wait_burst(r, s, burst, 60)
    out = account(r, s, burst, 24, what="stopped with requests waiting at the budget")
    assert (out.lost, out.duplicated, out.failed) == (0, 0, 0)


def test_a_cancelled_bursts_waiting_requests_leave_at_once_and_a_rider_goes_in(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """Given two long requests about document X inside the engine (a window of 3) and a burst's
    requests about twelve other documents waiting at the budget (four windows of them), when
    that burst is cancelled, its requests leave the worker at once (acked, the budget's counters
    back to the long requests'), so a later burst's questions about X are read and the first
    rides in with them (the window holds one more): they waited until X's requests finished, and
    kept every other burst's requests from being read."""
    s = make_settings(prefix_store_min_chars=16, kv_inflight_share=0.5, max_inflight=3, grace_s=0.5)
    (x_doc,) = _docs(1, 6.0, tag="x")
    long = _submit(
        s, [{"id": f"x{q}", "prefix": x_doc, "prompt": f" long one {q}?"} for q in (0, 1)]
    )
    engine = _engine(2 * _tokens(r, s))
    fw = fake_worker(s, engine=engine, name="w1")
    b = _budget(fw)
    wait_until(lambda: b.used > 0, 10, "X inside the engine")
    wait_until(lambda: sum(x.startswith(long) for x in engine.seen) == 2, 10, "X's requests inside")
    doomed = _submit(s, _burst("a", _docs(12, 0.1)))
    wait_until(lambda: b.waiting >= 8, 10, "eight requests waiting at the budget")
    t0 = time.monotonic()
    cancel(doomed, s)
    wait_until(lambda: b.waiting == 0, 3, "the cancelled requests gone from the budget")
    wait_until(lambda: pending_on(r, s, "w1") == 2, 3, "only X's requests held")
    rider = _submit(s, [{"id": f"x{q}", "prefix": x_doc, "prompt": f" more {q}?"} for q in (2, 3)])
    wait_until(lambda: any(x.startswith(rider) for x in engine.seen), 3, "the rider inside")
    assert time.monotonic() - t0 < 5  # X's request is still running
    assert not [x for x in engine.seen if x.startswith(doomed)]
    assert len(b._inside) == 1 and b.waiting == 0
    wait_burst(r, s, long, 30)
    wait_burst(r, s, rider, 30)
    wait_until(lambda: _settled(b), 5, "the budget empty")


def test_a_request_that_reaches_the_budget_after_its_bursts_cancel_notice_does_not_wait(
    make_settings: Callable[..., Settings],
    r: redis.Redis,
    fake_worker: MakeWorker,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given a long request inside the engine and a burst's requests read but not yet at the
    budget (their tasks run after the worker handled the burst's cancel notice: a busy event
    loop), when they get there they do not wait for room (the notice let go only the requests
    that waited then): they get their cancelled result at once, and none reaches the engine."""
    s = make_settings(prefix_store_min_chars=16, kv_inflight_share=0.5, max_inflight=3)
    long = _submit(s, _burst("x", _docs(1, 6.0, tag="x"), 1))
    engine = _engine(2 * _tokens(r, s))
    parked: list[str] = []
    release = threading.Event()
    serve = Admission._serve

    async def late(self: Admission, d: Any, e: Entry, *args: Any) -> None:
        if e.burst != long:  # every other burst's request runs after the notice
            parked.append(e.burst)
            while not release.is_set():
                await asyncio.sleep(0.01)
        await serve(self, d, e, *args)

    monkeypatch.setattr(Admission, "_serve", late)
    try:
        _cancel_as_they_come(s, r, fake_worker(s, engine=engine, name="w1"), long, parked, release)
    finally:  # what is parked goes on, so the worker can stop
        release.set()


def _cancel_as_they_come(
    s: Settings,
    r: redis.Redis,
    fw: FakeWorker,
    long: str,
    parked: list[str],
    release: threading.Event,
) -> None:
    engine = fw.engine
    b = _budget(fw)
    wait_until(lambda: b.used > 0, 10, "the long request inside the engine")
    doomed = _submit(s, _burst("a", _docs(6, 0.1)))
    wait_until(lambda: len(parked) >= 2, 10, "the burst's requests read (the window's room)")
    assert fw.worker is not None
    ended = fw.worker.admission.ends.ended
    t0 = time.monotonic()
    cancel(doomed, s)
    wait_until(lambda: doomed in ended, 5, "the cancel notice handled")
    release.set()
    wait_until(lambda: pending_on(r, s, "w1") == 1, 3, "only the long request held")
    assert b.waiting == 0
    assert time.monotonic() - t0 < 5  # the long request is still running
    assert not [x for x in engine.seen if x.startswith(doomed)]
    wait_burst(r, s, long, 30)
    out = account(r, s, doomed, 12, what="cancelled as its requests came to the budget")
    assert (out.lost, out.duplicated) == (0, 0)
    wait_until(lambda: _settled(b), 5, "the budget empty")


def test_a_deadline_passing_at_the_budget_expires_its_requests_without_running_them(
    make_settings: Callable[..., Settings],
    r: redis.Redis,
    fake_worker: MakeWorker,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given requests waiting at the budget whose deadline passes before there is room, and no
    expiry notice yet (the expiry look is a second apart on every worker; here it never comes),
    when room frees up they get their expired result and never reach the engine (they ran, and
    recorded answers, after their deadline)."""
    monkeypatch.setattr(ends, "EXPIRY_EVERY_S", 3600.0)
    s = make_settings(prefix_store_min_chars=16, kv_inflight_share=0.5, max_inflight=2)
    long = _submit(s, _burst("x", _docs(1, 1.0, tag="x"), 1))  # one: the window has room
    engine = _engine(2 * _tokens(r, s))
    fw = fake_worker(s, engine=engine, name="w1")
    b = _budget(fw)
    wait_until(lambda: b.used > 0, 10, "the long request inside the engine")
    late = _submit(s, _burst("a", _docs(6, 0.1)), deadline=time.time() + 0.3)
    wait_until(lambda: b.waiting >= 6, 10, "six requests waiting at the budget")
    wait_burst(r, s, long, 30)
    got = wait_burst(r, s, late, 30)
    assert {x.error_code for x in got} == {"expired"}
    assert not [x for x in engine.seen if x.startswith(late)]


def test_waiting_groups_enter_the_engine_within_the_worker_window(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """Given a large document filling the budget and eight small ones waiting (outside a window
    of 2), when the large one leaves, the small ones go in as the window lets them: the engine
    never holds more than the window (all that fit the budget went in at once: 8)."""
    s = make_settings(prefix_store_min_chars=16, kv_inflight_share=0.5, max_inflight=2)
    big = "sleep:1.0 big " + "a long text " * 400
    first = _submit(s, [{"id": "big", "prefix": big, "prompt": " q?"}])
    engine = _engine(2 * _tokens(r, s))
    fw = fake_worker(s, engine=engine, name="w1")
    b = _budget(fw)
    wait_until(lambda: b.used > 0, 10, "the large document inside")
    small = _submit(s, _burst("s", _docs(12, 0.2)))
    wait_until(lambda: b.waiting >= 8, 10, "eight requests waiting at the budget")
    wait_burst(r, s, first, 30)
    wait_burst(r, s, small, 30)
    assert engine.peak_active <= s.max_inflight, engine.peak_active
    wait_until(lambda: _settled(b), 5, "the budget empty")


def test_switching_the_budget_off_lets_its_waiting_requests_in_within_the_window(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """Given a worker switched to `admission:kv-history` with requests waiting at its budget,
    when `admission:fair` switches the budget off, they go in as the window lets them (all ten
    went into the engine at once), and every request has one result."""
    s = make_settings(prefix_store_min_chars=16, max_inflight=2)
    burst = _submit(s, _burst("a", _docs(12, 0.3), 2))
    engine = _engine(2 * _tokens(r, s))
    fw = fake_worker(s, engine=engine, name="w1")
    b = _budget(fw)

    control_command(s, "admission:kv-history", [fw.name])
    wait_until(lambda: b.waiting >= 8, 10, "eight requests waiting at the budget")
    control_command(s, "admission:fair", [fw.name])
    wait_burst(r, s, burst, 60)
    assert engine.peak_active <= s.max_inflight, engine.peak_active
    out = account(r, s, burst, 24, what="budget switched off")
    assert (out.lost, out.duplicated, out.failed) == (0, 0, 0)
    wait_until(lambda: _settled(b), 5, "the budget empty")


def test_the_heartbeat_counts_in_the_engine_only_the_requests_inside_it(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """Given ten requests in flight, nine of them waiting at the budget, the heartbeat's
    ``inflight`` (inspect's and the dashboard's "in engine", `prefixq_inflight`) says the one in
    the engine, within ``max_inflight``: it said ten of a window of two."""
    s = make_settings(
        prefix_store_min_chars=16,
        kv_inflight_share=0.5,
        max_inflight=2,
        heartbeat_s=0.2,
        grace_s=0.2,
    )
    _submit(s, _burst("a", _docs(12, 3.0)))
    fw = fake_worker(s, engine=_engine(2 * _tokens(r, s)), name="w1")
    b = _budget(fw)
    assert fw.worker is not None
    wait_until(lambda: b.waiting >= 8, 10, "eight requests waiting at the budget")
    time.sleep(3 * s.heartbeat_s)  # a beat since
    assert len(fw.worker.inflight) - b.waiting == 1
    beat = r.hmget(s.keys.heartbeat(0, "w1"), ["inflight", "max_inflight"])
    assert [int(x or -1) for x in beat] == [1, s.max_inflight]
