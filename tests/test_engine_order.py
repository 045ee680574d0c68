"""Engine priorities by fair share (worker/engine_order.py): bursts that fit the worker's window
go into the engine whole, so the priorities handed with them decide vLLM's order. Checked on the
real worker loop and real Redis with the FakeEngine (which records each request's priority),
and on `EngineOrder` alone; the real vLLM engine: test_engine_order_vllm.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis

from fake_engine import FakeEngine
from helpers import FakeWorker, wait_burst, wait_until
from prefixq.client import Producer
from prefixq.core.settings import Settings
from prefixq.worker.engine_order import SCALE, SPAN, EngineOrder

MakeWorker = Callable[..., FakeWorker]


def sleepy(n: int, secs: float, tag: str) -> list[dict[str, Any]]:
    return [{"id": f"{tag}{i}", "prompt": f"sleep:{secs} {tag} {i}"} for i in range(n)]


def engine_queue(engine: FakeEngine, names: dict[str, str]) -> list[str]:
    """The bursts (by ``names``: burst id -> label) in the order vLLM's priority queue serves
    the recorded requests: by priority, then arrival."""
    got = sorted(enumerate(engine.priorities), key=lambda x: (x[1][1], x[0]))
    return [names[b] for _, (rid, _) in got if (b := rid.split(":")[0]) in names]


def submit_into(
    engine: FakeEngine, s: Settings, reqs: list[dict[str, Any]], **kw: Any
) -> tuple[str, int]:
    """Submit a burst and wait until all of it is inside the engine (it fits the window)."""
    before = len(engine.priorities)
    burst = Producer(s).submit(reqs, **kw)
    wait_until(
        lambda: len(engine.priorities) >= before + len(reqs), 15, f"{len(reqs)} in the engine"
    )
    return burst, len(reqs)


def test_bursts_inside_the_engine_are_served_in_turn_and_a_high_burst_before_them(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """Three tenants' bursts, each whole in the engine before the next arrives, get priorities
    that interleave them one by one (ties go by arrival); a high burst after them gets values
    below every normal one, and with weights 2 : 1 a tenant gets two turns for one."""
    s = make_settings(max_inflight=200, tenant_weights="w2=2")
    engine = FakeEngine(max_num_seqs=100)
    fake_worker(s, engine=engine)
    names, bursts = {}, []
    for label, tenant in (("A", "ta"), ("B", "tb"), ("C", "tc")):
        b, _ = submit_into(engine, s, sleepy(12, 1.0, label), tenant=tenant)
        names[b] = label
        bursts.append(b)
    b, _ = submit_into(engine, s, sleepy(4, 1.0, "H"), priority="high", tenant="th")
    names[b] = "H"
    bursts.append(b)
    order = engine_queue(engine, names)
    assert order[:4] == ["H"] * 4, order
    assert "".join(order[4:]) == "ABC" * 12, "".join(order)
    label = {rid: names.get(rid.split(":")[0]) for rid, _ in engine.priorities}
    high = [p for rid, p in engine.priorities if label[rid] == "H"]
    normal = [p for rid, p in engine.priorities if label[rid] not in ("H", None)]
    assert max(high) < min(normal), (high, normal)
    for b in bursts:
        wait_burst(r, s, b, 30)

    # weights: a tenant of weight 2 gets two places for each of a tenant of weight 1
    engine.priorities.clear()
    names = {}
    for label, tenant in (("X", "w1"), ("Y", "w2")):
        b, _ = submit_into(engine, s, sleepy(12, 1.0, label), tenant=tenant)
        names[b] = label
        bursts.append(b)
    order = "".join(engine_queue(engine, names))
    # X entered alone (tags 0, 1000, ...), Y at X's front with steps of 500
    assert order[:18] == "XYY" * 6, order
    for b in bursts:
        wait_burst(r, s, b, 30)


def test_with_the_setting_off_the_engine_gets_the_band_alone(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """``engine_fair_order=False``: -1 for high, 0 for normal, whatever the bursts."""
    s = make_settings(max_inflight=200, engine_fair_order=False)
    engine = FakeEngine(max_num_seqs=100)
    fake_worker(s, engine=engine)
    a, _ = submit_into(engine, s, sleepy(8, 0.2, "A"), tenant="ta")
    h, _ = submit_into(engine, s, sleepy(4, 0.2, "H"), priority="high")
    assert sorted({p for _, p in engine.priorities}) == [-1, 0]
    wait_burst(r, s, a, 30)
    wait_burst(r, s, h, 30)


def test_a_burst_arriving_late_starts_at_the_oldest_request_still_in_the_engine() -> None:
    """Its first request ties with the oldest unfinished one (the front), not with the first
    burst's first: no credit for what already finished, none for an idle spell."""
    o = EngineOrder()
    a = [o.enter("normal", "ta", "A", 1.0) for _ in range(10)]
    assert a == [i * SCALE for i in range(10)]
    for p in a[:4]:  # four of A finished
        o.left("normal", "A", p)
    b = [o.enter("normal", "tb", "B", 1.0) for _ in range(3)]
    assert b == [a[4], a[5], a[6]]
    # B gone and back while A still runs: it resumes at its own clock (ahead of the front)
    for p in b:
        o.left("normal", "B", p)
    assert o.enter("normal", "tb", "B", 1.0) == a[7]


def test_a_tenants_bursts_share_its_weight_and_bands_stay_apart() -> None:
    """Two bursts of one tenant advance twice as fast as a lone tenant's burst; a low request
    is above every normal one and a high below, however far the clocks run."""
    o = EngineOrder()
    x = [o.enter("normal", "t1", "X", 1.0) for _ in range(2)]
    y = [o.enter("normal", "t2", "Y1", 1.0), o.enter("normal", "t2", "Y2", 1.0)]
    assert x == [0, SCALE] and y == [0, 0]
    # Y1's first step was taken alone (1 000), every later one of Y1 or Y2 with two (2 000)
    y1 = [o.enter("normal", "t2", "Y1", 1.0) for _ in range(2)]
    y2 = [o.enter("normal", "t2", "Y2", 1.0) for _ in range(2)]
    assert y1 == [SCALE, 3 * SCALE] and y2 == [2 * SCALE, 4 * SCALE]
    assert [o.enter("normal", "t1", "X", 1.0) for _ in range(3)] == [
        2 * SCALE,
        3 * SCALE,
        4 * SCALE,
    ]
    low, high = o.enter("low", "t1", "L", 1.0), o.enter("high", "t1", "H", 0.001)
    assert low == SPAN and high == -SPAN
    assert high + (SPAN - 1) < 0 < SPAN
    assert o.inflight("normal") == 11 and o.inflight("high") == 1


def test_a_long_burst_behind_one_old_request_keeps_its_bookkeeping_bounded() -> None:
    """One request stays in the engine while 10,000 others of its burst come and go: what
    `EngineOrder` keeps stays within a few times what is in flight, and the front stays right."""
    o = EngineOrder()
    old = o.enter("normal", "t", "A", 1.0)
    for _ in range(10_000):
        o.left("normal", "A", o.enter("normal", "t", "A", 1.0))
    assert o.inflight("normal") == 1
    assert o.kept("normal") <= 3 * 1025 + 1, o.kept("normal")
    assert o.enter("normal", "t2", "B", 1.0) == old  # B starts at the old request
