"""How long the worker's event loop keeps work waiting: loop lag and read-to-engine time.

`LoopWatch.run` sleeps ``every_s`` at a time and records how late each wake-up is (the lag any
callback on the loop — vLLM's output handler, the reader, the writer — waited behind other work).
`Latency` keeps a small log-scale histogram of a duration (here, from the moment a stream read
returned to the moment a request was handed to the engine), cheap enough to call per request.
Both report in milliseconds through the control stream's ``stats`` (worker/control.py).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

#: histogram buckets: 0.01 ms * 2**i
_BASE_MS = 0.01
_BUCKETS = 24


class Latency:
    """Count, mean, max and approximate percentiles of a duration (seconds in, ms out)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.n = 0
        self.total = 0.0
        self.max = 0.0
        self.buckets = [0] * _BUCKETS

    def add(self, seconds: float) -> None:
        ms = seconds * 1e3
        self.n += 1
        self.total += ms
        if ms > self.max:
            self.max = ms
        i = 0 if ms <= _BASE_MS else min(_BUCKETS - 1, 1 + int(math.log2(ms / _BASE_MS)))
        self.buckets[i] += 1

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding the ``q`` quantile (ms)."""
        if not self.n:
            return 0.0
        rank, seen = q * self.n, 0
        for i, c in enumerate(self.buckets):
            seen += c
            if seen >= rank:
                return min(self.max, _BASE_MS * float(2**i))
        return self.max

    def stats(self, name: str) -> dict[str, Any]:
        return {
            f"{name}_n": self.n,
            f"{name}_mean_ms": round(self.total / self.n, 4) if self.n else 0.0,
            f"{name}_p50_ms": round(self.quantile(0.5), 4),
            f"{name}_p99_ms": round(self.quantile(0.99), 4),
            f"{name}_max_ms": round(self.max, 4),
        }


class LoopWatch:
    """Measures event-loop lag while `run` runs (as a task)."""

    def __init__(self, every_s: float = 0.01) -> None:
        self.every_s = every_s
        self.lag = Latency()

    async def run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.every_s)
            self.lag.add(max(0.0, time.perf_counter() - t0 - self.every_s))

    def stats(self) -> dict[str, Any]:
        return self.lag.stats("loop_lag")
