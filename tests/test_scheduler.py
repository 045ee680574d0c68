"""The worker's scheduler on its own (worker/scheduler.py): what it reads and what it admits,
by priority, tenant weight, cap and burst, with no Redis and no clock."""

from __future__ import annotations

import itertools
from collections import Counter

from prefixq.core.entries import Entry
from prefixq.core.keys import POS
from prefixq.worker.deliveries import Delivery
from prefixq.worker.gates import GATE_S
from prefixq.worker.lanes import Item, Lane
from prefixq.worker.scheduler import Scheduler

INTAKES = ["i:high", "i:normal", "i:low"]
_ids = itertools.count()


def sched(weights: dict[str, float] | None = None, caps: dict[str, int] | None = None) -> Scheduler:
    return Scheduler(
        INTAKES,
        lambda burst: f"lane:{burst}",
        weights=weights or {},
        caps=caps or {},
        read_count=128,
    )


def entry(burst: str, priority: str = "normal", tenant: str = "default") -> Entry:
    return Entry(
        burst=burst,
        index=next(_ids),
        id="q",
        own={"p": "x"},
        prefix=None,
        prefix_ref=None,
        sampling={},
        enqueued=0.0,
        shard=0,
        work=1,
        predicted_cached=0,
        priority=priority,
        tenant=tenant,
    )


def fill(
    s: Scheduler, burst: str, n: int, priority: str = "normal", tenant: str = "default"
) -> Lane:
    """``n`` entries of ``burst`` in stock."""
    lane = s.lane(burst, priority, tenant)
    for _ in range(n):
        e = entry(burst, priority, tenant)
        s.stock(lane, (Delivery(lane.key, f"{e.index}-0".encode(), {}), e))
    return lane


def picked(s: Scheduler, n: int) -> list[str]:
    return [e.burst for _, e, _ in s.pick(n, 0.0)]


def idle(s: Scheduler) -> None:
    """Every intake read and found empty."""
    s.intake_more = [False] * len(INTAKES)


def test_a_higher_priority_is_admitted_first_and_a_lower_one_waits_while_it_has_work() -> None:
    """Stock of all three priorities: the high burst's entries go first; the low burst's only
    after the normal one has nothing left; and none while a higher lane may still hold entries."""
    s = sched()
    idle(s)
    fill(s, "lo", 3, "low")
    fill(s, "no", 3, "normal")
    fill(s, "hi", 2, "high")
    assert picked(s, 4) == ["hi", "hi"]  # nothing of lower priority while high had work
    assert picked(s, 4) == ["no", "no", "no"]
    hi = s.lane("hi", "high", "default")
    hi.exists = True
    s.set_remote(hi, True)  # the high lane may hold more: lower stock waits for the read
    assert picked(s, 4) == []
    s.set_remote(hi, False)
    assert picked(s, 4) == ["lo", "lo", "lo"]


def test_bursts_of_one_tenant_take_turns_whatever_their_size() -> None:
    """A big and a small burst of the same priority and tenant are admitted in turn."""
    s = sched()
    idle(s)
    fill(s, "big", 100)
    fill(s, "small", 5)
    got = picked(s, 10)
    assert got == ["big", "small"] * 5


def test_tenants_are_served_by_weight() -> None:
    """Tenants weighted 3:1 with stock for both are admitted 3:1."""
    s = sched(weights={"a": 3.0, "b": 1.0})
    idle(s)
    fill(s, "ba", 400, tenant="a")
    fill(s, "bb", 400, tenant="b")
    got = Counter(picked(s, 400))
    assert got == {"ba": 300, "bb": 100}


def test_a_tenant_at_its_cap_is_skipped_until_its_requests_leave_the_engine() -> None:
    """A tenant capped at 2 gets at most 2 requests in the engine; the others fill the room; when
    one of its requests leaves, it may have one more."""
    s = sched(caps={"a": 2})
    idle(s)
    fill(s, "ba", 10, tenant="a")
    fill(s, "bb", 10, tenant="b")
    first = s.pick(8, 0.0)
    assert Counter(e.tenant for _, e, _ in first) == {"a": 2, "b": 6}
    s.left(next(t for _, e, t in first if e.tenant == "a"))
    assert [e.tenant for _, e, _ in s.pick(1, 0.0)] == ["a"]


def test_a_tenant_back_from_idle_gets_its_share_not_its_arrears() -> None:
    """A tenant that had no work while another was served does not get the engine to itself
    when it comes back: it starts at the other's virtual time and they alternate."""
    s = sched()
    idle(s)
    fill(s, "old", 300, tenant="a")
    assert picked(s, 200) == ["old"] * 200
    fill(s, "new", 50, tenant="b")
    got = picked(s, 20)
    assert Counter(got) == {"old": 10, "new": 10}


def test_the_default_path_reads_its_lane_and_the_intakes_in_one_command() -> None:
    """One burst with a lane: the round's read is one XREADGROUP over the intakes of its
    priority and above and its lane, COUNT = the free room."""
    s = sched()
    idle(s)
    lane = s.lane("b", "normal", "default")
    lane.exists = True
    s.set_remote(lane, True)
    plan = s.plan(16)
    assert plan.reads == [(["i:high", "i:normal", "lane:b"], 16)]
    assert not plan.block


def test_reads_are_spread_over_lanes_and_a_drained_lane_is_not_read_until_its_doorbell() -> None:
    """Two lanes share the round's reads; a lane that returned fewer than asked is left alone
    until it is marked again (a doorbell); with nothing to read the round blocks on the
    intakes."""
    s = sched()
    idle(s)
    lanes = [s.lane(b, "normal", "default") for b in ("x", "y")]
    for lane in lanes:
        lane.exists = True
        s.set_remote(lane, True)
    plan = s.plan(8)
    assert sorted(plan.asked.items()) == [
        ("i:high", 8),
        ("i:normal", 8),
        ("lane:x", 4),
        ("lane:y", 4),
    ]
    s.read(plan, {"lane:x": 4, "lane:y": 1})  # y is drained
    plan = s.plan(8)
    assert plan.asked == {"i:high": 8, "i:normal": 8, "lane:x": 8}
    s.read(plan, {"lane:x": 0})
    plan = s.plan(8)
    assert plan.block and plan.reads == [(INTAKES, 8)]
    s.set_remote(lanes[1], True)  # y's doorbell
    assert s.plan(8).asked["lane:y"] == 8


def test_only_the_highest_priority_with_work_is_read() -> None:
    """While a high lane may hold entries, no normal lane is read, nor the low intake."""
    s = sched()
    idle(s)
    for burst, prio in (("h", "high"), ("n", "normal")):
        lane = s.lane(burst, prio, "default")
        lane.exists = True
        s.set_remote(lane, True)
    assert s.plan(4).asked == {"i:high": 4, "lane:h": 4}


def test_entries_taken_over_from_a_dead_worker_go_first_whatever_their_priority() -> None:
    """A reclaimed low-priority entry is admitted before high-priority stock (it was admitted
    once already): reclaiming never starves a priority."""
    s = sched()
    idle(s)
    fill(s, "hi", 3, "high")
    e = entry("lo", "low")
    s.take_over((Delivery("i:low", b"1-0", {}), e))
    assert picked(s, 2) == ["lo", "hi"]


def test_what_was_read_and_not_admitted_is_handed_back_whole() -> None:
    """`unstock` returns every entry in stock or taken over, and the scheduler holds none."""
    s = sched()
    fill(s, "a", 3)
    fill(s, "b", 2, "high")
    s.take_over((Delivery("i:low", b"9-0", {}), entry("c", "low")))
    got = s.unstock()
    assert len(got) == 6 and not s.held and s.stocked == [0, 0, 0]
    assert s.pick(10, 0.0) == []


def test_a_capped_tenants_full_stock_does_not_hold_a_lower_priority_back() -> None:
    """A tenant capped at 2 with many small high bursts (heads only: no lanes) fills the worker's
    stock up to `stock_max`, so the high intake is no longer read, though its last read was full.
    Its cap leaves the engine's room to the others: the normal burst is admitted into it, instead
    of waiting until every stocked high head went through two at a time."""
    s = sched(caps={"a": 2})
    idle(s)
    for i in range(75):
        fill(s, f"ha{i}", 4, "high", "a")
    fill(s, "nb", 10, "normal", "b")
    s.intake_more[0] = True  # the last read of the high intake was full
    assert s.stocked[0] >= s.stock_max
    first = s.pick(8, 0.0)
    assert [(e.priority, e.tenant) for _, e, _ in first] == [("high", "a")] * 2
    second = s.pick(6, 0.0)  # the next round, with the room a's cap leaves
    assert [(e.priority, e.tenant) for _, e, _ in second] == [("normal", "b")] * 6
    plan = s.plan(2)
    assert "i:high" not in plan.asked  # the full stock is not added to
    s.read(plan, {})
    assert [e.tenant for _, e, _ in s.pick(2, 0.0)] == ["b", "b"]
    s.left(next(t for _, e, t in first if e.tenant == "a"))  # one of a's leaves: a goes next
    assert [(e.priority, e.tenant) for _, e, _ in s.pick(1, 0.0)] == [("high", "a")]


def placed(s: Scheduler, lane: Lane, key: str, eid: str, pos: str, *, from_lane: bool) -> Item:
    """An entry of ``lane``'s burst read from ``key`` with the place the producer gave it."""
    d = Delivery(key, eid.encode(), {POS: pos.encode()})
    s.place(lane, d, 0.0, from_lane=from_lane)
    return d, entry(lane.burst)


def burst_lane(*, remote: bool) -> tuple[Scheduler, Lane]:
    """A scheduler with every intake read and found empty, and burst b's lane, which exists
    (``remote``: and may hold entries not yet read)."""
    s = sched()
    idle(s)
    lane = s.lane("b", "normal", "default")
    lane.exists = True
    if remote:
        s.set_remote(lane, True)
    return s, lane


def rung(*, room: int) -> tuple[Scheduler, Lane]:
    """`burst_lane` with a doorbell placed after 3 lane entries (`POS` 3:4) in stock, read
    before any of them, and not admitted into ``room`` free slots."""
    s, lane = burst_lane(remote=True)
    s.stock(lane, placed(s, lane, INTAKES[1], "9-0", "3:4", from_lane=False))
    assert picked(s, room) == []
    return s, lane


def test_a_doorbell_read_ahead_of_its_lane_waits_for_the_lane_and_never_stalls_the_round() -> None:
    """A doorbell placed after 3 lane entries (`POS` 3:4), read before any of them: it is not
    admitted, its stock fills no slot, so the round reads its lane for every free slot (the only
    one included: never a round that reads nothing and waits for ever), and the entries go
    first, then the doorbell. A lane read that comes back short (another worker took the
    entries) lets it go at once."""
    s, lane = rung(room=4)
    plan = s.plan(4)
    assert plan.asked.get(lane.key) == 4, plan
    lane_entries = [placed(s, lane, lane.key, f"{i}-0", f"{i}:4", from_lane=True) for i in range(3)]
    s.stock_many(lane, lane_entries)
    assert [d.entry_id for d, _, _ in s.pick(4, 0.0)] == [b"0-0", b"1-0", b"2-0", b"9-0"]

    other, lane = rung(room=4)
    plan = other.plan(4)
    other.read(plan, {})  # nothing came: the lane is drained
    assert picked(other, 4) == ["b"]

    full, lane = rung(room=1)
    assert full.plan(1).asked.get(lane.key) == 1  # one free slot, and the doorbell in stock


def test_a_lane_entry_read_ahead_of_the_intake_entry_before_it_waits_for_the_intake() -> None:
    """A lane entry placed after 5 intake entries (the head and a doorbell), read while this
    worker has read only the head: it waits; the doorbell, read next, goes first. Read while the
    intake is not read at all, it waits for a read of the intake that comes back short after it
    (the doorbell went to another worker), and no longer than GATE_S in any case."""
    s, lane = burst_lane(remote=False)
    head = [placed(s, lane, INTAKES[1], f"h{i}", f"0:{i}", from_lane=False) for i in range(4)]
    for item in head:
        s.stock(lane, item)
    assert len(s.pick(8, 0.0)) == 4
    s.stock_many(lane, [placed(s, lane, lane.key, "l5", "5:5", from_lane=True)])
    assert picked(s, 8) == []  # the doorbell (5:4) is not read yet
    s.stock(lane, placed(s, lane, INTAKES[1], "bell", "5:4", from_lane=False))
    assert [d.entry_id for d, _, _ in s.pick(8, 0.0)] == [b"bell", b"l5"]

    other, lane = burst_lane(remote=False)
    other.stock_many(lane, [placed(other, lane, lane.key, "l5", "5:5", from_lane=True)])
    assert picked(other, 8) == []
    plan = other.plan(8)
    assert INTAKES[1] in plan.asked, plan
    other.read(plan, {})  # the intake came back empty: what was before it is delivered
    assert picked(other, 8) == ["b"]

    late, lane = burst_lane(remote=False)
    late.stock_many(lane, [placed(late, lane, lane.key, "l5", "5:5", from_lane=True)])
    assert picked(late, 8) == []
    assert [d.entry_id for d, _, _ in late.pick(8, GATE_S + 0.1)] == [b"l5"]
