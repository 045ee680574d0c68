"""What one `WorkerMetrics.observe` costs (it runs on the worker's event loop once per request).

A micro-benchmark, not a test (speed is measured, never asserted): prints the best of a few
rounds, in microseconds per call.
    python scripts/observe_cost.py [CALLS]
"""

from __future__ import annotations

import sys
import time

from prefixq.core.records import Result
from prefixq.integrations.worker_metrics import WorkerMetrics

ROUNDS = 5


def per_call(calls: int) -> float:
    """Seconds per `observe` of a finished request, best of ROUNDS runs of ``calls`` calls."""
    m = WorkerMetrics(0, "bench", lambda now: {})
    res = Result(id="x", index=0, prompt_tokens=100, cached_tokens=64, output_tokens=16)
    t = res.timings
    t.enqueued, t.admitted, t.first_token, t.finished = 1.0, 1.2, 1.25, 2.0
    best = float("inf")
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(calls):
            m.observe(res)
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    print(f"observe: {per_call(calls) * 1e6:.2f} us per call (best of {ROUNDS} x {calls})")


if __name__ == "__main__":
    main()
