"""A worker's heartbeat: its health key (TTL), its lease on the entries it holds, idle-time GC.

Every ``heartbeat_s``: the health hash (pid, host, GPU, in flight, counters, GC pauses) is
rewritten with a ``heartbeat_ttl_s`` TTL and the worker's score in the shard's worker set is
refreshed (`inspect`, `check`); the lease on the entries the worker holds — read and waiting for a
slot, in flight, or finished with their results not yet acked — is renewed (`ShardStream.renew`),
so no other worker's reclaimer takes them while they are served or written; the requests admitted
since the last beat and their queue waits, per priority and tenant, are added to the shard's
counters (`prefixq inspect`: off the requests' path), and every ``history_every_s`` a sample
goes to the shard's rolling history (worker/history.py). After a burst, once
nothing has been in flight for a second, the heap is collected and frozen again
(worker/gc_policy.py), so objects that survived the burst leave the generations the next burst
collects; in steps, between which the reader runs, and no further once something was read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import ResponseError

from prefixq.core.settings import Settings
from prefixq.store.connection import sync_client
from prefixq.store.liveness import beat_commands, beat_types, repair_types
from prefixq.store.redis_errors import TRANSIENT
from prefixq.worker.deliveries import Ref
from prefixq.worker.gc_policy import GcPolicy
from prefixq.worker.history import History
from prefixq.worker.shard import ShardStream
from prefixq.worker.shared_pass import PassMarks

log = logging.getLogger(__name__)

#: seconds a worker that stopped beating without unregistering (kill -9) stays in its shard's
#: worker set, where `inspect` and the dashboard show it as gone; live workers prune it after
GONE_KEPT_S = 24 * 3600

#: set once a heartbeat of this process's worker went through: its first beat ended the hold a
#: starting worker keeps on its shard (cli/fleet_commands.py), which its exit need not release
BEATEN = threading.Event()

#: the heartbeat hash's fields that tell which process wrote it
_WHO = ("pid", "host", "started")

#: seconds with nothing in flight before the heap is collected and frozen again
IDLE_FREEZE_S = 1.0


class Heartbeat:
    """Runs inside a worker (`run`); the worker calls `request_done()` per finished request."""

    def __init__(
        self,
        stream: ShardStream,
        *,
        every_s: float,
        ttl_s: float,
        health: Callable[[float], dict[str, Any]],
        holding: Callable[[], list[Ref]],
        tallies: Callable[[], list[tuple[str, str, int, float]]] = list,
        busy: Callable[[], bool],
        gc_policy: GcPolicy,
        reads: Callable[[], int] = lambda: 0,
        serving: Callable[[], bool] = lambda: True,
    ) -> None:
        self.stream = stream
        self.every_s = every_s
        #: the health key's TTL in ms, never below the setting (a fractional TTL cut to whole
        #: seconds expired between beats: a live worker read as dead)
        self.ttl_ms = max(1, math.ceil(ttl_s * 1000))
        #: the health hash's fields at a given time (read by inspect and check)
        self.health = health
        self.holding = holding
        #: requests admitted and their queue waits per priority and tenant since the last beat
        self.tallies = tallies
        self._untold: list[tuple[str, str, int, float]] = []
        #: the last other process found beating under this worker's name (`_twin`)
        self._twin_seen: tuple[str, ...] = ()
        self.busy = busy
        #: whether the shard counts as live (store/liveness.py): not while the worker stops
        self.serving = serving
        self.gc_policy = gc_policy
        #: deliveries read so far (an idle collection stops once it moves: work arrived)
        self.reads = reads
        self._served_since_collect = 0
        self._last_done = 0.0
        self.history = History(stream, every_s=stream.settings.history_every_s, now=time.time())
        #: where the worker's pass is (worker/shared_pass.py; the worker runs its publishing)
        key = stream.keys.pass_marks(stream.shard, stream.consumer)
        self.marks = PassMarks(
            key, stream.settings.pass_window, running=stream.settings.pass_running
        )

    def request_done(self) -> None:
        self._served_since_collect += 1
        self._last_done = time.monotonic()

    async def run(self) -> None:
        keys, stream = self.stream.keys, self.stream
        hb = keys.heartbeat(stream.shard, stream.consumer)
        while True:
            try:
                await self.beat(hb)
            except (*TRANSIENT, ResponseError) as e:  # never let the heartbeat task die
                log.warning("heartbeat failed: %s", e)
            await self.collect_when_idle()
            await asyncio.sleep(self.every_s)

    async def beat(self, hb: str) -> None:
        now = time.time()
        health = self.health(now)
        pipe = self.stream.r.pipeline(transaction=False)
        pipe.hmget(hb, _WHO)  # who beat last under this name: this process, or a twin
        pipe.hset(hb, mapping={**health, "every_s": self.every_s})
        pipe.pexpire(hb, self.ttl_ms)
        workers = self.stream.keys.workers(self.stream.shard)
        pipe.zadd(workers, {self.stream.consumer: now})
        # workers killed without unregistering: shown as gone for a while, then forgotten
        pipe.zremrangebyscore(workers, "-inf", now - GONE_KEPT_S)
        if self.serving():
            beat_commands(pipe, self.stream.keys, self.stream.shard, now, self.stream.settings.task)
        try:
            last = (await pipe.execute())[0]
        except ResponseError as e:  # a key of another type, written by something else: replaced
            if "WRONGTYPE" not in str(e):
                raise
            keys = self.stream.keys
            await repair_types(self.stream.r, beat_types(keys, self.stream.shard, hb))
            raise
        BEATEN.set()
        self._twin(last, health)
        await self.stream.renew(self.holding())
        self._untold += self.tallies()
        await self.stream.tally(self._untold)  # kept for the next beat if Redis refused them
        self._untold = []
        await self.history.beat(now, health)

    def _twin(self, last: list[bytes | None], health: dict[str, Any]) -> None:
        """ERROR (once per other process) when the heartbeat hash was last written by another
        process: two workers serve the shard under one name (started at the same moment, so the
        start's check, worker/startup.py `name_free`, saw neither)."""
        if last[0] is None:
            return
        who = tuple(v.decode(errors="replace") if v else "" for v in last)
        if who == tuple(str(health.get(f, "")) for f in _WHO) or who == self._twin_seen:
            return
        self._twin_seen = who
        log.error(
            "another process beats as worker %r on shard %d (pid %s on host %s): two workers "
            "share one name, and each serves the other's pending entries as its own after a "
            "restart; give each its own --name",
            self.stream.consumer,
            self.stream.shard,
            who[0],
            who[1],
        )

    async def collect_when_idle(self) -> None:
        """Collect (worker/gc_policy.py) after a burst, in idle time only, in steps that stop
        when work arrives: no request waits on more than one step."""
        if self.busy() or not self._served_since_collect:
            return
        idle_s = time.monotonic() - self._last_done
        if idle_s < IDLE_FREEZE_S:
            return
        seen = self.reads()

        def quiet() -> bool:
            return not self.busy() and self.reads() == seen

        if await self.gc_policy.idle(self._served_since_collect, quiet, idle_s):
            self._served_since_collect = 0

    async def unregister(self) -> bool:
        """Tell the last tallies, drop the heartbeat and leave the shard's workers; whether Redis
        took it all (it is down, or refused: the heartbeat then expires by its TTL)."""
        stream = self.stream
        with contextlib.suppress(*TRANSIENT, ResponseError):
            await stream.tally(self._untold + self.tallies())
            await stream.r.delete(stream.keys.heartbeat(stream.shard, stream.consumer))
            await stream.r.zrem(stream.keys.workers(stream.shard), stream.consumer)
            return True
        return False


def drop_own(settings: Settings, shard: int, consumer: str, started: float) -> bool:
    """Drop the heartbeat of worker ``consumer`` of ``shard`` and take it off the shard's
    workers, if that heartbeat is still this process's worker's (its pid and host, and its start,
    ``started``; `Heartbeat.unregister` for a stop that could not get to it: the watchdog of one
    that hangs, cli/worker_signals.py); whether it did. Another process's beat under the name (a
    replacement's) is never dropped: checked and dropped in one transaction (WATCH, MULTI; both
    keys in the shard's slot). A fresh blocking client: its caller bounds the wait."""
    keys = settings.keys
    hb = keys.heartbeat(shard, consumer)
    mine = [str(os.getpid()).encode(), socket.gethostname().encode(), repr(started).encode()]

    def drop(pipe: Any) -> bool:
        if pipe.hmget(hb, _WHO) != mine:
            pipe.unwatch()
            return False
        pipe.multi()
        pipe.delete(hb)
        pipe.zrem(keys.workers(shard), consumer)
        return True

    r = sync_client(settings)
    try:
        return bool(r.transaction(drop, hb, value_from_callable=True))
    finally:
        r.close()
