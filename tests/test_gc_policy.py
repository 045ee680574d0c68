"""The worker's GC policy (worker/gc_policy.py) on the real collector: admitted requests' objects
are frozen, their reference cycles wait for idle time and are collected then, idle collections
are not counted as pauses, and freezing stops at the budget."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Callable, Iterator

import pytest

from prefixq.worker import gc_policy as heap_mod
from prefixq.worker.gc_policy import GcPolicy
from prefixq.worker.gcwatch import GcWatch


class Node:
    """A request-like object in a reference cycle (freed only by the cyclic collector)."""

    def __init__(self) -> None:
        self.me = self
        self.payload = list(range(100))


@pytest.fixture
def policy() -> Iterator[tuple[GcPolicy, GcWatch]]:
    watch = GcWatch()
    watch.start()
    h = GcPolicy(watch, enabled=True)
    h.freeze()
    try:
        yield h, watch
    finally:
        watch.stop()
        gc.unfreeze()


def idle(h: GcPolicy, served: int, quiet: Callable[[], bool] = lambda: True) -> bool:
    """One idle moment, long enough for the whole heap."""
    return asyncio.run(h.idle(served, quiet, idle_s=heap_mod.WHOLE_HEAP_IDLE_S))


def young(obj: object) -> bool:
    return any(o is obj for g in range(3) for o in gc.get_objects(generation=g))


def test_admitted_objects_are_frozen_and_their_cycles_wait_for_idle(
    policy: tuple[GcPolicy, GcWatch], monkeypatch: pytest.MonkeyPatch
) -> None:
    h, watch = policy
    monkeypatch.setattr(GcPolicy, "_grown", lambda self: 0)  # due, grown or not
    monkeypatch.setattr(heap_mod, "WHOLE_HEAP_AFTER", 2)
    node = Node()
    gone = weakref.ref(node)
    assert young(node)
    h.admitted(1)
    assert not young(node)  # frozen: no collection traverses it
    del node
    gc.collect()
    assert gone() is not None  # garbage, but frozen: it waits
    watch.reset()
    idle(h, 1)
    assert gone() is not None  # one frozen request: an idle moment collects only the young
    h.admitted(1)
    idle(h, 1)
    assert gone() is None  # two: the whole heap, in idle time
    assert h.stats()["gc_idle_collections"] == 2
    assert int(h.stats()["gc_idle_collected"]) >= 1
    assert watch.count == 0  # an idle collection is not a pause
    gc.collect()
    assert watch.count == 1  # an ordinary collection is


def test_freezing_stops_at_the_budget_until_idle(
    policy: tuple[GcPolicy, GcWatch], monkeypatch: pytest.MonkeyPatch
) -> None:
    h, _ = policy
    monkeypatch.setattr(heap_mod, "FREEZE_BUDGET", 3)
    monkeypatch.setattr(heap_mod, "WHOLE_HEAP_AFTER", 1)  # the budget: max(3, 2 x 1)
    h.admitted(3)
    late = Node()
    h.admitted(1)
    assert young(late)  # over the budget: ordinary collection takes it
    idle(h, 4)
    early = Node()
    h.admitted(1)
    assert not young(early)  # the budget starts again after an idle collection


def test_turned_off_nothing_is_frozen_or_collected_in_idle(
    policy: tuple[GcPolicy, GcWatch],
) -> None:
    h, _ = policy
    h.unfreeze()
    assert gc.get_freeze_count() == 0
    node = Node()
    h.admitted(1)
    assert young(node)
    idle(h, 1)
    assert h.stats()["gc_idle_collections"] == 0


def test_no_collection_traverses_a_batch_while_it_is_handed_over(
    policy: tuple[GcPolicy, GcWatch],
) -> None:
    """Given a batch whose requests build many container objects (enough to trigger many young
    collections), when it is handed over inside `admitting`, then no collection runs meanwhile,
    what it built is frozen at the end, and automatic collection is on again."""
    h, watch = policy
    threshold = gc.get_threshold()[0]
    watch.reset()
    with h.admitting(64):
        batch = [[list(range(100)) for _ in range(16)] for _ in range(8 * threshold // 16)]
        inside = watch.count
    assert inside == 0, f"{inside} collections ran while the batch was handed over"
    assert gc.isenabled()
    assert not young(batch) and not young(batch[-1][-1])  # frozen
    more = [[n] for n in range(4 * threshold)]  # ordinary allocation collects again
    assert watch.count > 0, f"no collection after {len(more)} new containers"


def test_turned_off_a_batch_is_collected_as_usual(policy: tuple[GcPolicy, GcWatch]) -> None:
    h, watch = policy
    h.unfreeze()
    threshold = gc.get_threshold()[0]
    watch.reset()
    with h.admitting(64):
        batch = [[n] for n in range(4 * threshold)]
    assert watch.count > 0, f"no collection while {len(batch)} containers were built"
    assert young(batch)


def test_stats_do_not_walk_the_frozen_heap(
    policy: tuple[GcPolicy, GcWatch], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a frozen heap, when the control stream asks for ``stats`` in the middle of a burst,
    then the frozen objects are not counted then (`gc.get_freeze_count` walks the whole list: 20
    ms for 3 million objects, a pause of the event loop) but reported as counted at the last
    freeze or whole-heap collection, in idle time."""
    from prefixq.worker.probes import Probes

    h, _ = policy
    h.freeze()
    at_freeze = h.stats()["frozen"]
    assert at_freeze > 1000  # the test process's heap, counted at the freeze
    monkeypatch.setattr(GcPolicy, "_grown", lambda self: 0)  # due, grown or not
    monkeypatch.setattr(heap_mod, "WHOLE_HEAP_AFTER", 1)
    walks: list[int] = []
    real = gc.get_freeze_count

    def counted() -> int:
        walks.append(1)
        return real()

    monkeypatch.setattr(gc, "get_freeze_count", counted)
    probes = Probes(gc_freeze=True)
    probes.gc_policy = h
    h.admitted(1)
    assert probes.stats()["frozen"] == at_freeze and not walks  # mid-burst: no walk
    idle(h, 1)  # the whole heap, in idle time: counted there, once
    frozen = probes.stats()["frozen"]
    assert len(walks) == 1 and abs(frozen - real()) < 100 and frozen > 1000
    h.unfreeze()
    assert probes.stats()["frozen"] == 0


def test_the_worst_pause_is_kept_in_cpu_time_too() -> None:
    """A collection's pause is timed in wall time and in the collecting thread's CPU time, which
    a preemption midway does not lengthen: never longer than the wall time."""
    watch = GcWatch()
    watch.start()
    try:
        keep = [[n] for n in range(50_000)]
        gc.collect()
    finally:
        watch.stop()
    st = watch.stats()
    assert 0 < watch.max_pause_cpu <= watch.max_pause + 1e-4, (watch.max_pause_cpu, st, len(keep))
    assert st["gc_max_pause_cpu_ms"] == round(watch.max_pause_cpu * 1e3, 3)
