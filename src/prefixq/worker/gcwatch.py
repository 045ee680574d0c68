"""Measures garbage-collector pauses through `gc.callbacks` (worst pause, count, an observer)."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from typing import Any


class GcWatch:
    """Times every collection between `start()` and `stop()`.

    Besides the worst pause overall it keeps, per generation, the worst pause and the number of
    collections: a long pause in generation 0 or 1 means many young container objects (requests
    in flight), one in generation 2 a large unfrozen heap. Pauses are wall time; the worst one
    in the collecting thread's CPU time is kept too (``max_pause_cpu``): on a shared machine a
    collection preempted midway is a long pause but not a long collection.

    ``observer`` (optional) is called with each pause in seconds, inside the GC callback, in
    whichever thread collected: it must be quick, take no lock and never raise (the metrics
    exporter appends to a deque).
    """

    def __init__(self, observer: Callable[[float], None] | None = None) -> None:
        self.observer = observer
        self._t0 = 0.0
        self._cpu0 = 0.0
        self._apart = False
        self.reset()

    def reset(self) -> None:
        self.max_pause = 0.0
        self.max_pause_cpu = 0.0
        self.total = 0.0
        self.count = 0
        self.max_by_gen = [0.0, 0.0, 0.0]
        self.count_by_gen = [0, 0, 0]

    @contextlib.contextmanager
    def apart(self) -> Iterator[None]:
        """Collections inside are not pauses (the worker collects in idle time;
        worker/gc_policy.py times those itself)."""
        self._apart = True
        try:
            yield
        finally:
            self._apart = False

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if self._apart:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
            self._cpu0 = time.thread_time()
        elif self._t0:
            pause = time.perf_counter() - self._t0
            self.max_pause_cpu = max(self.max_pause_cpu, time.thread_time() - self._cpu0)
            self._t0 = 0.0
            self.count += 1
            self.total += pause
            self.max_pause = max(self.max_pause, pause)
            g = info.get("generation", 2)
            self.count_by_gen[g] += 1
            self.max_by_gen[g] = max(self.max_by_gen[g], pause)
            if self.observer is not None:
                self.observer(pause)

    def stats(self) -> dict[str, Any]:
        """The figures as reported by the control stream's ``stats`` and the heartbeat (ms)."""
        return {
            "gc_max_pause_ms": round(self.max_pause * 1e3, 3),
            "gc_max_pause_cpu_ms": round(self.max_pause_cpu * 1e3, 3),
            "gc_pauses": self.count,
            "gc_max_pause_ms_by_gen": [round(p * 1e3, 3) for p in self.max_by_gen],
            "gc_pauses_by_gen": list(self.count_by_gen),
        }

    def start(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
