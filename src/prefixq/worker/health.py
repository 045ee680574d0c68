"""The heartbeat hash's fields: what `prefixq inspect`, `prefixq check` and the dashboard read of
a live worker (worker/heartbeat.py writes them every ``heartbeat_s``)."""

from __future__ import annotations

import os
import socket
from collections.abc import Sized
from typing import Any, Protocol

from prefixq.worker.admission import Admission
from prefixq.worker.probes import Probes
from prefixq.worker.reclaim import Reclaimer
from prefixq.worker.writer import ResultWriter

__all__ = ["Healthy", "health"]


class Healthy(Protocol):
    """What the fields are read from (`prefixq.worker.worker.Worker`)."""

    gpu: str | None
    shard: int
    started: float
    max_inflight: int
    counts: dict[str, int]
    probes: Probes
    admission: Admission
    writer: ResultWriter
    reclaimer: Reclaimer

    @property
    def inflight(self) -> Sized: ...

    @property
    def serving(self) -> bool: ...

    @property
    def stopping(self) -> bool: ...


def health(w: Healthy, now: float) -> dict[str, Any]:
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
