"""Measures garbage-collector pauses through `gc.callbacks` (worst pause, count, an observer)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any


class GcWatch:
    """Times every collection between `start()` and `stop()`.

    ``observer`` (optional) is called with each pause in seconds, inside the GC callback, in
    whichever thread collected: it must be quick, take no lock and never raise (the metrics
    exporter appends to a deque).
    """

    def __init__(self, observer: Callable[[float], None] | None = None) -> None:
        self.observer = observer
        self.max_pause = 0.0
        self.total = 0.0
        self.count = 0
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0:
            pause = time.perf_counter() - self._t0
            self._t0 = 0.0
            self.count += 1
            self.total += pause
            self.max_pause = max(self.max_pause, pause)
            if self.observer is not None:
                self.observer(pause)

    def start(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
