"""One shard's stream protocol, owned by one object: `ShardStream`.

It holds the shard's stream (`Keys.stream`), its consumer group (`GROUP`), this worker's consumer
name and its Redis client, and sends every command a worker sends about entries: join the group,
read new entries, claim idle ones, renew the lease on the entries it holds, page through pending
entries with their delivery counts, record results and acknowledge their entries, dead-letter.
The writer, the reclaimer, the heartbeat and the backlog replay all go through it.

**Record, then acknowledge.** Results are recorded by lua/record_result.lua (exactly once per
request index) in one pipeline; only the entries whose record succeeded are then acknowledged and
deleted, in a second round trip (the entry's stream and the burst's keys live in different Cluster
slots, so one script cannot touch both). A refused record — Redis out of memory, the script gone
after a restart — leaves its entry pending: the writer retries it, and if the worker dies first the
entry is delivered again and recorded then. A crash between the two round trips leaves recorded
results whose entries are pending: their redelivery finds the result and is only acknowledged.

**Deliveries** of an entry are the stream's delivery count plus the count it carried over a move
by `prefixq reclaim` (the entry's ``n`` field, consumers/letters.py), so ``max_attempts`` holds
across such moves; `last_allowed` says whether a delivery is the last one allowed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import NoScriptError, RedisError, ResponseError

from prefixq import wire
from prefixq.connection import TRANSIENT, Backoff, describe, lua, refused
from prefixq.consumers.letters import DEAD_MAXLEN, carried, dead_letter_record
from prefixq.entries import Entry
from prefixq.keys import GROUP, Keys
from prefixq.records import Result
from prefixq.settings import Settings

__all__ = [
    "BURST_DONE",
    "DUPLICATE",
    "FINISHED_DUPLICATE",
    "OUT_OF_RANGE",
    "RECORDED",
    "RECORD_LOST",
    "Delivery",
    "Pending",
    "ShardStream",
    "Written",
    "group_lost",
    "last_allowed",
    "record_call",
]

log = logging.getLogger(__name__)

# replies of lua/record_result.lua
#: recorded
RECORDED = 1
#: recorded, and it was the burst's last outstanding request
BURST_DONE = 2
#: a result for this index existed already (a redelivery): only acknowledge
DUPLICATE = 0
#: a result existed already and the burst has finished (completion hooks may run again: they are
#: idempotent, and a reply lost to a dropped connection must not lose the burst's completion)
FINISHED_DUPLICATE = 3
#: the index is outside the burst (a forged or corrupt entry): nothing written
OUT_OF_RANGE = -1
#: the burst's record does not exist (expired, evicted or never created): nothing written
RECORD_LOST = -2


def last_allowed(deliveries: int, max_attempts: int) -> bool:
    """Whether delivery number ``deliveries`` is an entry's last allowed one (consumers/solo.py)."""
    return 1 < max_attempts <= deliveries


def group_lost(err: BaseException) -> bool:
    """A reply saying the consumer group or the stream is gone (Redis restarted empty, the group
    was destroyed, the key deleted or flushed while a read blocked on it)."""
    text = str(err)
    return isinstance(err, ResponseError) and (
        "NOGROUP" in text or "no longer exists" in text or "UNBLOCKED" in text
    )


def record_call(
    keys: Keys, burst: str, result: Result, settings: Settings, now: str
) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of lua/record_result.lua for ``result`` of ``burst`` (the one way to record:
    the writer's, `prefixq reclaim`'s and the tests')."""
    return (
        [keys.results(burst), keys.burst(burst), keys.events(burst), keys.ids(burst)],
        [
            result.index,
            wire.encode(result.to_wire(), settings.codec),
            "" if result.error is None else (result.error_code or "internal_error"),
            settings.result_ttl_s,
            now,
            result.prompt_tokens,
            result.cached_tokens,
            result.predicted_cached_tokens,
        ],
    )


@dataclass(slots=True)
class Delivery:
    """One delivery of an entry to this consumer."""

    entry_id: bytes
    #: the entry's fields; empty when the entry was deleted (its result is recorded: only ack)
    fields: dict[bytes, bytes]
    #: which delivery this is, counting deliveries carried over a `prefixq reclaim` move
    deliveries: int = 1


@dataclass(slots=True)
class Pending:
    """One row of the pending entries list."""

    entry_id: bytes
    consumer: bytes
    #: deliveries so far (the stream's count plus any carried over a move)
    deliveries: int
    fields: dict[bytes, bytes] = field(default_factory=dict)


@dataclass(slots=True)
class Written:
    """A finished request on its way to Redis: its entry, the decoded entry and its result."""

    entry_id: bytes
    entry: Entry
    result: Result


class ShardStream:
    """The stream protocol of shard ``shard`` for consumer ``consumer``."""

    def __init__(self, r: aredis.Redis, settings: Settings, shard: int, consumer: str) -> None:
        self.r = r
        self.settings = settings
        self.shard = shard
        self.consumer = consumer
        self.keys = Keys(settings.namespace)
        self.stream = self.keys.stream(shard)
        self.dead = self.keys.dead(shard)
        self.limits = wire.Limits.from_settings(settings)
        self._record_lua = lua("record_result")
        self._record_sha = ""

    # ---- the group ---------------------------------------------------------------------------
    async def join(self) -> None:
        """Create the consumer group (and the stream) if missing and load the record script.
        Retried while Redis is unreachable, out of memory or loading; refused credentials or
        permissions raise ConfigError at once."""
        backoff = Backoff()
        while True:
            try:
                try:
                    await self.r.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
                except ResponseError as e:
                    if "BUSYGROUP" not in str(e):
                        raise
                self._record_sha = await self.r.script_load(self._record_lua)
                return
            except (*TRANSIENT, ResponseError) as e:
                if refused(e):  # wrong credentials, an ACL, an untrusted certificate
                    raise describe(self.settings, e) from e
                await backoff.wait(f"joining the consumer group of {self.stream}", e)

    # ---- reading -----------------------------------------------------------------------------
    async def read(self, count: int, block_ms: int) -> list[Delivery]:
        """New entries for this consumer (XREADGROUP ``>``). When the group or the stream is
        gone, the group is joined again and nothing is returned this time: acked entries are
        deleted, so only unfinished ones come back."""
        try:
            resp = await self.r.xreadgroup(
                GROUP, self.consumer, {self.stream: ">"}, count=count, block=block_ms
            )
        except ResponseError as e:
            if not group_lost(e):
                raise
            log.warning("consumer group of %s gone (%s); joining again", self.stream, e)
            await self.join()
            return []
        rows = resp[0][1] if resp else []
        return [Delivery(eid, f or {}, 1 + carried(f)) for eid, f in rows]

    async def claim(self, rows: Sequence[Pending], min_idle_ms: int) -> list[Delivery]:
        """Take pending entries over (XCLAIM, which counts a delivery); those claimed meanwhile
        by someone else (idle time reset) or acked are left out."""
        if not rows:
            return []
        got = await self.r.xclaim(
            self.stream, GROUP, self.consumer, min_idle_ms, [p.entry_id for p in rows]
        )
        before = {p.entry_id: p.deliveries for p in rows}
        return [Delivery(eid, f or {}, before.get(eid, 0) + 1) for eid, f in got]

    async def renew(self, ids: Sequence[bytes]) -> None:
        """Reset the idle time of entries this consumer holds (XCLAIM JUSTID: no delivery is
        counted), so that no reclaimer takes them while they are served or written."""
        if ids:
            await self.r.xclaim(self.stream, GROUP, self.consumer, 0, list(ids), justid=True)

    async def pending(
        self,
        *,
        count: int,
        start: str = "-",
        consumer: str | None = None,
        min_idle_ms: int | None = None,
    ) -> list[Pending]:
        """One page of pending entries (of ``consumer``, idle at least ``min_idle_ms``), oldest
        first, each with its fields and deliveries; none when the group is gone."""
        try:
            rows = await self.r.xpending_range(
                self.stream,
                GROUP,
                min=start,
                max="+",
                count=count,
                consumername=consumer,
                idle=min_idle_ms,
            )
        except ResponseError as e:
            if group_lost(e):
                return []
            raise
        if not rows:
            return []
        pipe = self.r.pipeline(transaction=False)
        for p in rows:
            pipe.xrange(self.stream, p["message_id"], p["message_id"])
        found = await pipe.execute()
        out = []
        for p, f in zip(rows, found, strict=True):
            fields = f[0][1] if f else {}
            out.append(
                Pending(
                    entry_id=p["message_id"],
                    consumer=p["consumer"],
                    deliveries=p["times_delivered"] + carried(fields),
                    fields=fields,
                )
            )
        return out

    # ---- results -----------------------------------------------------------------------------
    async def record(self, batch: Sequence[Written]) -> list[int | RedisError]:
        """Record each result (one pipeline, lua/record_result.lua); per item the script's reply
        or the error that refused it (that item is not recorded; record it again later).
        Connection errors raise."""
        if not self._record_sha:
            self._record_sha = await self.r.script_load(self._record_lua)
        pipe = self.r.pipeline(transaction=False)
        now = repr(time.time())
        for w in batch:
            keys, args = record_call(self.keys, w.entry.burst, w.result, self.settings, now)
            pipe.evalsha(self._record_sha, len(keys), *keys, *args)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        if any(isinstance(x, NoScriptError) for x in replies):
            self._record_sha = ""  # Redis restarted without its scripts: load it again next time
        return [x if isinstance(x, RedisError) else int(x) for x in replies]

    async def ack(self, batch: Sequence[Written]) -> None:
        """Acknowledge and delete the entries of recorded results, and move the shard's counters
        (outstanding prefill work, prompt / cached / predicted tokens). Raises if the ack itself
        failed (call again: acking twice is harmless); the counters are approximate and a
        refused counter update is only logged."""
        if not batch:
            return
        ids = [w.entry_id for w in batch]
        k, keys = self.shard, self.keys
        pipe = self.r.pipeline(transaction=False)
        pipe.xack(self.stream, GROUP, *ids)
        pipe.xdel(self.stream, *ids)
        pipe.hincrby(keys.load, str(k), -sum(w.entry.work for w in batch))
        stats = keys.shard_stats
        pipe.hincrby(stats, f"{k}:prompt", sum(w.result.prompt_tokens for w in batch))
        pipe.hincrby(stats, f"{k}:cached", sum(w.result.cached_tokens for w in batch))
        pipe.hincrby(stats, f"{k}:predicted", sum(w.result.predicted_cached_tokens for w in batch))
        replies = await pipe.execute(raise_on_error=False)
        for reply in replies[:2]:
            if isinstance(reply, Exception):
                raise reply
        if any(isinstance(x, Exception) for x in replies[2:]):
            log.debug("shard counters not updated: %s", replies[2:])

    async def ack_ids(self, ids: Sequence[bytes]) -> None:
        """Acknowledge and delete entries that carry nothing to record (already deleted, or
        dead-lettered without an identifiable request)."""
        if ids:
            pipe = self.r.pipeline(transaction=False)
            pipe.xack(self.stream, GROUP, *ids)
            pipe.xdel(self.stream, *ids)
            await pipe.execute()

    async def dead_letter(self, delivery: Delivery, reason: str) -> Entry | None:
        """Add the entry to the shard's dead-letter stream with ``reason``; returns the request
        it belongs to, whose failed result the caller records (and thereby acks the entry), or
        None when it cannot be identified (the entry is then acked here)."""
        record, entry = dead_letter_record(
            delivery.entry_id,
            self.shard,
            delivery.fields,
            reason,
            delivery.deliveries,
            self.consumer,
            self.limits,
        )
        await self.r.xadd(self.dead, record, maxlen=DEAD_MAXLEN, approximate=True)
        if entry is None:
            await self.ack_ids([delivery.entry_id])
        return entry
