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


def test_a_burst_arriving_late_starts_where_the_others_got_to() -> None:
    """Its first request ties with the last that finished of the burst already in the engine
    (no credit for what finished before), and with the mean of several bursts' fronts; back
    after an idle spell it resumes at its own clock when that is ahead."""
    o = EngineOrder()
    a = [o.enter("normal", "ta", "A", 1.0) for _ in range(10)]
    assert a == [i * SCALE for i in range(10)]
    for p in a[:4]:  # four of A finished
        o.left("normal", "A", p)
    b = [o.enter("normal", "tb", "B", 1.0) for _ in range(3)]
    assert b == [a[3], a[4], a[5]]
    # C: the mean of A's front (3 000) and B's (none of it finished: its first, 3 000)
    o.left("normal", "A", a[8])  # A's front is now 8 000: the mean 5 500
    assert o.enter("normal", "tc", "C", 1.0) == (8 * SCALE + 3 * SCALE) // 2
    # B gone and back while A still runs: it resumes at its own clock (6 000, ahead of ... )
    for p in b:
        o.left("normal", "B", p)
    assert o.enter("normal", "tb", "B", 1.0) == max(6 * SCALE, (8 * SCALE + 5_500) // 2)


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


def test_one_slow_request_does_not_give_a_newcomer_credit_for_all_since() -> None:
    """One request of A stays in the engine while 10,000 others of A come and go: a burst that
    arrives then starts at A's last finished request, not at the slow one; what `EngineOrder`
    remembers stays bounded by the bursts in the engine."""
    o = EngineOrder()
    o.enter("normal", "t", "A", 1.0)
    last = 0
    for _ in range(10_000):
        last = o.enter("normal", "t", "A", 1.0)
        o.left("normal", "A", last)
    assert o.enter("normal", "t2", "B", 1.0) == last
    for i in range(1000):  # bursts that come and go while A stays
        o.left("normal", f"x{i}", o.enter("normal", "t3", f"x{i}", 1.0))
    assert o.inflight("normal") == 2
    assert o.kept("normal") <= 2 * 2 + 64 + 1, o.kept("normal")
