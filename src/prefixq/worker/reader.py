"""The worker's reader: read rounds over the shard's intakes and lanes, and the lane index.

One round (`Reader.round`): ask the scheduler (worker/scheduler.py) what to read for the free
slots, read it in one round trip (`ShardStream.read`), decode what came (worker/intake.py), stock
it under its burst's lane, and admit what the scheduler picks; with nothing to read or pick, block
on the intake streams, where new bursts' heads and lane doorbells arrive. Every `REFRESH_S`
(`Reader.refresh`) the lane index is read: unseen lanes and lanes that may still grow are probed,
drained and sealed ones (or those of ended bursts) closed. A lane is only ever deleted by
lua/close_lane.lua, which checks that it holds no entry at all. docs/architecture.md, "Sharing a
shard" ("A read round", "Costs"), has the design.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Container, Sequence
from typing import TypeVar

from redis.exceptions import ResponseError

from prefixq.core.keys import LANE
from prefixq.core.sharing import LaneInfo, band
from prefixq.store.redis_errors import TRANSIENT
from prefixq.store.retry import repeat
from prefixq.worker.deliveries import Delivery, GroupLost
from prefixq.worker.intake import Intake
from prefixq.worker.lanes import Item, Lane
from prefixq.worker.scheduler import Plan, Scheduler
from prefixq.worker.shard import ShardStream
from prefixq.worker.view import WorkerView

log = logging.getLogger(__name__)
T = TypeVar("T")

#: seconds between two reads of the lane index
REFRESH_S = 1.0
#: ms a round blocks on the intakes when idle (shorter while stock waits for a capped tenant)
BLOCK_MS, CAPPED_BLOCK_MS = 500, 50


class Reader:
    """Reads shard ``stream``'s queues for ``work``; ``ended``: bursts cancelled or expired."""

    def __init__(
        self,
        *,
        stream: ShardStream,
        sched: Scheduler,
        intake: Intake,
        work: WorkerView,
        ended: Container[str],
    ) -> None:
        self.stream, self.sched, self.intake, self.work = stream, sched, intake, work
        self.ended = ended
        #: lanes this worker closed
        self.closed = 0
        #: deliveries read so far (the idle collection stops when it moves: worker/gc_policy.py)
        self.delivered = 0
        #: the last round planned again at once for entries the pick found gated (`round`)
        self._replanned = False
        #: rounds that found nothing to read nor to pick and slept (tests count them)
        self.idle_rounds = 0

    def keys(self) -> list[str]:
        """Every stream of the shard this worker knows: intakes, then lanes."""
        known = (lane.burst for lane in self.sched.by_key.values() if lane.exists)
        return self.stream.keys.streams(self.stream.shard, known)

    # ---- reading -----------------------------------------------------------------------------
    async def run(self) -> None:
        """Rounds until the worker stops."""
        await repeat("reading the shard's queues", self.round, until=lambda: self.work.stopping)

    async def round(self) -> None:
        room = self.work.room()
        if room <= 0:
            await self.work.wait_room()
            return
        plan = self.sched.plan(room)
        got: dict[str, list[Delivery]] = {}
        if plan.reads:
            block = None
            if plan.block:
                block = CAPPED_BLOCK_MS if self.sched.capped_waiting() else BLOCK_MS
            try:
                got = await self.stream.read(plan.reads, block)
            except GroupLost as e:
                got = e.got
                await self.rejoin(e)
        # read-to-engine starts when the read returns, not before a blocked read's idle wait
        t_read = time.perf_counter()
        self.delivered += sum(len(ds) for ds in got.values())
        await self.absorb(plan, got)
        picks = self.sched.pick(room, time.time())
        if picks:
            await self.work.launch(picks, t_read)
        elif self.sched.holding:  # a whole group waits for room (worker/groups.py)
            await self.work.wait_room()
        elif not plan.reads:
            # the stock's next entries wait for their burst's earlier ones (worker/gates.py),
            # which the pick found only now: plan again at once, and it reads on for them (once:
            # a restarted worker's lanes met this at every batch, 50 ms each, 12x slower)
            again = self.sched.waiting and not self._replanned
            self._replanned = bool(again)
            self.idle_rounds += not again
            await asyncio.sleep(0 if again else CAPPED_BLOCK_MS / 1000)  # never spin
            return
        self._replanned = False

    async def absorb(self, plan: Plan, got: dict[str, list[Delivery]]) -> None:
        """Stock what a round read. Drained lanes are marked first, then doorbells read in the same
        round mark theirs again: a lane is never left unread with entries its doorbell announced."""
        sched, holds = self.sched, self.work.holds
        sched.read(plan, {k: len(v) for k, v in got.items()})
        wall = time.time()
        for key, ds in got.items():
            lane = sched.by_key.get(key)
            if lane is not None:  # every entry read tells how far its lane is read
                for d in ds:
                    sched.place(lane, d, wall, from_lane=True)
            fresh = [d for d in ds if not holds(d.ref)]
            if not fresh:
                continue
            if lane is not None:  # a lane's own entries
                sched.stock_many(lane, await self.intake.decode(fresh))
                continue
            now = time.monotonic()  # an intake: heads, doorbells, requeued entries
            for d, e in await self.intake.decode(fresh):
                lane = sched.lane(e.burst, e.priority, e.tenant)
                if LANE in d.fields and not lane.ended:
                    lane.exists, lane.seen = True, now
                    sched.set_remote(lane, True)
                sched.place(lane, d, wall, from_lane=False)
                sched.stock(lane, (d, e))

    async def rejoin(self, err: GroupLost) -> None:
        """A read found a stream or its group gone: create the group again where the stream is
        (an intake always; a lane only if it still exists) and forget lanes that are gone."""
        log.warning("shard %d: %s; joining again", self.stream.shard, err)
        await self.stream.create_groups(self.stream.intakes, mkstream=True)
        lanes = [lane for lane in self.sched.by_key.values() if lane.exists]
        gone = set(await self.stream.create_groups([lane.key for lane in lanes], mkstream=False))
        for lane in lanes:
            if lane.key in gone:
                self.sched.set_remote(lane, False)
                lane.exists = False

    # ---- the lane index ----------------------------------------------------------------------
    async def refresh_loop(self) -> None:
        """`refresh` every `REFRESH_S` (runs as a task)."""
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                await self.refresh()
            except (*TRANSIENT, ResponseError) as e:
                log.warning("reading the lane index failed: %s", e)

    async def refresh(self) -> None:
        """Read the lane index; probe new and growing lanes; close drained ones."""
        sent = time.monotonic()
        closable = self.reconcile(await self.stream.lane_index(), sent)
        if not closable:
            return
        closed = await self.stream.close_lanes(
            [(lane.key, lane.burst, lane.ended and not lane.sealed) for lane in closable]
        )
        for lane, reply in zip(closable, closed, strict=True):
            if reply == 1 and not lane.stock:
                self.sched.drop(lane)
                self.closed += 1
            elif reply == -1:  # entries nobody announced to this worker: read them
                self.sched.set_remote(lane, True)

    async def release(self, unstarted: Sequence[Item] = ()) -> None:
        """Give back what was read but not admitted (`stop()`), and ``unstarted`` (admitted, but
        never in the engine: those waiting for the KV budget), each to the intake of its
        priority with the deliveries it had before, so that any worker reads it at once instead
        of after ``claim_idle_s``, and no delivery is charged for a stop."""
        items = [*self.sched.unstock(), *unstarted]
        if not items:
            return
        intakes = self.stream.intakes
        try:
            await self.stream.release([(d, intakes[band(e.priority)]) for d, e in items])
            log.info("gave back %d entries read but not started", len(items))
        except (*TRANSIENT, ResponseError) as e:  # they stay pending: replayed or reclaimed
            log.warning("could not give back %d entries read but not started: %s", len(items), e)

    def reconcile(self, index: dict[bytes, bytes], sent: float) -> list[Lane]:
        """Bring the lanes up to ``index`` (read after monotonic time ``sent``); returns the
        lanes that may be closed."""
        sched = self.sched
        listed = set()
        for raw_burst, raw in index.items():
            info = LaneInfo.decode(raw)
            if info is None:
                continue
            burst = raw_burst.decode(errors="replace")
            listed.add(burst)
            lane = sched.lane(burst, info.priority, info.tenant)
            new = not lane.exists
            lane.exists, lane.sealed, lane.seen = True, info.sealed, max(lane.seen, sent)
            if new or not info.sealed:
                sched.set_remote(lane, True)
        closable = []
        for lane in list(sched.lanes.values()):
            if lane.burst not in listed and lane.seen < sent:
                sched.set_remote(lane, False)  # closed by another worker, or never made
                lane.exists = False
            if not lane.ended and lane.burst in self.ended:
                sched.end(lane)
            if lane.stock:
                continue
            if lane.exists and lane.ended:
                # asked even while it may grow: an unsealed lane always may (its producer may
                # have died before sealing it), and lua/close_lane.lua decides ("ended": idle
                # long enough, nothing undelivered or pending)
                closable.append(lane)
            elif lane.remote:
                continue
            elif lane.exists and lane.sealed:
                closable.append(lane)
            elif not lane.exists:
                sched.drop(lane)
        return closable
