"""The worker's garbage-collector policy: what is frozen, and when the heap is collected whole.

CPython's cyclic collector traverses every tracked object of the generations it collects. After
warm-up a worker's heap is large and long-lived (vLLM, torch, the tokenizer: some 600k objects),
so it is collected once and frozen (`gc.freeze`: frozen objects are never traversed again).
Requests in flight add young objects of their own (entries, prompts, vLLM's per-request state);
with hundreds in flight a generation-1 collection traverses all of them: 5.6 ms, measured on the
CPU with 256 requests in flight (docs/BENCHMARKS.md), while the event loop that feeds the engine
waits. So what a batch of admitted requests holds is frozen too, once it has been handed to the
engine: `gc.freeze` moves the generations' lists to the frozen set in O(1).

Objects freed by reference counting leave the frozen set as usual; only reference cycles wait.
Once `WHOLE_HEAP_AFTER` requests were frozen, the next idle moment (nothing in flight for a
second) unfreezes the heap, collects it whole and freezes it again: ~360 ms for a vLLM worker on
the CPU, which no request waits on (a request arriving meanwhile waits at most that long); it is
timed apart from the pauses (`GcWatch.apart`). Other idle moments collect only what is not
frozen. A worker that is never idle stops freezing admissions after `FREEZE_BUDGET` requests,
which bounds what cycles can wait; ordinary collection takes over until it is idle.
"""

from __future__ import annotations

import gc
import logging
import time

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
