"""Recovery of stuck work: reclaim entries idle on dead workers, dead-letter poison entries
(`Reclaimer`).

A live worker renews the lease on every entry it holds, so only entries of dead or stuck workers
go idle past ``claim_idle_s``; the reclaimer of any live worker of the shard takes the oldest of
them over with XCLAIM (which counts a delivery), in every stream of the shard, up to
``read_count`` per round whatever its free room, and they are admitted before anything else. An
entry delivered ``max_attempts`` times goes to the dead-letter stream instead, and its request
gets a failed result. docs/delivery.md, "Stuck work: heartbeats, reclaim, dead letters", has the
design.
"""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import ResponseError

from prefixq.core.settings import Settings
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
        #: most entries taken over per round
        self.batch = settings.read_count
        #: entries this worker took over from others
        self.reclaimed = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            try:
                await self.reclaim_once()
            except (*TRANSIENT, ResponseError) as e:  # a lost group: the reader rejoins
                log.warning("reclaim failed: %s", e)

    async def reclaim_once(self) -> int:
        """Claim entries idle past ``claim_idle_s``, oldest first; returns how many."""
        work = self.work
        rows = await self.stream.pending(
            work.queue_keys(), count=self.batch, min_idle_ms=self.idle_ms
        )
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
        got = await self.stream.claim(claim, self.idle_ms)
        if got:
            log.info("reclaimed %d idle entries on shard %d", len(got), self.stream.shard)
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
