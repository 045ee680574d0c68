"""Recovery of stuck work: reclaim entries of dead workers, dead-letter poison entries
(`Reclaimer`).

A live worker renews the lease on every entry it holds, so only entries of dead or stuck workers
go idle past ``claim_idle_s``; the reclaimer of any live worker of the shard takes the oldest of
them over with XCLAIM (which counts a delivery), in every stream of the shard, up to
``read_count`` per round whatever its free room, and they are admitted before anything else.
Entries pending on a worker of the shard whose heartbeat key is gone (it died, or stopped) are
taken the same way without waiting ``claim_idle_s`` (`reclaim_gone`, every ``heartbeat_s``): the
test a move of an orphaned shard's queue uses (worker/queued.py), so a replacement that takes a
dead worker's shard (``--join``) serves what it had in flight at once. An entry delivered
``max_attempts`` times goes to the dead-letter stream instead, and its request gets a failed
result. docs/delivery.md, "Stuck work: heartbeats, reclaim, dead letters", has the design.
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import ResponseError

from prefixq.core.settings import Settings
from prefixq.store.liveness import consumers_gone
from prefixq.store.redis_errors import TRANSIENT
from prefixq.store.retry import retry
from prefixq.worker.deliveries import Delivery, Pending, last_allowed
from prefixq.worker.shard import ShardStream
from prefixq.worker.view import WorkerView

log = logging.getLogger(__name__)


def over_limit(deliveries: int, max_attempts: int) -> str:
    """The dead-letter reason of an entry delivered too often."""
    return f"delivered {deliveries} times (max_attempts={max_attempts})"


class Reclaimer:
    """Runs inside a worker (`run`); `dead_letter_over_limit` runs once at start-up."""

    def __init__(self, stream: ShardStream, work: WorkerView, settings: Settings) -> None:
        self.stream = stream
        self.work = work
        self.max_attempts = settings.max_attempts
        self.idle_ms = int(settings.claim_idle_s * 1000)
        self.period = max(settings.claim_idle_s / 2, 0.5)
        #: seconds between two looks for entries of workers whose heartbeat is gone
        self.gone_period = min(settings.heartbeat_s, self.period)
        #: the least idle time of an entry taken from such a worker: its lease was renewed at
        #: every beat while it lived, so this passes at once for a dead worker's entries
        self.gone_idle_ms = int(settings.heartbeat_s * 1000)
        #: most entries taken over per round
        self.batch = settings.read_count
        #: entries this worker took over from others
        self.reclaimed = 0

    async def run(self) -> None:
        idle_due = time.monotonic() + self.period
        while True:
            await asyncio.sleep(self.gone_period)
            try:
                await self.reclaim_gone()
                if time.monotonic() >= idle_due:
                    idle_due = time.monotonic() + self.period
                    await self.reclaim_once()
            except (*TRANSIENT, ResponseError) as e:  # a lost group: the reader rejoins
                log.warning("reclaim failed: %s", e)

    async def reclaim_once(self) -> int:
        """Claim entries idle past ``claim_idle_s``, oldest first; returns how many."""
        rows = await self.stream.pending(
            self.work.queue_keys(), count=self.batch, min_idle_ms=self.idle_ms
        )
        return await self._take(rows, self.idle_ms, "idle")

    async def reclaim_gone(self) -> int:
        """Claim entries pending on other workers of the shard whose heartbeat key is gone
        (store/liveness.py `consumers_gone`: every holder's in one round trip, as a move of an
        orphaned shard tests them), oldest first, without waiting ``claim_idle_s``; returns how
        many. A worker whose beat is there (a slow one) keeps its entries, and so does this
        worker's own name (a restart's backlog, worker/backlog.py). Each entry is claimed only if
        it is still as idle as it was listed: one that another reclaimer took meanwhile (its idle
        time reset) is left to it."""
        stream, work = self.stream, self.work
        if work.stopping:
            return 0
        me = stream.consumer.encode()
        holders = await stream.holders(work.queue_keys())
        others = [c for c in holders if c != me]
        gone = await consumers_gone(stream.r, stream.keys, stream.shard, others)
        rows: list[Pending] = []
        for consumer in (c for c in others if c in gone):
            rows += await stream.pending(
                holders[consumer],
                count=self.batch,
                consumer=consumer,
                min_idle_ms=self.gone_idle_ms,
            )
        return await self._take(rows, None, "gone workers'")

    async def _take(self, rows: list[Pending], min_idle_ms: int | None, what: str) -> int:
        """Dead-letter those of ``rows`` delivered ``max_attempts`` times, claim the others (one
        on its last allowed delivery per round, run alone) idle at least ``min_idle_ms`` (None:
        as idle as the least idle of them was listed) and hand them to the worker."""
        work = self.work
        rows = sorted((p for p in rows if not work.holds(p.ref)), key=_age)
        claim: list[Pending] = []
        last: list[Pending] = []  # entries whose next delivery is their last allowed one
        for p in rows:
            if p.deliveries >= self.max_attempts:
                await self._dead(p)
            elif last_allowed(p.deliveries + 1, self.max_attempts):
                last.append(p)
            elif len(claim) < self.batch:
                claim.append(p)
        if last and not (work.gate.waiting or work.gate.solo):
            # one per round, run alone (worker/solo.py): a poison entry among them takes
            # only itself past the limit
            claim.append(last[0])
        if not claim:
            return 0
        idle = min(p.idle_ms for p in claim) if min_idle_ms is None else min_idle_ms
        got = await self.stream.claim(claim, idle)
        if got:
            log.info("reclaimed %d %s entries on shard %d", len(got), what, self.stream.shard)
            self.reclaimed += len(got)
            await work.take_over(got)
        return len(got)

    async def dead_letter_over_limit(self) -> None:
        """Dead-letter this consumer's pending entries that reached ``max_attempts`` (start-up).

        Redis may be down or have restarted empty since the worker joined: a transient error is
        retried with backoff, and a lost group means nothing is pending (the reader rejoins)."""
        rows = await retry(
            "reading this worker's pending entries",
            lambda: self.stream.pending(
                self.work.queue_keys(), count=10_000, consumer=self.stream.consumer
            ),
        )
        for p in rows:
            if p.deliveries >= self.max_attempts:
                await self._dead(p)

    async def _dead(self, p: Pending) -> None:
        await self.work.dead_letter(
            Delivery(p.key, p.entry_id, p.fields, p.deliveries),
            over_limit(p.deliveries, self.max_attempts),
        )


def _age(p: Pending) -> tuple[int, int]:
    """Sort key: the entry's id (its time of addition), comparable across streams."""
    ms, _, seq = p.entry_id.partition(b"-")
    return int(ms or 0), int(seq or 0)
