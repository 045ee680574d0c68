"""The worker's garbage-collector policy: what is frozen, and when the heap is collected whole
(`GcPolicy`).

After warm-up the heap is frozen (`gc.freeze`), and so is what each batch of admitted requests
holds once it has been handed to the engine (`GcPolicy.admitting`), so that collections of the
young generations stop traversing hundreds of requests in flight while the event loop waits.
While a batch is being handed over, no collection runs at all: what its requests build then
(token-id lists of thousands of items each, requests, the engine's own records) lives as long as
they do, and a collection in the middle of a batch would traverse all of it, and move it into the
older generations, whose next collection traverses it again (a single generation-1 collection of
7 ms on a reuse burst). The pause lasts one step of the event loop.
Cycles among frozen objects wait for an idle moment (`GcPolicy.idle`), which collects the whole
heap once enough requests were frozen: `WHOLE_HEAP_AFTER` at first, then as many as leave
`GARBAGE_BUDGET` objects of cyclic garbage at the rate the last whole collection found, up to
`WHOLE_HEAP_MAX_AFTER` (a vLLM worker's requests leave none: its whole collections, 670 ms on
the CPU, freed 0 objects, so they are now 50 times rarer); one that comes due is skipped unless
the heap has grown since the last by `GARBAGE_BUDGET` memory blocks and by `GROWTH_SHARE` of
what it held then (`_grown`: a heap that has not cannot hold more garbage than that, and the
whole collection's cost, proportional to the heap, stays proportional to the growth it follows,
as with CPython's own rule for full collections, which freezing takes out of play: on an H200
worker the whole heap took 352 ms and freed 74 objects), not counting the token ids the worker's
prefix cache took meanwhile (``known``: live ints, never in a cycle; on that worker they were
nearly all of the growth). A worker never idle stops freezing
after that many (at least `FREEZE_BUDGET`), so what can wait stays bounded. `admitted`
runs at every admission and must stay O(1); `idle` runs only when nothing is in flight.

An idle collection must not hold up a burst that arrives meanwhile, so it runs in steps with the
event loop running between them (`STEP_GAP_S`): generation 0, generation 1, what is not frozen
(generation 2 without unfreezing), and, when due, the whole heap. Before each step it asks
``quiet`` (nothing in flight, nothing read since it began) and, if work arrived, stops there and
tries again at the next idle moment (``postponed``). The whole heap is one call CPython cannot
interrupt (hundreds of ms on a GPU worker), so it also waits until the worker has been idle for
`WHOLE_HEAP_IDLE_S`: a burst that reaches Redis during that one call still waits for it, and its
length is reported (``gc_idle_max_step_ms``, the longest step that held the loop).
docs/engine.md, "Garbage collection in the worker", has the design and the measured pauses.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sys
import time
from collections.abc import Callable, Iterator

from prefixq.worker.gcwatch import GcWatch

log = logging.getLogger(__name__)

#: requests frozen before an idle moment collects the whole heap, at first (and at least)
WHOLE_HEAP_AFTER = 1_000
#: ... and at most, whatever the last whole collection found (the workload may change)
WHOLE_HEAP_MAX_AFTER = 50_000
#: objects of cyclic garbage that may wait in the frozen heap, at the rate last measured
GARBAGE_BUDGET = 100_000
#: and the share of the heap's memory blocks it must have grown by for a whole collection (a
#: quarter: CPython's own bound for a full collection, `long_lived_pending > long_lived_total / 4`
#: in Modules/gcmodule.c, which keeps the cost of full collections linear in the allocations)
GROWTH_SHARE = 0.25
#: requests admitted (and frozen) between whole-heap collections, at least
FREEZE_BUDGET = 20_000
#: seconds the event loop runs between two steps of an idle collection (it reads what arrived)
STEP_GAP_S = 0.002
#: seconds with nothing in flight before the whole heap is collected (one uninterruptible call)
WHOLE_HEAP_IDLE_S = 3.0


class GcPolicy:
    """One per worker. ``enabled`` is the ``gc_freeze`` setting (the control stream toggles it)."""

    def __init__(self, watch: GcWatch, *, enabled: bool) -> None:
        self.watch = watch
        self.enabled = enabled
        #: requests whose objects were frozen since the last whole-heap collection
        self.frozen_requests = 0
        self.idle_collections = 0
        self.idle_collected = 0
        self.idle_max_ms = 0.0
        #: the longest single step of an idle collection: what a burst arriving in it waits
        self.idle_max_step_ms = 0.0
        #: idle collections stopped between steps because work arrived
        self.idle_postponed = 0
        #: the young steps ran since the last admission (only the whole heap may be left)
        self._young_done = False
        #: requests between whole-heap collections, from the garbage the last one freed (0:
        #: none measured yet, `WHOLE_HEAP_AFTER`)
        self.whole_after = 0
        #: objects the last whole-heap collection freed (cycles among frozen objects)
        self.whole_freed = -1
        #: objects frozen after the last `freeze` or whole-heap collection (-1: none yet), counted
        #: then: `gc.get_freeze_count` walks the frozen list (20 ms for 3 million objects), too
        #: long for a ``stats`` call in the middle of a burst
        self.frozen_objects = -1
        #: memory blocks allocated after the last freeze or whole collection (`_grown`)
        self.blocks_after = 0
        #: whole collections due and skipped: the heap had not grown (`_grown`)
        self.whole_skipped = 0
        #: the growth `_grown` found the last time it ran (-1: not yet)
        self.blocks_growth = -1
        #: memory blocks the worker knows it holds in live data that cannot form cycles (its
        #: prefix cache's token ids: worker/prefixes.py), discounted from the growth; and their
        #: count when ``blocks_after`` was taken
        self.known: Callable[[], int] = lambda: 0
        self.known_after = 0

    def due_after(self) -> int:
        """Requests frozen before the whole heap is collected (at the next long idle moment)."""
        return max(WHOLE_HEAP_AFTER, self.whole_after)

    def _freezing(self, n: int) -> bool:
        budget = max(FREEZE_BUDGET, self.due_after())
        return self.enabled and bool(n) and self.frozen_requests < budget

    def freeze(self) -> None:
        """Collect, then freeze everything (after warm-up, or when turned on)."""
        self.enabled = True
        gc.collect()
        gc.freeze()
        self.frozen_requests = 0
        self.frozen_objects = gc.get_freeze_count()
        self._baseline()

    def _baseline(self) -> None:
        self.blocks_after, self.known_after = sys.getallocatedblocks(), self.known()

    def unfreeze(self) -> None:
        """Back to ordinary collection of the whole heap (to measure what freezing avoids)."""
        self.enabled = False
        gc.unfreeze()
        self.frozen_requests = 0
        self.frozen_objects = 0

    def admitted(self, n: int) -> None:
        """``n`` requests were just handed to the engine: freeze what they hold (O(1))."""
        self._young_done = False
        if self._freezing(n):
            gc.freeze()
            self.frozen_requests += n

    @contextlib.contextmanager
    def admitting(self, n: int) -> Iterator[None]:
        """Around handing ``n`` requests to the engine (one step of the event loop): no automatic
        collection inside, and what they hold frozen at the end (`admitted`, O(1))."""
        self._young_done = False
        if not self._freezing(n):
            yield
            return
        was = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            self.admitted(n)
            if was:
                gc.enable()

    async def idle(self, served: int, quiet: Callable[[], bool], idle_s: float) -> bool:
        """Nothing has been in flight for ``idle_s`` seconds and ``served`` requests finished
        since the last complete call: collect what they left, step by step while ``quiet()``
        holds, and the whole heap once `due_after` requests were frozen and the worker has been
        idle for `WHOLE_HEAP_IDLE_S`. Whether nothing is left for a later idle moment
        (False: work arrived between two steps, or the whole heap waits for a longer idle)."""
        if not self.enabled or not served:
            return True
        due = self.frozen_requests >= self.due_after()
        whole = due and idle_s >= WHOLE_HEAP_IDLE_S
        steps: list[Callable[[], int]] = []
        if not self._young_done:
            steps += [
                lambda: gc.collect(0),
                lambda: gc.collect(1),
                lambda: gc.collect(2),  # what is not frozen: no more than the young steps
            ]
        if whole:
            steps += [self._grown, self._whole]
        collected, spent, freed, skipped = 0, 0.0, 0, False
        for step in steps:
            await asyncio.sleep(STEP_GAP_S)  # the loop runs: a burst that arrived is read
            if not self.enabled:  # turned off meanwhile (``gc_unfreeze``): freeze nothing again
                return True
            if not quiet():
                self.idle_postponed += 1
                log.debug("idle collection stopped: work arrived (%.1f ms spent)", spent)
                return False
            t0 = time.perf_counter()
            with self.watch.apart():
                freed = step()
                gc.freeze()
            ms = (time.perf_counter() - t0) * 1e3
            spent += ms
            self.idle_max_step_ms = max(self.idle_max_step_ms, ms)
            if freed < 0:  # `_grown`: the heap has not grown; no whole collection this time
                self._unchanged()
                whole, skipped = False, True
                break
            collected += freed
        self._young_done = True
        if steps:
            self.idle_collections += 1
            self.idle_collected += collected
            self.idle_max_ms = max(self.idle_max_ms, spent)
            log.debug(
                "idle: %s collection freed %d objects after %d requests (%d frozen) in %.1f ms",
                "whole-heap" if whole else "young (the heap had not grown)" if skipped else "young",
                collected,
                served,
                self.frozen_requests,
                spent,
            )
        if whole:  # `freed`: the last step's, the whole heap's
            self._measured(freed)
            self.frozen_objects = gc.get_freeze_count()  # beside hundreds of ms, a few more
            log.debug(
                "idle: the whole heap held %d objects of frozen garbage; next after %d requests",
                freed,
                self.whole_after,
            )
        return whole or skipped or not due

    def _grown(self) -> int:
        """A step before the whole heap: -1 (skip it) when the heap has grown since the last
        whole collection (or the freeze after warm-up) by fewer memory blocks than
        `growth_needed`, not counting what ``known`` says the worker added in live data that
        cannot form cycles (its prefix cache filling), else 0. Cycles among frozen objects hold
        memory blocks, so a heap that has not grown that much holds less such garbage than
        that, and a whole collection (hundreds of ms on a GPU worker, proportional to the heap)
        is worth its pause only after the heap grew by a share of itself
        (`sys.getallocatedblocks`: one walk of the allocator's pools, ~1 ms per 5 million
        blocks)."""
        known = self.known() - self.known_after  # a cache filling: live, acyclic
        self.blocks_growth = sys.getallocatedblocks() - self.blocks_after - known
        return 0 if self.blocks_growth >= self.growth_needed() else -1

    def growth_needed(self) -> int:
        """Memory blocks the heap must have grown by for a whole collection that is due."""
        return max(GARBAGE_BUDGET, int(GROWTH_SHARE * self.blocks_after))

    def _unchanged(self) -> None:
        """The whole heap was due and `_grown` found the heap no larger: counted as collected
        (freezing goes on for another spacing), the blocks' baseline kept."""
        self.whole_skipped += 1
        self.frozen_requests = 0

    def _measured(self, freed: int) -> None:
        """The whole heap was collected, freeing ``freed`` objects left by `frozen_requests`
        requests: space the next one so that about `GARBAGE_BUDGET` objects wait for it."""
        per_request = freed / max(1, self.frozen_requests)
        spacing = GARBAGE_BUDGET / per_request if per_request else WHOLE_HEAP_MAX_AFTER
        self.whole_after = int(min(WHOLE_HEAP_MAX_AFTER, max(WHOLE_HEAP_AFTER, spacing)))
        self.whole_freed = freed
        self.frozen_requests = 0
        self._baseline()

    @staticmethod
    def _whole() -> int:
        """The whole heap, frozen part included: one call CPython cannot interrupt."""
        gc.unfreeze()
        return gc.collect()

    def stats(self) -> dict[str, float | int]:
        return {
            "gc_idle_collections": self.idle_collections,
            "gc_idle_collected": self.idle_collected,
            "gc_idle_max_ms": round(self.idle_max_ms, 3),
            "gc_idle_max_step_ms": round(self.idle_max_step_ms, 3),
            "gc_idle_postponed": self.idle_postponed,
            "gc_whole_heap_after": self.due_after(),
            "gc_whole_heap_freed": self.whole_freed,
            "gc_whole_heap_skipped": self.whole_skipped,
            # why a due whole collection ran or not: the heap's blocks after the last one (or
            # the freeze), the growth needed and the growth last found (-1: never checked)
            "gc_heap_blocks": self.blocks_after,
            "gc_heap_growth_needed": self.growth_needed(),
            "gc_heap_growth": self.blocks_growth,
            "gc_heap_known": self.known(),
            "frozen": self.frozen_objects,
        }
