"""Idle-time collection does not hold up a burst (worker/gc_policy.py, `GcPolicy.idle`).

The whole-heap collection after a burst is one call CPython cannot interrupt (441 ms on a GPU
worker). The worker collects in steps, with its event loop running between them, and stops once
something was read: a burst that arrives when the idle collection starts is admitted without
waiting for the whole heap. The policy's steps on the real collector, and the real `Worker` loop
over tests/fake_engine.py with a heap big enough that a whole collection takes > 50 ms; delays
are from the end of a burst's submit to the worker's own ``admitted`` timestamps.
"""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from helpers import FakeWorker, requests, wait_burst, wait_until
from prefixq.client import Producer
from prefixq.core.settings import Settings
from prefixq.worker import gc_policy as heap_mod
from prefixq.worker import heartbeat as heartbeat_mod
from prefixq.worker.gc_policy import GcPolicy
from prefixq.worker.gcwatch import GcWatch


class Node:
    """A request-like object in a reference cycle (freed only by the cyclic collector)."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def policy() -> Iterator[GcPolicy]:
    h = GcPolicy(GcWatch(), enabled=True)
    h.freeze()
    try:
        yield h
    finally:
        gc.unfreeze()


def test_an_idle_collection_stops_between_steps_once_work_arrives(
    policy: GcPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a whole-heap collection due, when work is read after the first step, then no
    further step runs (the frozen cycle is still there) and it counts as postponed; the next idle
    moment finishes it."""
    monkeypatch.setattr(GcPolicy, "_grown", lambda self: 0)  # due, grown or not
    monkeypatch.setattr(heap_mod, "WHOLE_HEAP_AFTER", 1)
    node = Node()
    gone = weakref.ref(node)
    policy.admitted(1)
    del node
    checks: list[int] = []

    def quiet() -> bool:
        checks.append(1)
        return len(checks) < 2  # work arrives during the first step

    assert not asyncio.run(policy.idle(1, quiet, idle_s=heap_mod.WHOLE_HEAP_IDLE_S))
    assert len(checks) == 2 and gone() is not None
    assert policy.stats()["gc_idle_postponed"] == 1
    assert asyncio.run(policy.idle(1, lambda: True, idle_s=heap_mod.WHOLE_HEAP_IDLE_S))
    assert gone() is None
    assert policy.stats()["gc_idle_collections"] == 1


def test_gc_unfreeze_during_an_idle_collection_leaves_the_heap_unfrozen(
    policy: GcPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``gc_unfreeze`` (the control stream) runs in the event loop between two steps of an idle
    collection: the steps after it neither run nor freeze the heap again (each step froze what
    it left, so the command answered "unfrozen" while the heap was frozen again)."""
    monkeypatch.setattr(GcPolicy, "_grown", lambda self: 0)  # due, grown or not
    monkeypatch.setattr(heap_mod, "WHOLE_HEAP_AFTER", 1)
    policy.admitted(1)
    gaps: list[int] = []
    real_sleep = asyncio.sleep

    async def gap(s: float) -> None:  # the control command runs in the gap before step two
        gaps.append(1)
        if len(gaps) == 2:
            policy.unfreeze()
        await real_sleep(0)

    monkeypatch.setattr(heap_mod.asyncio, "sleep", gap)
    assert asyncio.run(policy.idle(1, lambda: True, idle_s=heap_mod.WHOLE_HEAP_IDLE_S))
    assert len(gaps) == 2 and not policy.enabled and gc.get_freeze_count() == 0


def test_the_whole_heap_waits_for_a_longer_idle_moment(
    policy: GcPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker idle for less than WHOLE_HEAP_IDLE_S collects only what is not frozen, and says
    the whole heap is still owed; idle long enough, it collects the whole heap."""
    monkeypatch.setattr(GcPolicy, "_grown", lambda self: 0)  # due, grown or not
    monkeypatch.setattr(heap_mod, "WHOLE_HEAP_AFTER", 1)
    node = Node()
    gone = weakref.ref(node)
    policy.admitted(1)
    del node
    short = heap_mod.WHOLE_HEAP_IDLE_S / 2
    assert not asyncio.run(policy.idle(1, lambda: True, idle_s=short))
    assert gone() is not None
    assert asyncio.run(policy.idle(1, lambda: True, idle_s=heap_mod.WHOLE_HEAP_IDLE_S))
    assert gone() is None
    st = policy.stats()
    assert 0 < float(st["gc_idle_max_step_ms"]) <= float(st["gc_idle_max_ms"])


def big_heap(at_least_s: float) -> tuple[list[Any], float]:
    """Container objects enough that one whole collection takes ``at_least_s``; with its time."""
    heap: list[Any] = []
    took = 0.0
    for _ in range(6):
        heap.extend([i] for i in range(max(500_000, len(heap))))
        t0 = time.perf_counter()
        gc.collect()
        took = time.perf_counter() - t0
        if took >= at_least_s:
            return heap, took
    pytest.skip(f"a whole collection of {len(heap)} objects took only {took * 1e3:.0f} ms")


def submit(s: Settings, n: int) -> tuple[str, float]:
    """A burst of ``n`` requests; its id and when its submit returned (all of it in Redis)."""
    burst = Producer(s).submit(requests(n)).id
    return burst, time.time()


def admission_delay(r: redis.Redis, s: Settings, sent: tuple[str, float], n: int) -> float:
    """From the end of the burst's submit to its last request's admission (the worker's own
    ``admitted`` timestamp)."""
    burst, arrived = sent
    return max(x.timings.admitted for x in wait_burst(r, s, burst, 60, n=n)) - arrived


def test_a_burst_arriving_as_the_idle_collection_starts_is_not_held_by_the_whole_heap(
    make_settings: Callable[..., Settings],
    fake_worker: Callable[..., FakeWorker],
    r: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given a worker whose heap takes > 50 ms to collect whole and a whole-heap collection due
    after its first burst, when a second burst reaches Redis just as the idle collection starts,
    then that burst is admitted about as fast as the first (into an idle worker) and much faster
    than a whole collection; the collection is postponed and runs once the worker is idle again
    (before: it ran first, and the burst waited for all of it)."""
    monkeypatch.setattr(GcPolicy, "_grown", lambda self: 0)  # due, grown or not
    monkeypatch.setattr(heap_mod, "WHOLE_HEAP_AFTER", 1)
    monkeypatch.setattr(heap_mod, "WHOLE_HEAP_IDLE_S", 0.0, raising=False)
    monkeypatch.setattr(heartbeat_mod, "IDLE_FREEZE_S", 0.2)
    heap, whole_s = big_heap(0.15)
    s = make_settings(gc_freeze=True, heartbeat_s=0.1)
    second: list[tuple[str, float]] = []
    real = GcPolicy.idle

    def idle(self: GcPolicy, *a: Any, **kw: Any) -> Any:
        if not second:  # the burst reaches Redis as the idle collection starts
            second.append(submit(s, 4))
        return real(self, *a, **kw)

    monkeypatch.setattr(GcPolicy, "idle", idle)
    try:
        fw = fake_worker(s)
        baseline = admission_delay(r, s, submit(s, 4), 4)
        assert fw.worker is not None
        gc_policy = fw.worker.gc_policy
        wait_until(lambda: second, 30, "an idle collection after the first burst")
        delay = admission_delay(r, s, second[0], 4)
        print(
            f"  whole collection {whole_s * 1e3:.0f} ms; admission delay: first burst "
            f"{baseline * 1e3:.1f} ms, burst arriving at the idle collection {delay * 1e3:.1f} ms"
        )
        assert delay - baseline < whole_s / 2, (delay, baseline, whole_s)
        wait_until(lambda: gc_policy.idle_postponed >= 1, 10, "the idle collection postponed")
        # idle again: the whole heap is collected after all
        wait_until(lambda: gc_policy.frozen_requests == 0, 30, "the whole-heap collection")
        assert gc_policy.idle_collections >= 1
        print(f"  idle collections afterwards: {gc_policy.stats()}")
    finally:
        gc.unfreeze()
        del heap


def test_whole_heap_collections_are_spaced_by_the_garbage_they_free(
    policy: GcPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given requests that leave cycles among frozen objects, the next whole-heap collection
    comes after as many requests as leave `GARBAGE_BUDGET` objects, never sooner than
    `WHOLE_HEAP_AFTER`; given requests that leave none, the collection frees nothing and the
    next one waits for the most requests (`WHOLE_HEAP_MAX_AFTER`), freezing going on past
    `FREEZE_BUDGET` meanwhile (before: every `WHOLE_HEAP_AFTER` requests, whatever it freed: a
    670 ms call on a vLLM CPU worker that freed 0 objects); and a whole collection due when the
    heap has not grown by `GARBAGE_BUDGET` blocks since the last is skipped (it could free
    fewer objects than the budget lets wait)."""
    monkeypatch.setattr(heap_mod, "WHOLE_HEAP_AFTER", 10)
    monkeypatch.setattr(heap_mod, "WHOLE_HEAP_MAX_AFTER", 1_000)
    monkeypatch.setattr(heap_mod, "GARBAGE_BUDGET", 10_000)
    monkeypatch.setattr(heap_mod, "GROWTH_SHARE", 0.0)  # the budget alone (the test's heap)
    monkeypatch.setattr(heap_mod, "FREEZE_BUDGET", 20)
    long_idle = heap_mod.WHOLE_HEAP_IDLE_S
    # 20 requests leaving 10,000 nodes in cycles, frozen with them; not yet measured: the whole
    # heap is due after 10 requests, and freezing stops after FREEZE_BUDGET (20 here)
    leak = [Node() for _ in range(10_000)]
    for _ in range(30):
        policy.admitted(1)
    assert policy.frozen_requests == 20 and policy.due_after() == 10
    gone = weakref.ref(leak[0])
    del leak
    assert asyncio.run(policy.idle(30, lambda: True, idle_s=long_idle))
    assert gone() is None and policy.whole_freed >= 10_000, policy.whole_freed
    # >= 500 objects per request: the next after 10,000 / 500 = 20 requests at most
    assert 10 <= policy.due_after() <= 20 and policy.frozen_requests == 0
    # 20 requests that leave nothing and a heap no larger: the whole heap is due and skipped
    freed = policy.whole_freed
    for _ in range(20):
        policy.admitted(1)
    assert asyncio.run(policy.idle(20, lambda: True, idle_s=long_idle))
    assert policy.whole_skipped == 1 and policy.whole_freed == freed
    assert policy.frozen_requests == 0
    # 20 requests that leave nothing, the heap grown by as much (live objects, no garbage): the
    # whole heap is collected and frees only the test process's leftovers
    kept = [Node() for _ in range(10_000)]
    for _ in range(20):
        policy.admitted(1)
    assert asyncio.run(policy.idle(20, lambda: True, idle_s=long_idle))
    assert 0 <= policy.whole_freed < 500, policy.whole_freed
    assert policy.due_after() == 1_000 and policy.frozen_requests == 0
    assert len(kept) == 10_000 and policy.whole_skipped == 1
    for _ in range(50):  # freezing goes on past FREEZE_BUDGET: the budget is the spacing now
        policy.admitted(1)
    assert policy.frozen_requests == 50
    # short of the spacing: young steps only, the whole heap not due
    assert asyncio.run(policy.idle(50, lambda: True, idle_s=long_idle))
    assert policy.frozen_requests == 50
    st = policy.stats()
    assert st["gc_whole_heap_freed"] == policy.whole_freed
    assert st["gc_whole_heap_after"] == policy.due_after() == 1_000


def test_a_whole_collection_waits_until_the_heap_grew_by_a_quarter_of_itself(
    policy: GcPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A due whole-heap collection runs only once the heap grew by `GROWTH_SHARE` of the blocks
    it held after the last one (or the freeze), not by `GARBAGE_BUDGET` alone: on an H200 worker
    the heap grew past the budget (caches filling) and its whole collection held the loop for
    352 ms to free 74 objects. Growth below the share is skipped (the longest idle step stays a
    young one); past it the whole heap is collected and the baseline moves; the stats say why."""
    monkeypatch.setattr(heap_mod, "WHOLE_HEAP_AFTER", 10)
    monkeypatch.setattr(heap_mod, "GARBAGE_BUDGET", 1_000)
    long_idle = heap_mod.WHOLE_HEAP_IDLE_S
    base = policy.blocks_after
    needed = policy.growth_needed()
    assert needed == int(heap_mod.GROWTH_SHARE * base) > 1_000  # the share, not the budget
    # grown well past the budget, short of a quarter of the heap: due, skipped
    kept = [object() for _ in range(needed // 2)]
    for _ in range(10):
        policy.admitted(1)
    assert asyncio.run(policy.idle(10, lambda: True, idle_s=long_idle))
    assert policy.whole_skipped == 1 and policy.whole_freed == -1
    assert 1_000 < policy.blocks_growth < needed and policy.blocks_after == base
    # past a quarter: collected, the baseline moved to the grown heap
    kept += [object() for _ in range(needed)]
    for _ in range(10):
        policy.admitted(1)
    assert asyncio.run(policy.idle(10, lambda: True, idle_s=long_idle))
    assert policy.whole_skipped == 1 and policy.whole_freed >= 0
    assert policy.blocks_growth >= needed and policy.blocks_after >= base + needed
    st = policy.stats()
    assert st["gc_heap_blocks"] == policy.blocks_after
    assert st["gc_heap_growth_needed"] == int(heap_mod.GROWTH_SHARE * policy.blocks_after)
    assert st["gc_heap_growth"] == policy.blocks_growth
    assert len(kept) == needed // 2 + needed


def test_a_prefix_cache_filling_is_not_growth_that_calls_for_the_whole_heap(
    policy: GcPolicy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Token ids the worker's prefix cache took since the baseline (``known``: live ints, never
    in a cycle) do not count as growth: on an H100 worker the reuse burst's 64 documents grew the
    heap by 259,145 blocks, nearly all of them the cached documents' 256,000 token ids. Growth
    past the quarter in other objects still collects the whole heap."""
    monkeypatch.setattr(heap_mod, "WHOLE_HEAP_AFTER", 10)
    monkeypatch.setattr(heap_mod, "GARBAGE_BUDGET", 1_000)
    long_idle = heap_mod.WHOLE_HEAP_IDLE_S
    needed = policy.growth_needed()
    ids: list[int] = []
    policy.known = lambda: len(ids)
    policy.known_after = 0
    ids += [1_000_000 + i for i in range(needed * 2)]  # a cache of token ids, twice the quarter
    for _ in range(10):
        policy.admitted(1)
    assert asyncio.run(policy.idle(10, lambda: True, idle_s=long_idle))
    assert policy.whole_skipped == 1 and policy.whole_freed == -1
    assert policy.blocks_growth < needed and policy.stats()["gc_heap_known"] == needed * 2
    other = [object() for _ in range(needed * 2)]  # live objects the worker does not know of
    for _ in range(10):
        policy.admitted(1)
    assert asyncio.run(policy.idle(10, lambda: True, idle_s=long_idle))
    assert policy.whole_skipped == 1 and policy.whole_freed >= 0
    assert policy.known_after == len(ids)  # the new baseline counts the cache as it is
    assert len(other) == needed * 2


def test_the_prefix_cache_counts_the_token_ids_it_holds(
    make_settings: Callable[..., Settings],
) -> None:
    """`PrefixCache.held_ids`: the token ids of the prefixes it holds, added as they are decoded
    and taken off as the LRU drops them (what the GC policy discounts from the heap's growth)."""
    from prefixq.core import wire
    from prefixq.store.connection import async_client, sync_client
    from prefixq.worker.prefixes import PrefixCache

    s = make_settings()
    r = sync_client(s)
    refs = [f"{k:032x}" for k in range(3)]
    for k, ref in enumerate(refs):
        body = {"prompt_token_ids": list(range(1_000, 1_000 + 100 * (k + 1))), "n": 1}
        r.set(s.keys.prefix(ref), wire.encode(body, s.codec))
    r.set(s.keys.prefix("e" * 32), wire.encode({"prompt": "text, no ids"}, s.codec))
    # ids of CPython's shared small ints (-5 to 256), None and booleans hold no memory of their
    # own: not counted, wherever they are in the list (a sample of it once was fooled)
    odd = [7] * 1_000 + [5_000] * 1_000 + [None, True, -3] * 10 + [0] * 1_000
    odd[::50] = [70_000] * len(odd[::50])
    own = sum(1 for x in odd if type(x) is int and not -5 <= x <= 256)
    r.set(s.keys.prefix("f" * 32), wire.encode({"t": odd}, s.codec))

    class Ref:
        def __init__(self, ref: str) -> None:
            self.prefix_ref = ref

    async def go() -> list[int]:
        ar = async_client(s)
        try:
            cache = PrefixCache(ar, s.keys, wire.Limits.from_settings(s), 2)
            # two resolves at once decode the same prefix: it is held (and counted) once
            await asyncio.gather(*(cache.resolve([Ref(refs[1])]) for _ in range(2)))
            assert len(cache) == 1 and cache.held_ids() == 200
            cache = PrefixCache(ar, s.keys, wire.Limits.from_settings(s), 2)
            held = []
            for ref in [*refs, "e" * 32, "f" * 32]:
                await cache.resolve([Ref(ref)])  # type: ignore[list-item]
                held.append(cache.held_ids())
            return held
        finally:
            await ar.aclose()

    # 100, then 100 + 200, then 200 + 300 (the first dropped), then 300 + 0 (text), then 0 +
    # the ids of the odd list that are objects of their own
    assert asyncio.run(go()) == [100, 300, 500, 300, own]


def test_a_worker_filling_its_prefix_cache_with_documents_does_not_collect_its_heap_whole(
    make_settings: Callable[..., Settings],
    fake_worker: Callable[..., FakeWorker],
    r: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real worker serving a burst over documents of token ids stored once (a reuse corpus)
    grows its heap by the documents' ints, more than a quarter of the heap here; the whole heap
    comes due in idle time and is skipped, because the growth is the prefix cache's (the policy
    reads the worker's `PrefixCache.held_ids`)."""
    from prefixq.core.records import Request

    monkeypatch.setattr(heap_mod, "WHOLE_HEAP_AFTER", 10)
    monkeypatch.setattr(heap_mod, "GARBAGE_BUDGET", 1_000)
    monkeypatch.setattr(heap_mod, "WHOLE_HEAP_IDLE_S", 0.0, raising=False)
    monkeypatch.setattr(heartbeat_mod, "IDLE_FREEZE_S", 0.2)
    s = make_settings(gc_freeze=True, heartbeat_s=0.1, prefix_store_min_chars=64)
    fw = fake_worker(s)
    assert fw.worker is not None
    policy, prefixes = fw.worker.gc_policy, fw.worker.prefixes
    wait_until(lambda: policy.blocks_after > 0, 30, "the worker's freeze after warm-up")
    length = 4_000
    docs = policy.growth_needed() * 2 // length + 1  # two quarters of the heap in ids

    def burst() -> Iterator[Request]:  # made as sent: the test holds no copy of the ids
        for d in range(docs):
            doc = list(range(1_000 + d, 1_000 + d + length))
            for q in range(2):
                yield Request(id=f"{d}-{q}", prompt_token_ids=[500 + q, 501], prefix=doc)

    sent = Producer(s).submit(burst()).id
    wait_burst(r, s, sent, 120, n=docs * 2)
    held = prefixes.held_ids()  # the documents read by reference (a few go inline)
    assert held % length == 0 and held >= 0.8 * docs * length, (held, docs)
    wait_until(lambda: policy.whole_skipped + (policy.whole_freed >= 0) > 0, 30, "the check")
    st = policy.stats()
    print(f"  {docs} documents of {length} ids: {st}")
    assert policy.whole_skipped == 1 and policy.whole_freed == -1, st
    assert st["gc_heap_known"] == held >= st["gc_heap_growth_needed"]
    assert 0 <= st["gc_heap_growth"] < st["gc_heap_growth_needed"]
