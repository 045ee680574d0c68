"""Admission beyond fair shares (worker/groups.py), on the scheduler alone: whole groups wait for
room instead of being split, and resident prefixes go first within one admission of the fair
share. Both are off by default."""

from __future__ import annotations

import itertools
from collections import Counter

from prefixq.core.entries import Entry
from prefixq.worker.deliveries import Delivery
from prefixq.worker.lanes import Lane
from prefixq.worker.scheduler import Scheduler

INTAKES = ["i:high", "i:normal", "i:low"]
_ids = itertools.count()


def sched(*, whole: bool = False, resident: bool = False, window: int = 8) -> Scheduler:
    s = Scheduler(INTAKES, lambda b: f"lane:{b}", weights={}, caps={}, read_count=128)
    s.set_admission(whole_groups=whole, resident_first=resident)
    s.window = window
    s.intake_more = [False] * len(INTAKES)
    return s


def fill(s: Scheduler, burst: str, refs: str, tenant: str = "default") -> Lane:
    """Entries of ``burst`` in stock, one per letter of ``refs`` (its prefix; '-': none)."""
    lane = s.lane(burst, "normal", tenant)
    for ref in refs:
        e = Entry(
            burst=burst,
            index=next(_ids),
            id="q",
            own={"p": "x"},
            prefix=None,
            prefix_ref=None if ref == "-" else ref,
            sampling={},
            enqueued=0.0,
            shard=0,
            work=1,
            predicted_cached=0,
            tenant=tenant,
        )
        s.stock(lane, (Delivery(lane.key, f"{e.index}-0".encode(), {}), e))
    return lane


def refs(s: Scheduler, n: int) -> str:
    return "".join(e.prefix_ref or "-" for _, e, _ in s.pick(n, 0.0))


def test_by_default_a_group_is_split_at_the_edge_of_the_room() -> None:
    """Fair admission takes what fits, whatever the groups."""
    s = sched()
    fill(s, "b", "AAABBC")
    assert refs(s, 2) == "AA" and not s.holding


def test_a_whole_group_waits_for_room_rather_than_being_split() -> None:
    """Three of A, two of B, then C: with room for 2 nothing goes (A waits); room for 4 takes A
    alone (B would be split); then B, then C."""
    s = sched(whole=True)
    fill(s, "b", "AAABBC")
    assert refs(s, 2) == "" and s.holding
    assert refs(s, 4) == "AAA"
    assert refs(s, 1) == "" and s.holding
    assert refs(s, 3) == "BBC"


def test_a_group_begun_larger_than_the_window_or_not_all_read_goes_as_it_fits() -> None:
    """A group the engine already holds part of, one that could never fit the window, and one
    whose end may still be in Redis are admitted as they fit: waiting would not keep them
    whole."""
    s = sched(whole=True, window=3)
    fill(s, "big", "AAAA")  # larger than the window
    assert refs(s, 2) == "AA"
    assert refs(s, 1) == "A"  # begun
    s2 = sched(whole=True)
    lane = fill(s2, "open", "BBB")
    lane.exists = True
    s2.set_remote(lane, True)  # more of B may follow in the lane
    assert refs(s2, 2) == "BB"
    s3 = sched(whole=True)
    fill(s3, "own", "--C")  # requests without a stored prefix are groups of one
    assert refs(s3, 2) == "--"


def test_with_two_tenants_a_group_that_does_not_fit_lets_the_other_tenant_go() -> None:
    """Tenant a's next group does not fit the room; tenant b's single request does."""
    s = sched(whole=True)
    fill(s, "x", "AAA", tenant="a")
    fill(s, "y", "-", tenant="b")
    assert refs(s, 2) == "-" and s.holding


def test_whole_groups_with_more_room_than_stock_in_several_lanes() -> None:
    """Two bursts (lanes) of one tenant and a second tenant, each with fewer entries stocked than
    the room left: every whole group goes, in fair turns (before: the room, larger than a lane's
    stock, was read as entries of it, and the worker died of an IndexError)."""
    s = sched(whole=True, window=64)
    fill(s, "x", "AAB")
    fill(s, "y", "CC")
    fill(s, "z", "DE", tenant="b")
    got = refs(s, 32)
    assert sorted(got) == sorted("AABCCDE") and not s.holding
    assert refs(s, 32) == ""


def test_resident_first_prefers_a_tenant_whose_next_prefix_was_just_admitted() -> None:
    """Two tenants at an equal turn; b's next document was just admitted (resident), a's was
    not: b goes first. Without the setting, the tenants' order decides."""
    for resident, expect in ((False, "PQ"), (True, "QP")):
        s = sched(resident=resident)
        fill(s, "x", "P", tenant="a")
        fill(s, "y", "Q", tenant="b")
        if s.resident is not None:
            ((_, q),) = list(s.lanes["y"].stock)
            s.resident.note(q)
        assert refs(s, 2) == expect


def test_resident_first_keeps_every_tenant_within_one_admission_of_its_share() -> None:
    """Over 300 admissions, with tenant b's requests always on resident prefixes and a's never,
    the two tenants' admissions differ by at most one at any point."""
    s = sched(resident=True)
    fill(s, "x", "".join(chr(ord("a") + i % 20) for i in range(150)), tenant="a")
    fill(s, "y", "Z" * 150, tenant="b")
    seen: Counter[str] = Counter()
    for _ in range(300):
        for _, _e, t in s.pick(1, 0.0):
            seen[t.name] += 1
        assert abs(seen["a"] - seen["b"]) <= 1, seen
