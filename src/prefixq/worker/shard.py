"""One shard's stream protocol, owned by one object: `ShardStream`.

A shard's requests wait in several streams read through one consumer group (`GROUP`): its intakes
(one per priority) and its bursts' lanes. `ShardStream` holds their keys, this worker's consumer
name and its Redis client, and sends every command a worker sends about entries (join, read,
claim, renew the lease, page through pending entries, record and ack, dead-letter, close a lane);
the reader, writer, reclaimer, heartbeat and backlog replay all go through it. An entry is named
by its stream and its id together (worker/deliveries.py); the Lua scripts it runs on lanes
(closing a drained lane, giving entries back) go through `LaneScripts` (worker/lane_scripts.py).
The invariant: **record, then
acknowledge** — only entries whose result was recorded (lua/record_result.lua, exactly once per
index) are acked, in a second round trip, so a refused record or a crash leaves the entry
pending, to be redelivered and found recorded. docs/delivery.md, "At-least-once delivery,
exactly-once results", has the crash windows and the delivery count.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import RedisError, ResponseError

from prefixq.core import wire
from prefixq.core.entries import Entry
from prefixq.core.keys import GROUP, Keys
from prefixq.core.settings import Settings
from prefixq.store.connection import lua
from prefixq.store.dead_letters import DEAD_MAXLEN, carried, dead_letter_record
from prefixq.store.liveness import add_load
from prefixq.store.pipelined_script import Call, PipelinedScript
from prefixq.store.retry import retry
from prefixq.store.scripts import record_call
from prefixq.worker.deliveries import (
    Delivery,
    GroupLost,
    Pending,
    Ref,
    Written,
    by_key,
    group_lost,
)
from prefixq.worker.lane_scripts import LaneScripts

__all__ = ["ShardStream"]

log = logging.getLogger(__name__)


class ShardStream:
    """The stream protocol of shard ``shard`` for consumer ``consumer``."""

    def __init__(self, r: aredis.Redis, settings: Settings, shard: int, consumer: str) -> None:
        self.r = r
        self.settings = settings
        self.shard = shard
        self.consumer = consumer
        self.keys = Keys(settings.namespace)
        #: the intake stream of each priority, highest first (`Keys.stream` is ``normal``'s)
        self.intakes = self.keys.intakes(shard)
        self.stream = self.keys.stream(shard)
        self.dead = self.keys.dead(shard)
        self.index = self.keys.lanes(shard)
        self.limits = wire.Limits.from_settings(settings)
        self._record = PipelinedScript(r, lua("record_result"), "record_result")
        self._lanes = LaneScripts(r, index=self.index, consumer=consumer)
        self._ack = PipelinedScript(r, lua("ack_entries"), "ack_entries")

    # ---- the group ---------------------------------------------------------------------------
    async def join(self) -> None:
        """Create the consumer group on each intake stream (and the stream) if missing and load
        the record script. Retried while Redis is unreachable, out of memory or loading; refused
        credentials or permissions raise ConfigError at once."""

        async def join() -> None:
            await self.create_groups(self.intakes, mkstream=True)
            await self._record.load()

        await retry(f"joining the consumer group of {self.stream}", join, settings=self.settings)

    async def create_groups(self, keys: Sequence[str], *, mkstream: bool) -> list[str]:
        """Create the group on ``keys`` where it is missing (from id 0: acked entries are deleted,
        so exactly the unfinished ones are delivered); returns the keys that do not exist
        (without ``mkstream``: a lane closed meanwhile)."""
        pipe = self.r.pipeline(transaction=False)
        for key in keys:
            pipe.xgroup_create(key, GROUP, id="0", mkstream=mkstream)
        replies = await pipe.execute(raise_on_error=False)
        gone = []
        for key, reply in zip(keys, replies, strict=True):
            if not isinstance(reply, Exception) or "BUSYGROUP" in str(reply):
                continue
            if "requires the key to exist" not in str(reply):
                raise reply
            gone.append(key)
        return gone

    # ---- reading -----------------------------------------------------------------------------
    async def read(
        self, reads: Sequence[tuple[Sequence[str], int]], block_ms: int | None = None
    ) -> dict[str, list[Delivery]]:
        """New entries for this consumer (XREADGROUP ``>``), in one round trip: each item of
        ``reads`` is one XREADGROUP over its keys with its COUNT (per key); ``block_ms`` blocks
        (only with a single read). Returns the deliveries by key (keys without any left out).
        A stream or group that is gone raises `GroupLost`."""
        if len(reads) == 1:
            keys, count = reads[0]
            try:
                resp = await self.r.xreadgroup(
                    GROUP, self.consumer, dict.fromkeys(keys, ">"), count=count, block=block_ms
                )
            except ResponseError as e:
                if group_lost(e):
                    raise GroupLost(e) from e
                raise
            return self._deliveries(resp)
        pipe = self.r.pipeline(transaction=False)
        for keys, count in reads:
            pipe.xreadgroup(GROUP, self.consumer, dict.fromkeys(keys, ">"), count=count)
        replies = await pipe.execute(raise_on_error=False)
        out: dict[str, list[Delivery]] = {}
        lost: GroupLost | None = None
        for reply in replies:
            if isinstance(reply, ResponseError) and group_lost(reply):
                lost = GroupLost(reply)
            elif isinstance(reply, Exception):
                raise reply
            else:
                out.update(self._deliveries(reply))
        if lost is not None:
            lost.got = out  # the other reads' deliveries are still ours to serve
            raise lost
        return out

    @staticmethod
    def _deliveries(resp: Any) -> dict[str, list[Delivery]]:
        out: dict[str, list[Delivery]] = {}
        for raw_key, rows in resp or ():
            key = raw_key.decode() if isinstance(raw_key, bytes) else str(raw_key)
            out[key] = [Delivery(key, eid, f or {}, 1 + carried(f)) for eid, f in rows]
        return out

    async def claim(self, rows: Sequence[Pending], min_idle_ms: int) -> list[Delivery]:
        """Take pending entries over (XCLAIM, which counts a delivery); those claimed meanwhile
        by someone else (idle time reset) or acked are left out."""
        if not rows:
            return []
        groups = by_key(p.ref for p in rows)
        pipe = self.r.pipeline(transaction=False)
        for key, ids in groups.items():
            pipe.xclaim(key, GROUP, self.consumer, min_idle_ms, ids)
        replies = await pipe.execute(raise_on_error=False)
        before = {p.ref: p.deliveries for p in rows}
        out = []
        for key, got in zip(groups, replies, strict=True):
            if isinstance(got, Exception):
                if isinstance(got, ResponseError) and group_lost(got):
                    continue  # the stream went away: nothing left to claim there
                raise got
            out += [Delivery(key, eid, f or {}, before.get((key, eid), 0) + 1) for eid, f in got]
        return out

    async def renew(self, refs: Sequence[Ref]) -> None:
        """Reset the idle time of entries this consumer holds (XCLAIM JUSTID: no delivery is
        counted), so that no reclaimer takes them while they are served or written."""
        if not refs:
            return
        pipe = self.r.pipeline(transaction=False)
        for key, ids in by_key(refs).items():
            pipe.xclaim(key, GROUP, self.consumer, 0, ids, justid=True)
        for reply in await pipe.execute(raise_on_error=False):
            if isinstance(reply, Exception) and not group_lost(reply):
                raise reply

    async def pending(
        self,
        keys: Sequence[str],
        *,
        count: int,
        start: str = "-",
        consumer: str | bytes | None = None,
        min_idle_ms: int | None = None,
    ) -> list[Pending]:
        """One page (up to ``count`` per key) of pending entries of ``keys`` (of ``consumer``,
        idle at least ``min_idle_ms``), oldest first per key, each with its fields and
        deliveries; streams or groups that are gone have none."""
        if not keys:
            return []
        pipe = self.r.pipeline(transaction=False)
        for key in keys:
            pipe.xpending_range(
                key,
                GROUP,
                min=start,
                max="+",
                count=count,
                consumername=consumer,
                idle=min_idle_ms,
            )
        rows: list[tuple[str, Any]] = []
        for key, reply in zip(keys, await pipe.execute(raise_on_error=False), strict=True):
            if isinstance(reply, Exception):
                if isinstance(reply, ResponseError) and group_lost(reply):
                    continue
                raise reply
            rows += [(key, p) for p in reply]
        if not rows:
            return []
        pipe = self.r.pipeline(transaction=False)
        for key, p in rows:
            pipe.xrange(key, p["message_id"], p["message_id"])
        found = await pipe.execute()
        out = []
        for (key, p), f in zip(rows, found, strict=True):
            fields = f[0][1] if f else {}
            out.append(
                Pending(
                    key=key,
                    entry_id=p["message_id"],
                    consumer=p["consumer"],
                    deliveries=p["times_delivered"] + carried(fields),
                    fields=fields,
                    idle_ms=int(p["time_since_delivered"]),
                )
            )
        return out

    async def holders(self, keys: Sequence[str]) -> dict[bytes, list[str]]:
        """The consumers with entries pending in ``keys``, each with the keys where it has some
        (one summary XPENDING per key, in one round trip); streams or groups that are gone have
        none."""
        if not keys:
            return {}
        pipe = self.r.pipeline(transaction=False)
        for key in keys:
            pipe.xpending(key, GROUP)
        out: dict[bytes, list[str]] = {}
        for key, reply in zip(keys, await pipe.execute(raise_on_error=False), strict=True):
            if isinstance(reply, Exception):
                if isinstance(reply, ResponseError) and group_lost(reply):
                    continue
                raise reply
            for c in reply.get("consumers") or ():
                out.setdefault(c["name"], []).append(key)
        return out

    async def tally(self, rows: Sequence[tuple[str, str, int, float]]) -> None:
        """Add requests admitted and their queue waits, per priority and tenant, to the shard's
        counters (`prefixq inspect` shows the mean wait)."""
        if rows:
            k, stats = self.shard, self.keys.shard_stats
            pipe = self.r.pipeline(transaction=False)
            for prio, tenant, n, waited in rows:
                pipe.hincrby(stats, f"{k}:admitted:{prio}:{tenant}", n)
                pipe.hincrbyfloat(stats, f"{k}:waited:{prio}:{tenant}", round(waited, 6))
            await pipe.execute()

    async def lane_index(self) -> dict[bytes, bytes]:
        """The shard's lane index (`Keys.lanes`): burst -> encoded `LaneInfo`."""
        got: dict[bytes, bytes] = await self.r.hgetall(self.index)
        return got

    async def close_lanes(self, lanes: Sequence[tuple[str, str, bool]]) -> list[int]:
        """Delete each drained lane ``(key, burst, ended)`` with its index entry, if it is empty
        and sealed (or its burst ended and nothing was added for a while): lua/close_lane.lua.
        Per lane: 1 closed, 0 left (entries pending, or it may grow), -1 it holds undelivered
        entries (read it again)."""
        return await self._lanes.close(lanes)

    async def release(self, items: Sequence[tuple[Delivery, str]]) -> None:
        """Give back entries read but never started (a stopping worker's stock): each is re-added
        to the tail of its intake stream (``(delivery, intake)``) with the deliveries it had
        before this one, and acked and deleted here, atomically (lua/reclaim_entry.lua)."""
        await self._lanes.release(items)

    # ---- results -----------------------------------------------------------------------------
    async def record(self, batch: Sequence[Written]) -> list[int | RedisError]:
        """Record each result (lua/record_result.lua: one call per burst in the batch, in one
        pipeline); per item the script's reply or the error that refused its burst's call
        (nothing of that call is recorded; record them again later). Connection errors raise."""
        now = repr(time.time())
        groups: dict[tuple[str, str], list[int]] = {}
        for i, w in enumerate(batch):
            groups.setdefault((w.entry.burst, w.result.worker), []).append(i)
        calls = [
            record_call(
                self.keys,
                burst,
                [(batch[i].result, batch[i].entry.enqueued) for i in at],
                self.settings,
                now,
                worker,
            )
            for (burst, worker), at in groups.items()
        ]
        # every key of a call shares one slot: on a cluster it is routed by its first; a NOSCRIPT
        # (Redis restarted, a replica promoted) is sent again once the script is loaded, quietly
        raw = await self._record.run(calls)
        replies: list[int | RedisError] = [0] * len(batch)
        for at, got in zip(groups.values(), raw, strict=True):
            for j, i in enumerate(at):
                replies[i] = got if isinstance(got, RedisError) else int(got[j])
        return replies

    async def ack(self, batch: Sequence[Written]) -> None:
        """Acknowledge and delete the entries of recorded results, and move the shard's counters
        (outstanding prefill work, prompt / cached / predicted tokens). Raises if the ack itself
        failed (call again: acking twice is harmless); the counters are approximate and a
        refused counter update is only logged."""
        if not batch:
            return
        k, keys = self.shard, self.keys
        pipe = self.r.pipeline(transaction=False)
        groups = by_key((w.key, w.entry_id) for w in batch)
        if len(groups) <= 2:  # one burst (its intake and its lane): plain commands
            for key, ids in groups.items():
                pipe.xack(key, GROUP, *ids)
                pipe.xdel(key, *ids)
            acks = 2 * len(groups)
        else:  # many lanes: one script call instead of two commands per lane
            await self._ack.ready()
            counts = [len(ids) for ids in groups.values()]
            ids = [i for group in groups.values() for i in group]
            call: Call = (list(groups), [GROUP, *counts, *ids])
            self._ack.add(pipe, *call)
            acks = 1
        add_load(pipe, keys, k, -sum(w.entry.work for w in batch))
        stats = keys.shard_stats
        pipe.hincrby(stats, f"{k}:prompt", sum(w.result.prompt_tokens for w in batch))
        pipe.hincrby(stats, f"{k}:cached", sum(w.result.cached_tokens for w in batch))
        pipe.hincrby(stats, f"{k}:predicted", sum(w.result.predicted_cached_tokens for w in batch))
        replies = await pipe.execute(raise_on_error=False)
        if acks == 1:  # a NOSCRIPT: the script's call is sent again, not the counters
            replies[:1] = await self._ack.settle([call], replies[:1])
        for reply in replies[:acks]:
            if isinstance(reply, Exception):
                raise reply
        if any(isinstance(x, Exception) for x in replies[acks:]):
            log.debug("shard counters not updated: %s", replies[acks:])

    async def ack_refs(self, refs: Sequence[Ref]) -> None:
        """Acknowledge and delete entries that carry nothing to record (already deleted, or
        dead-lettered without an identifiable request)."""
        if refs:
            pipe = self.r.pipeline(transaction=False)
            for key, ids in by_key(refs).items():
                pipe.xack(key, GROUP, *ids)
                pipe.xdel(key, *ids)
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
        record["queue"] = delivery.key
        await self.r.xadd(self.dead, record, maxlen=DEAD_MAXLEN, approximate=True)
        if entry is None:
            await self.ack_refs([delivery.ref])
        return entry
