"""A worker's heartbeat: its health key (TTL), its in-flight lease, and idle-time heap freezing.

Every ``heartbeat_s``: the health hash (pid, host, GPU, in flight, counters, GC pauses) is
rewritten with a ``heartbeat_ttl_s`` TTL and the worker's score in the shard's worker set is
refreshed (`inspect`, `check`); the in-flight entries are re-claimed (XCLAIM JUSTID, which resets
their idle time without counting a delivery) so no other worker's reclaimer takes them while they
are served. After a burst, once nothing has been in flight for a second, the heap is collected and
frozen again, so objects that survived the burst leave the generations the next burst collects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Any

from redis.exceptions import ResponseError

from prefixq.connection import TRANSIENT
from prefixq.keys import GROUP

if TYPE_CHECKING:
    from prefixq.consumers.worker import Worker

log = logging.getLogger(__name__)

#: seconds with nothing in flight before the heap is frozen again
IDLE_FREEZE_S = 1.0


class Heartbeat:
    """Runs inside a worker (`run()`); the worker calls `request_done()` per finished request."""

    def __init__(self, worker: Worker) -> None:
        self.w = worker
        self._served_since_collect = 0
        self._last_done = 0.0

    def request_done(self) -> None:
        self._served_since_collect += 1
        self._last_done = time.monotonic()

    async def run(self) -> None:
        w = self.w
        hb = w.keys.heartbeat(w.shard, w.name)
        while True:
            try:
                now = time.time()
                pipe = w.r.pipeline(transaction=False)
                pipe.hset(hb, mapping=self.health(now))
                pipe.expire(hb, max(1, int(w.settings.heartbeat_ttl_s)))
                pipe.zadd(w.keys.workers(w.shard), {w.name: now})
                ids = list(w.inflight)
                if ids:  # keep our in-flight entries from looking idle to other reclaimers
                    pipe.xclaim(w.stream, GROUP, w.name, 0, ids, justid=True)
                await pipe.execute()
            except (*TRANSIENT, ResponseError) as e:  # never let the heartbeat task die
                log.warning("heartbeat failed: %s", e)
            self.collect_when_idle()
            await asyncio.sleep(w.settings.heartbeat_s)

    def collect_when_idle(self) -> None:
        """Collect (consumers/heap.py) after a burst, in idle time only: no request waits on it."""
        if self.w.inflight or not self._served_since_collect:
            return
        if time.monotonic() - self._last_done < IDLE_FREEZE_S:
            return
        self.w.heap.idle(self._served_since_collect)
        self._served_since_collect = 0

    def health(self, now: float) -> dict[str, Any]:
        """What the health key holds (read by inspect and check)."""
        w = self.w
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "gpu": w.gpu or "cpu",
            "shard": w.shard,
            "beat": now,
            "started": w.started,
            "inflight": len(w.inflight),
            "max_inflight": w.max_inflight,
            "engine_up": int(w.serving),
            "stopping": int(w.stopping),
            "gc_max_pause_ms": round(w.gc.max_pause * 1000, 3),
            "gc_pauses": w.gc.count,
            **w.counts,
        }

    async def unregister(self) -> None:
        w = self.w
        with contextlib.suppress(*TRANSIENT):
            await w.r.delete(w.keys.heartbeat(w.shard, w.name))
            await w.r.zrem(w.keys.workers(w.shard), w.name)
