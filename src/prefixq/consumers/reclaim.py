"""Recovery of stuck work: reclaim entries idle on dead workers, dead-letter poison entries.

An entry is pending from its delivery until its result is written and it is acked. A live worker
re-claims its in-flight entries on every heartbeat, so only entries of dead or stuck workers go
idle past ``claim_idle_s``; the reclaimer of any live worker of that shard (or `prefixq reclaim`)
takes them over with XCLAIM, which counts a delivery. An entry delivered ``max_attempts`` times
goes to the shard's dead-letter stream with the reason, and its request gets a failed result.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from prefixq import wire
from prefixq.connection import TRANSIENT
from prefixq.entries import Entry
from prefixq.errors import PrefixqError
from prefixq.keys import FIELD, GROUP
from prefixq.records import Result

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
            except TRANSIENT as e:
                log.warning("reclaim failed: %s", e)

    async def reclaim_once(self) -> int:
        """Claim entries idle past ``claim_idle_s`` (room permitting); returns how many."""
        w = self.w
        room = w.max_inflight - len(w.inflight)
        idle_ms = int(w.settings.claim_idle_s * 1000)
        pending = await w.r.xpending_range(
            w.stream, GROUP, min="-", max="+", count=max(room, 0) + 100, idle=idle_ms
        )
        claim: list[bytes] = []
        for p in pending:
            entry_id = p["message_id"]
            if entry_id in w.inflight:
                continue
            if p["times_delivered"] >= w.settings.max_attempts:
                await self.dead_letter_id(entry_id, p["times_delivered"])
            elif len(claim) < room:
                claim.append(entry_id)
        if not claim:
            return 0
        got = await w.r.xclaim(w.stream, GROUP, w.name, idle_ms, claim)
        if got:
            log.info("reclaimed %d idle entries on shard %d", len(got), w.shard)
            w.counts["reclaimed"] += len(got)
            await w.admit(got)
        return len(got)

    async def dead_letter_over_limit(self, consumer: str) -> None:
        """Dead-letter this consumer's pending entries that reached ``max_attempts`` (startup)."""
        w = self.w
        pending = await w.r.xpending_range(
            w.stream, GROUP, min="-", max="+", count=10_000, consumername=consumer
        )
        for p in pending:
            if p["times_delivered"] >= w.settings.max_attempts:
                await self.dead_letter_id(p["message_id"], p["times_delivered"])

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
        record: dict[Any, Any] = {
            "entry": entry_id,
            "shard": w.shard,
            "reason": reason[:2000],
            "delivered": delivered,
            "at": time.time(),
            "worker": w.name,
        }
        data = fields.get(FIELD)
        if data is not None:
            record[FIELD] = data
        entry = _identify(data, w)
        if entry is not None:
            record["burst"], record["index"] = entry.burst, entry.index
        await w.r.xadd(w.keys.dead(w.shard), record, maxlen=100_000, approximate=True)
        if entry is None:
            await w.r.xack(w.stream, GROUP, entry_id)
            await w.r.xdel(w.stream, entry_id)
            return
        res = Result(
            id=entry.id,
            index=entry.index,
            shard=w.shard,
            worker=w.name,
            error=f"dead-lettered: {reason}",
        )
        res.timings.enqueued = entry.enqueued
        res.timings.finished = time.time()
        w.counts["failed"] += 1
        w.writer.put(entry_id, entry, res)  # records the failure, then acks the entry


def _identify(data: bytes | None, w: Worker) -> Entry | None:
    if data is None:
        return None
    try:
        return Entry.from_wire(wire.decode(data, w.limits))
    except PrefixqError:
        return None
