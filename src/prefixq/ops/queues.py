"""What waits in a shard's queues, by priority and tenant: `prefixq inspect` and the metrics
exporter read the same code (sync and async drivers over one I/O-free `QueueRead`).

A shard's queues are its intake streams (one per priority) and its lanes (one per burst: the
lane index says its priority and tenant). Acked entries are deleted, so a stream holds exactly
its waiting entries (not yet delivered: after its group's last-delivered id) and its pending ones
(delivered, not acked: in flight). Lanes are counted whole; intake entries (heads, doorbells,
requeued entries: few) are attributed to their tenant from their payload, at most `INTAKE_SCAN`
per intake (the rest under tenant ``?``). Three or four round trips per shard whatever the number
of bursts: the lane index, then XLEN + XINFO GROUPS per stream (and each lane's burst's status),
then the oldest waiting entry of each stream that has one (and the intakes' entries); a fourth
reads the status of the intake entries' other bursts, when there are any. The waiting entries of
a burst that ended (cancelled, expired) are no work: counted apart (``ended``), not as waiting.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio as aredis

from prefixq.core import wire
from prefixq.core.keys import FIELD, GROUP, Keys
from prefixq.core.sharing import PRIORITIES, LaneInfo, band

__all__ = ["INTAKE_SCAN", "Queue", "QueueRead", "ShardQueues", "aread", "entry_age", "read"]

#: intake entries read per intake to attribute them to tenants
INTAKE_SCAN = 1000
#: a burst record's statuses after which its lanes' waiting entries are no work
ENDED = frozenset({b"cancelled", b"expired", "cancelled", "expired"})


def entry_age(entry_id: bytes | str | None, now: float) -> float:
    """Seconds since a stream entry was added (its id's millisecond part); 0 for none."""
    if not entry_id:
        return 0.0
    ms = int((entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-")[0])
    return round(max(0.0, now - ms / 1000), 3)


def _id(raw: bytes | str) -> tuple[int, int]:
    ms, _, seq = (raw.decode() if isinstance(raw, bytes) else raw).partition("-")
    return int(ms or 0), int(seq or 0)


@dataclass(slots=True)
class Queue:
    """Requests of one priority and tenant on one shard."""

    priority: str
    tenant: str
    #: not yet delivered to any worker
    waiting: int = 0
    #: delivered, not acked: in a worker (stock, engine, or results being written)
    pending: int = 0
    #: age of the oldest waiting entry (its queue wait so far)
    oldest_waiting_s: float = 0.0
    #: bursts with a lane on the shard
    bursts: int = 0
    #: their ids (not in the JSON: `prefixq.ops.stats.sharing` counts each burst once over shards)
    burst_ids: set[str] = field(default_factory=set)

    def to_json(self) -> dict[str, Any]:
        return {
            "priority": self.priority,
            "tenant": self.tenant,
            "waiting": self.waiting,
            "pending": self.pending,
            "oldest_waiting_s": self.oldest_waiting_s,
            "bursts": self.bursts,
        }


@dataclass(slots=True)
class ShardQueues:
    """Every stream of one shard, summed, and split by priority and tenant."""

    waiting: int = 0
    pending: int = 0
    oldest_waiting_s: float = 0.0
    #: age of the oldest entry of any stream (waiting or pending)
    oldest_entry_age_s: float = 0.0
    lanes: int = 0
    #: waiting entries of bursts that ended (cancelled, expired): no work, left for a worker to
    #: skip and ack; not in ``waiting`` (nor in the metrics that scale the workers)
    ended: int = 0
    #: (priority, tenant) -> its queue, highest priority first
    by_tenant: dict[tuple[str, str], Queue] = field(default_factory=dict)

    def queues(self) -> list[Queue]:
        return sorted(self.by_tenant.values(), key=lambda q: (band(q.priority), q.tenant))


class QueueRead:
    """The commands and the arithmetic of reading one shard's queues (no I/O)."""

    def __init__(self, keys: Keys, shard: int, now: float | None = None) -> None:
        self.keys, self.shard = keys, shard
        self.now = time.time() if now is None else now
        self.intakes = dict(zip(keys.intakes(shard), PRIORITIES, strict=True))
        self.lanes: dict[str, LaneInfo] = {}
        self.lane_burst: dict[str, str] = {}
        self.streams: list[str] = []
        self._groups: dict[str, tuple[int, int, bytes | None]] = {}
        #: lanes whose burst's record says it ended (cancelled, expired)
        self._ended: set[str] = set()
        #: burst -> its record's status (lanes' bursts, then intake entries' bursts)
        self._status: dict[str, Any] = {}
        self._asked: list[str] = []
        #: intake entry id -> its tenant and burst (each entry decoded once)
        self._payloads: dict[Any, tuple[str, str | None]] = {}

    def index(self, pipe: Any) -> None:
        pipe.hgetall(self.keys.lanes(self.shard))

    def set_index(self, index: Mapping[bytes, bytes]) -> list[str]:
        """The shard's streams, given its lane index: intakes, then lanes."""
        for burst, raw in index.items():
            info = LaneInfo.decode(raw)
            if info is not None:
                name = burst.decode(errors="replace")
                key = self.keys.lane(self.shard, name)
                self.lanes[key] = info
                self.lane_burst[key] = name
        self.streams = self.keys.streams(self.shard, self.lane_burst.values())
        return self.streams

    def stats(self, index: Mapping[bytes, bytes], pipe: Any) -> None:
        """Step 2, given the lane index: XLEN and XINFO GROUPS of every stream, then the status
        of each lane's burst."""
        for key in self.set_index(index):
            pipe.xlen(key)
            pipe.xinfo_groups(key)
        for burst in self.lane_burst.values():
            pipe.hget(self.keys.burst(burst), "status")

    def details(self, replies: list[Any], pipe: Any) -> None:
        """Step 3, given step 2's replies: the oldest waiting entry of each stream with waiting
        entries, the first entry of every stream, and the intakes' entries."""
        statuses = replies[2 * len(self.streams) :]
        for (key, burst), status in zip(self.lane_burst.items(), statuses, strict=False):
            self._status[burst] = status
            if status in ENDED:
                self._ended.add(key)
        for i, key in enumerate(self.streams):
            length, groups = replies[2 * i], replies[2 * i + 1]
            length = length if isinstance(length, int) else 0
            group = None
            if not isinstance(groups, Exception):
                group = next((g for g in groups if _text(g.get("name")) == GROUP), None)
            pending = int((group or {}).get("pending", 0) or 0)
            last = (group or {}).get("last-delivered-id")
            self._groups[key] = (length, pending, last)
            start = "-" if last is None else "(" + _text(last)
            pipe.xrange(key, min=start, count=1)
            pipe.xrange(key, count=INTAKE_SCAN if key in self.intakes else 1)

    def intake_bursts(self, replies: list[Any], pipe: Any) -> bool:
        """Step 4, given step 3's replies: the status of the bursts of the intakes' entries
        whose status step 2 did not read; False when there are none (no round trip)."""
        for i, key in enumerate(self.streams):
            rows = replies[2 * i + 1]
            if key not in self.intakes or isinstance(rows, Exception):
                continue
            for entry_id, fields in rows:
                _, burst = self._payloads[entry_id] = _payload(fields)
                if burst is not None and burst not in self._status:
                    self._status[burst] = None
                    self._asked.append(burst)
                    pipe.hget(self.keys.burst(burst), "status")
        return bool(self._asked)

    def result(self, replies: list[Any], statuses: list[Any] | None = None) -> ShardQueues:
        for burst, status in zip(self._asked, statuses or [], strict=False):
            self._status[burst] = status
        out = ShardQueues(lanes=len(self.lanes))
        for i, key in enumerate(self.streams):
            first_waiting, head = replies[2 * i], replies[2 * i + 1]
            length, pending, last = self._groups[key]
            waiting = max(0, length - pending)
            if key in self._ended:  # no work: a worker skips and acks them
                out.ended += waiting
                waiting = 0
            out.waiting += waiting
            out.pending += pending
            if not isinstance(head, Exception) and head:
                out.oldest_entry_age_s = max(
                    out.oldest_entry_age_s, entry_age(head[0][0], self.now)
                )
            oldest = 0.0
            if waiting and not isinstance(first_waiting, Exception) and first_waiting:
                oldest = entry_age(first_waiting[0][0], self.now)
            info = self.lanes.get(key)
            if info is not None:
                q = self._queue(out, info.priority, info.tenant)
                q.waiting += waiting
                q.pending += pending
                q.bursts += 1
                q.burst_ids.add(self.lane_burst[key])
                q.oldest_waiting_s = max(q.oldest_waiting_s, oldest)
            elif length:
                rows = [] if isinstance(head, Exception) else head
                ended, oldest = self._intake(
                    out, self.intakes[key], rows, (length, pending, last), oldest
                )
                out.waiting -= ended
                out.ended += ended
            out.oldest_waiting_s = max(out.oldest_waiting_s, oldest)
        return out

    def _intake(
        self,
        out: ShardQueues,
        priority: str,
        rows: list[Any],
        group: tuple[int, int, bytes | None],
        first_waiting_s: float,
    ) -> tuple[int, float]:
        """Count an intake's scanned ``rows`` by tenant (the rest under ``?``); its waiting
        entries of ended bursts, and the age of its oldest waiting entry of a live one."""
        length, pending, last = group
        delivered = _id(last) if last is not None else (-1, -1)
        seen_w = seen_p = ended = 0
        oldest = 0.0
        for entry_id, fields in rows:
            tenant, burst = self._payloads.get(entry_id) or _payload(fields)
            q = self._queue(out, priority, tenant)
            if _id(entry_id) <= delivered:
                q.pending += 1
                seen_p += 1
            elif self._status.get(burst or "") in ENDED:
                ended += 1  # no work: a worker skips and acks it
                seen_w += 1
            else:
                q.waiting += 1
                seen_w += 1
                age = entry_age(entry_id, self.now)
                q.oldest_waiting_s = max(q.oldest_waiting_s, age)
                oldest = max(oldest, age)
        rest = self._queue(out, priority, "?") if length > len(rows) else None
        if rest is not None:  # beyond the scan
            rest.waiting += max(0, length - pending - seen_w)
            rest.pending += max(0, pending - seen_p)
            if rest.waiting:
                oldest = max(oldest, first_waiting_s)
        return ended, oldest

    @staticmethod
    def _queue(out: ShardQueues, priority: str, tenant: str) -> Queue:
        q = out.by_tenant.get((priority, tenant))
        if q is None:
            q = out.by_tenant[(priority, tenant)] = Queue(priority, tenant)
        return q


def _payload(fields: Any) -> tuple[str, str | None]:
    """An intake entry's tenant and burst (``?`` and None for one that does not decode)."""
    try:
        payload = wire.decode(fields[FIELD])
        tenant, burst = payload.get("tn") or "default", payload.get("b")
    except Exception:  # anything in an intake: an undecodable entry is a dead letter soon
        return "?", None
    return str(tenant)[:64], burst if isinstance(burst, str) else None


def _text(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def read(r: redis.Redis, keys: Keys, shard: int) -> ShardQueues:
    """A shard's queues over a blocking client (three or four round trips)."""
    q = QueueRead(keys, shard)
    pipe = r.pipeline(transaction=False)
    q.index(pipe)
    (index,) = pipe.execute()
    pipe = r.pipeline(transaction=False)
    q.stats(index, pipe)
    stats = pipe.execute(raise_on_error=False)
    pipe = r.pipeline(transaction=False)
    q.details(stats, pipe)
    details = pipe.execute(raise_on_error=False)
    pipe = r.pipeline(transaction=False)
    statuses = pipe.execute(raise_on_error=False) if q.intake_bursts(details, pipe) else []
    return q.result(details, statuses)


async def aread(r: aredis.Redis, keys: Keys, shard: int) -> ShardQueues:
    """`read` inside an event loop."""
    q = QueueRead(keys, shard)
    pipe = r.pipeline(transaction=False)
    q.index(pipe)
    (index,) = await pipe.execute()
    pipe = r.pipeline(transaction=False)
    q.stats(index, pipe)
    stats = await pipe.execute(raise_on_error=False)
    pipe = r.pipeline(transaction=False)
    q.details(stats, pipe)
    details = await pipe.execute(raise_on_error=False)
    pipe = r.pipeline(transaction=False)
    statuses = await pipe.execute(raise_on_error=False) if q.intake_bursts(details, pipe) else []
    return q.result(details, statuses)
