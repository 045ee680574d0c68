"""The heartbeat hash's fields: what `prefixq inspect`, `prefixq check` and the dashboard read of
a live worker (worker/heartbeat.py writes them every ``heartbeat_s``)."""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixq.worker.worker import Worker

__all__ = ["health"]


def health(w: Worker, now: float) -> dict[str, Any]:
    """``w``'s heartbeat fields at ``now``: who and where it is, its window and the requests in
    its engine (not those waiting for the KV budget), its pauses and its counters."""
    probes = w.probes
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "gpu": w.gpu or "cpu",
        "shard": w.shard,
        "beat": now,
        "started": w.started,
        "inflight": len(w.inflight) - w.admission.budget.waiting,  # in the engine
        "unwritten": w.writer.backlog,
        "max_inflight": w.max_inflight,
        "engine_up": int(w.serving),
        "stopping": int(w.stopping),
        "gc_max_pause_ms": round(probes.gc.max_pause * 1000, 3),
        "gc_pauses": probes.gc.count,
        "loop_lag_p99_ms": round(probes.loop.lag.quantile(0.99), 3),
        "loop_lag_max_ms": round(probes.loop.lag.max, 3),
        "reclaimed": w.reclaimer.reclaimed,
        **w.counts,
    }
