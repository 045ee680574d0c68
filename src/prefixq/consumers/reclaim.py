"""Recovery of stuck work: reclaim entries idle on dead workers, dead-letter poison entries.

An entry is pending from its delivery until its result is written and it is acked. A live worker
re-claims its in-flight entries on every heartbeat, so only entries of dead or stuck workers go
idle past ``claim_idle_s``; the reclaimer of any live worker of that shard (or `prefixq reclaim`)
takes them over with XCLAIM, which counts a delivery. An entry delivered ``max_attempts`` times
goes to the shard's dead-letter stream with the reason, and its request gets a failed result.
Deliveries are the stream's count plus the ``n`` field of an entry that `prefixq reclaim` moved
(deadletters.py), so the limit holds across such moves.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from redis.exceptions import ResponseError

from prefixq.connection import TRANSIENT, Backoff
from prefixq.consumers.deadletters import carried, dead_letter_record, failed_result
from prefixq.keys import GROUP

if TYPE_CHECKING:
    from prefixq.consumers.worker import Worker

log = logging.getLogger(__name__)


class Reclaimer:
    """Runs inside a worker; `run()` loops, the other methods are called by the worker."""

    def __init__(self, worker: Worker) -> None:
        self.w = worker

    async def run(self) -> None:
        period = max(self.w.settings.claim_idle_s / 2, 0.5)
        while True:
            await asyncio.sleep(period)
            try:
                await self.reclaim_once()
            except (*TRANSIENT, ResponseError) as e:  # NOGROUP after a restart: the reader rejoins
                log.warning("reclaim failed: %s", e)

    async def reclaim_once(self) -> int:
        """Claim entries idle past ``claim_idle_s`` (room permitting); returns how many."""
        w = self.w
        room = w.max_inflight - len(w.inflight)
        idle_ms = int(w.settings.claim_idle_s * 1000)
        pending = await w.r.xpending_range(
            w.stream, GROUP, min="-", max="+", count=max(room, 0) + 100, idle=idle_ms
        )
        pending = [p for p in pending if p["message_id"] not in w.inflight]
        limit = w.settings.max_attempts
        claim: list[bytes] = []
        last: list[bytes] = []  # entries whose next delivery is their last allowed one
        for entry_id, attempts in await self.attempts(pending):
            if attempts >= limit:
                await self.dead_letter_id(entry_id, attempts)
            elif 1 < limit <= attempts + 1:
                last.append(entry_id)
            elif len(claim) < room:
                claim.append(entry_id)
        if last and not (w.gate.waiting or w.gate.solo):
            # one per round, run alone (consumers/solo.py): a poison entry among them takes
            # only itself past the limit
            claim.append(last[0])
        if not claim:
            return 0
        got = await w.r.xclaim(w.stream, GROUP, w.name, idle_ms, claim)
        if got:
            log.info("reclaimed %d idle entries on shard %d", len(got), w.shard)
            w.counts["reclaimed"] += len(got)
            delivered = {p["message_id"]: p["times_delivered"] + 1 for p in pending}
            await w.admit(got, delivered)
        return len(got)

    async def dead_letter_over_limit(self, consumer: str) -> None:
        """Dead-letter this consumer's pending entries that reached ``max_attempts`` (startup).

        Redis may be down or have restarted empty since the worker joined: a transient error is
        retried with backoff, and a missing group means nothing is pending (the reader rejoins).
        """
        w = self.w
        backoff = Backoff()
        while True:
            try:
                pending = await w.r.xpending_range(
                    w.stream, GROUP, min="-", max="+", count=10_000, consumername=consumer
                )
                break
            except TRANSIENT as e:
                await backoff.wait("reading this worker's pending entries", e)
            except ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                return
        for entry_id, attempts in await self.attempts(pending):
            if attempts >= w.settings.max_attempts:
                await self.dead_letter_id(entry_id, attempts)

    async def attempts(self, pending: list[dict[str, Any]]) -> list[tuple[bytes, int]]:
        """(entry id, deliveries so far) for XPENDING rows: the stream's count plus the count an
        entry carried over from a `prefixq reclaim` move (one pipelined XRANGE per entry)."""
        if not pending:
            return []
        pipe = self.w.r.pipeline(transaction=False)
        for p in pending:
            pipe.xrange(self.w.stream, p["message_id"], p["message_id"])
        found = await pipe.execute()
        return [
            (p["message_id"], p["times_delivered"] + carried(f[0][1] if f else None))
            for p, f in zip(pending, found, strict=True)
        ]

    async def dead_letter_id(self, entry_id: bytes, delivered: int) -> None:
        found = await self.w.r.xrange(self.w.stream, entry_id, entry_id)
        fields: dict[bytes, bytes] = found[0][1] if found else {}
        await self.dead_letter(
            entry_id,
            fields,
            f"delivered {delivered} times (max_attempts={self.w.settings.max_attempts})",
            delivered,
        )

    async def dead_letter(
        self, entry_id: bytes, fields: dict[bytes, bytes], reason: str, delivered: int = 1
    ) -> None:
        """Move one entry to the dead-letter stream; fail its request if it can be identified."""
        w = self.w
        w.counts["dead"] += 1
        log.warning("dead letter %s on shard %d: %s", entry_id.decode(), w.shard, reason)
        record, entry = dead_letter_record(
            entry_id, w.shard, fields, reason, delivered, w.name, w.limits
        )
        await w.r.xadd(w.keys.dead(w.shard), record, maxlen=100_000, approximate=True)
        if entry is None:
            await w.r.xack(w.stream, GROUP, entry_id)
            await w.r.xdel(w.stream, entry_id)
            return
        res = failed_result(entry, w.shard, w.name, reason)
        w.counts["failed"] += 1
        # records the failure and acks the entry before returning: queued behind other results,
        # the entry would still be pending when the reader reads its backlog, and run once more
        await w.writer.write_now(entry_id, entry, res)
