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
heap once `WHOLE_HEAP_AFTER` requests were frozen; a worker never idle stops freezing after
`FREEZE_BUDGET`, so what can wait stays bounded. `admitted` runs at every admission and must stay
O(1); `idle` runs only when nothing is in flight. docs/engine.md, "Garbage collection in the
worker", has the design and the measured pauses.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator

from prefixq.worker.gcwatch import GcWatch

log = logging.getLogger(__name__)

#: requests frozen before an idle moment collects the whole heap
WHOLE_HEAP_AFTER = 1_000
#: requests admitted (and frozen) between whole-heap collections, at most
FREEZE_BUDGET = 20_000


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

    def freeze(self) -> None:
        """Collect, then freeze everything (after warm-up, or when turned on)."""
        self.enabled = True
        gc.collect()
        gc.freeze()
        self.frozen_requests = 0

    def unfreeze(self) -> None:
        """Back to ordinary collection of the whole heap (to measure what freezing avoids)."""
        self.enabled = False
        gc.unfreeze()
        self.frozen_requests = 0

    def admitted(self, n: int) -> None:
        """``n`` requests were just handed to the engine: freeze what they hold (O(1))."""
        if self.enabled and n and self.frozen_requests < FREEZE_BUDGET:
            gc.freeze()
            self.frozen_requests += n

    @contextlib.contextmanager
    def admitting(self, n: int) -> Iterator[None]:
        """Around handing ``n`` requests to the engine (one step of the event loop): no automatic
        collection inside, and what they hold frozen at the end (`admitted`, O(1))."""
        if not (self.enabled and n and self.frozen_requests < FREEZE_BUDGET):
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

    def idle(self, served: int) -> None:
        """Nothing is in flight and ``served`` requests finished since the last call: collect
        what they left, the whole heap once `WHOLE_HEAP_AFTER` requests were frozen."""
        if not self.enabled or not served:
            return
        whole = self.frozen_requests >= WHOLE_HEAP_AFTER
        t0 = time.perf_counter()
        with self.watch.apart():
            if whole:
                gc.unfreeze()
            collected = gc.collect()
            gc.freeze()
        ms = (time.perf_counter() - t0) * 1e3
        self.idle_collections += 1
        self.idle_collected += collected
        self.idle_max_ms = max(self.idle_max_ms, ms)
        log.debug(
            "idle: %s collection freed %d objects after %d requests (%d frozen) in %.1f ms",
            "whole-heap" if whole else "young",
            collected,
            served,
            self.frozen_requests,
            ms,
        )
        if whole:
            self.frozen_requests = 0

    def stats(self) -> dict[str, float | int]:
        return {
            "gc_idle_collections": self.idle_collections,
            "gc_idle_collected": self.idle_collected,
            "gc_idle_max_ms": round(self.idle_max_ms, 3),
        }
