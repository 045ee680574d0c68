"""Entries in, requests out: what a worker does with a delivery before its engine sees it.

`Intake.decode` decodes each delivered entry (bounded: core/wire.py), dead-letters what cannot run
(no payload, undecodable), gives the requests of cancelled or expired bursts their ended result
without running them (worker/ends.py), and acks entries already deleted (their result is
recorded). The worker resolves the stored prefixes the rest refer to (worker/prefixes.py, one MGET
per read round) and launches them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import ResponseError

from prefixq.core import wire
from prefixq.core.entries import Entry
from prefixq.core.errors import PrefixqError
from prefixq.core.keys import CARRIED, FIELD
from prefixq.core.result_record import ENDED_ERRORS
from prefixq.store.dead_letters import dead_lettered_result
from prefixq.store.redis_errors import TRANSIENT
from prefixq.worker.deliveries import Delivery, Ref
from prefixq.worker.ends import BurstEnds
from prefixq.worker.prefixes import PrefixCache
from prefixq.worker.reclaim import over_limit
from prefixq.worker.shard import ShardStream
from prefixq.worker.writer import ResultWriter

log = logging.getLogger(__name__)

#: `Worker._retry`: retry a Redis call until it is taken
Retry = Callable[[str, Callable[[], Awaitable[Any]]], Awaitable[None]]


class Intake:
    """One worker's intake; ``counts`` are the worker's counters (``dead``, ``failed``)."""

    def __init__(
        self,
        *,
        stream: ShardStream,
        writer: ResultWriter,
        ends: BurstEnds,
        prefixes: PrefixCache,
        counts: dict[str, int],
        retry: Retry,
    ) -> None:
        self.stream, self.writer, self.ends, self.prefixes = stream, writer, ends, prefixes
        self.counts, self.retry = counts, retry

    async def decode(self, deliveries: list[Delivery]) -> list[tuple[Delivery, Entry]]:
        """The deliveries to run, with their decoded entries (the rest is taken care of)."""
        decoded: list[tuple[Delivery, Entry]] = []
        empty: list[Ref] = []
        limit = self.stream.settings.max_attempts
        for d in deliveries:
            data = d.fields.get(FIELD)
            if d.deliveries > limit and CARRIED in d.fields:  # moved with its attempts used up
                await self.dead_letter(d, over_limit(d.deliveries - 1, limit))
                continue
            if data is None:
                if not d.fields:  # deleted after its result was recorded: only ack it
                    empty.append(d.ref)
                else:
                    await self.dead_letter(d, "entry has no 'd' field")
                continue
            try:
                decoded.append((d, Entry.from_wire(wire.decode(data, self.stream.limits))))
            except PrefixqError as err:
                await self.dead_letter(d, f"undecodable: {err}")
            except Exception as err:  # a payload must never take the worker down
                log.exception("unexpected error decoding entry %s", d.entry_id.decode())
                await self.dead_letter(d, f"undecodable: {type(err).__name__}: {err}")
        if empty:
            await self.retry("acking deleted entries", lambda: self.stream.ack_refs(empty))
        now = time.time()
        return [(d, e) for d, e in decoded if not self.ended(d, e, now)]

    def ended(self, d: Delivery, e: Entry, now: float) -> bool:
        """An entry of a cancelled or expired burst, or past its deadline, is not run: its
        request gets the ended result (recorded once: the burst's end usually recorded it
        already, and this then only acks the entry)."""
        reason = self.ends.reason(e, now)
        if reason is None:
            return False
        res = e.failed(self.stream.shard, self.stream.consumer, reason, ENDED_ERRORS[reason], now)
        self.counts["failed"] += 1
        self.writer.put(d.ref, e, res)
        return True

    async def dead_letter(self, delivery: Delivery, reason: str) -> None:
        """Move an entry to the dead-letter stream; its request (if identifiable) gets a failed
        result, recorded and acked before this returns. A Redis error leaves the entry pending:
        it is reclaimed and dead-lettered again later."""
        stream = self.stream
        log.warning(
            "dead letter %s on shard %d: %s", delivery.entry_id.decode(), stream.shard, reason
        )
        try:
            entry = await stream.dead_letter(delivery, reason)
        except (*TRANSIENT, ResponseError) as e:
            log.error("dead-lettering %s failed (%s); left pending", delivery.entry_id, e)
            return
        self.counts["dead"] += 1
        if entry is not None:
            self.counts["failed"] += 1
            res = dead_lettered_result(entry, stream.shard, stream.consumer, reason)
            await self.writer.write_now(delivery.ref, entry, res)
