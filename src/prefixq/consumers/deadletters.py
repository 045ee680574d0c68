"""Dead letters and recovery without an engine: `prefixq reclaim` and `prefixq dead`.

A dead letter is an entry of the shard's dead-letter stream (`Keys.dead`): the original entry's
payload (``d``) plus ``entry`` (its stream id), ``shard``, ``reason``, ``delivered``, ``at``,
``worker`` and, when the payload identifies its request, ``burst`` and ``index``. Workers write
them (reclaim.py) and so does `Recovery.reclaim`; both build them with `dead_letter_record`.

``prefixq reclaim`` runs where there is no engine, so it cannot serve an entry, and it must not
XCLAIM one to a live worker's consumer name either: that worker never read it, so it would not
keep it alive in its heartbeat, and its own reclaimer would claim it again later (counting a second
delivery). Instead, for each entry idle past ``--idle-s`` on a consumer without a live heartbeat:

* delivered ``max_attempts`` times or more -> the dead-letter stream, with a failed result for its
  request (exactly once: the result is recorded by the same Lua script the writer uses);
* otherwise -> re-added at the stream's tail as a new, undelivered entry whose ``n`` field
  (`CARRIED`) holds the deliveries it had, and the old entry acked and deleted, in one Lua script
  (lua/reclaim_entry.lua) that first checks that the entry is still idle on that consumer. Any
  live worker of the shard then reads it like a new entry; workers add ``n`` to the stream's
  delivery count wherever they compare it with ``max_attempts``, so the limit still holds.

Entries pending on a consumer with a live heartbeat are left alone (that worker's own reclaimer
handles its strays).

``prefixq dead --requeue`` re-submits dead letters: it takes back the failed result that
dead-lettering recorded (compare-and-delete of that exact result, lowering the burst's ``failed``
count: lua/unrecord_result.lua), then re-adds the original payload to its shard's stream and
deletes the dead letter in one step (lua/requeue_dead.lua), so the request runs again and its new
outcome is the one result recorded. The two steps touch different Cluster slots, so they cannot be
one script; in this order a crash between them leaves the dead letter in place and a re-run
finishes the job. A requeued entry starts its delivery count afresh. A dead letter whose request
already has a successful result is only deleted; one without a decodable payload is skipped.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from redis.exceptions import ResponseError

from prefixq import wire
from prefixq.connection import lua, sync_client
from prefixq.entries import VERSION, Entry
from prefixq.errors import ConfigError, PrefixqError, WireError
from prefixq.keys import CARRIED, FIELD, GROUP, Keys
from prefixq.records import Result
from prefixq.settings import Settings

__all__ = [
    "DeadLetter",
    "ReclaimReport",
    "Recovery",
    "RequeueReport",
    "carried",
    "dead_letter_record",
    "failed_result",
    "identify",
]

#: the name dead letters and failed results carry when `prefixq reclaim` wrote them
CLI_WORKER = "prefixq-reclaim"
_PAGE = 1000
_BURST_DONE = 2
_STREAM_ID = re.compile(r"\d+-\d+")


def carried(fields: dict[bytes, bytes] | None) -> int:
    """Deliveries an entry had before `prefixq reclaim` moved it (0 for an entry never moved)."""
    raw = (fields or {}).get(CARRIED)
    try:
        return max(0, int(raw)) if raw is not None else 0
    except ValueError:
        return 0


def identify(data: bytes | None, limits: wire.Limits) -> Entry | None:
    """The request an entry's payload belongs to, as far as it can be told: the full `Entry`, or
    one with only burst, index and id when the rest is malformed (so that its request still gets
    a failed result and its burst can finish); None when not even that decodes."""
    if data is None:
        return None
    try:
        obj = wire.decode(data, limits)
    except PrefixqError:
        return None
    try:
        return Entry.from_wire(obj)
    except WireError:
        pass
    if not isinstance(obj, dict) or obj.get("v") != VERSION:  # another version: not ours to fail
        return None
    burst, index, rid = obj.get("b"), obj.get("i"), obj.get("id")
    if not (
        isinstance(burst, str)
        and isinstance(rid, str)
        and isinstance(index, int)
        and not isinstance(index, bool)
        and 0 <= index < 1 << 40
    ):
        return None
    return Entry(
        burst=burst,
        index=index,
        id=rid,
        own={},
        prefix=None,
        prefix_ref=None,
        sampling={},
        enqueued=0.0,
        shard=0,
        work=0,
        predicted_cached=0,
    )


def dead_letter_record(
    entry_id: bytes,
    shard: int,
    fields: dict[bytes, bytes],
    reason: str,
    delivered: int,
    worker: str,
    limits: wire.Limits,
) -> tuple[dict[Any, Any], Entry | None]:
    """The fields of one dead letter, and the request it belongs to (None if unidentifiable)."""
    record: dict[Any, Any] = {
        "entry": entry_id,
        "shard": shard,
        "reason": reason[:2000],
        "delivered": delivered,
        "at": time.time(),
        "worker": worker,
    }
    data = fields.get(FIELD)
    if data is not None:
        record[FIELD] = data
    entry = identify(data, limits)
    if entry is not None:
        record["burst"], record["index"] = entry.burst, entry.index
    return record, entry


def failed_result(entry: Entry, shard: int, worker: str, reason: str) -> Result:
    """The failed result a dead-lettered request gets."""
    res = Result(
        id=entry.id, index=entry.index, shard=shard, worker=worker, error=f"dead-lettered: {reason}"
    )
    res.timings.enqueued = entry.enqueued
    res.timings.finished = time.time()
    return res


@dataclass(slots=True)
class DeadLetter:
    """One dead letter, as `prefixq dead` lists it."""

    id: str
    shard: int
    entry: str
    reason: str
    delivered: int
    burst: str | None
    index: int | None
    at: float
    worker: str
    has_payload: bool

    @classmethod
    def from_fields(cls, shard: int, dead_id: bytes, f: dict[bytes, bytes]) -> DeadLetter:
        def text(key: bytes) -> str:
            return f.get(key, b"").decode(errors="replace")

        index = text(b"index")
        return cls(
            id=dead_id.decode(),
            shard=shard,
            entry=text(b"entry"),
            reason=text(b"reason"),
            delivered=int(text(b"delivered") or 0),
            burst=text(b"burst") or None,
            index=int(index) if index.lstrip("-").isdigit() else None,
            at=float(text(b"at") or 0.0),
            worker=text(b"worker"),
            has_payload=FIELD in f,
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class ReclaimReport:
    """What `Recovery.reclaim` did on one shard."""

    shard: int
    #: re-added at the stream's tail for a live worker
    moved: int = 0
    #: moved to the dead-letter stream (with a failed result when identifiable)
    dead: int = 0
    #: idle, but on a consumer with a live heartbeat: left to that worker
    live: int = 0
    #: taken by a live worker between the look and the move
    raced: int = 0
    #: pending, but the payload was already deleted: acked
    gone: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class RequeueReport:
    """What `Recovery.requeue` did."""

    #: re-added to their shard's stream
    requeued: int = 0
    #: failed results taken back (their bursts' failed counts lowered)
    cleared: int = 0
    #: dead letters whose request had a successful result anyway: only deleted
    resolved: int = 0
    #: (dead letter id, why) for those left in place
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Recovery:
    """Reclaim, list and requeue over a blocking client (the CLI's)."""

    def __init__(self, settings: Settings, client: redis.Redis | None = None) -> None:
        self.s = settings
        self.r = client or sync_client(settings)
        self.keys = Keys(settings.namespace)
        self.limits = wire.Limits.from_settings(settings)
        self._move = self.r.register_script(lua("reclaim_entry"))
        self._unrecord = self.r.register_script(lua("unrecord_result"))
        self._requeue = self.r.register_script(lua("requeue_dead"))
        self._record = self.r.register_script(lua("record_result"))

    def shards(self, shard: int | None = None) -> list[int]:
        """``[shard]`` (checked against the deployment's shard count), or every shard."""
        from prefixq.deployment import resolve_shards_sync

        n = resolve_shards_sync(self.r, self.s)
        if shard is None:
            return list(range(n))
        if not 0 <= shard < n:
            raise ConfigError(f"shard {shard} does not exist (namespace has shards 0..{n - 1})")
        return [shard]

    # ---- reclaim ---------------------------------------------------------------------------
    def reclaim(self, shard: int | None = None, idle_s: float | None = None) -> list[ReclaimReport]:
        """Move entries idle past ``idle_s`` (default ``claim_idle_s``) off dead consumers."""
        idle_ms = int((self.s.claim_idle_s if idle_s is None else idle_s) * 1000)
        return [self._reclaim_shard(k, idle_ms) for k in self.shards(shard)]

    def _reclaim_shard(self, k: int, idle_ms: int) -> ReclaimReport:
        rep = ReclaimReport(shard=k)
        stream = self.keys.stream(k)
        alive: dict[bytes, bool] = {}
        start = "-"
        while True:
            try:
                page = self.r.xpending_range(
                    stream, GROUP, min=start, max="+", count=_PAGE, idle=idle_ms
                )
            except ResponseError as e:
                if "NOGROUP" in str(e):  # no worker ever joined: nothing was delivered
                    return rep
                raise
            for p in page:
                consumer: bytes = p["consumer"]
                if consumer not in alive:
                    hb = self.keys.heartbeat(k, consumer.decode(errors="replace"))
                    alive[consumer] = bool(self.r.exists(hb))
                if alive[consumer]:
                    rep.live += 1
                else:
                    self._reclaim_one(
                        k, p["message_id"], consumer, p["times_delivered"], idle_ms, rep
                    )
            if len(page) < _PAGE:
                return rep
            start = "(" + page[-1]["message_id"].decode()

    def _reclaim_one(
        self,
        k: int,
        entry_id: bytes,
        consumer: bytes,
        delivered: int,
        idle_ms: int,
        rep: ReclaimReport,
    ) -> None:
        stream = self.keys.stream(k)
        found = self.r.xrange(stream, entry_id, entry_id)
        fields: dict[bytes, bytes] = found[0][1] if found else {}
        attempts = carried(fields) + delivered
        head = [GROUP, entry_id, consumer, idle_ms]
        if attempts < self.s.max_attempts:
            got = self._move(keys=[stream, stream], args=[*head, "requeue", CARRIED, attempts])
            if got is None:
                rep.raced += 1
            elif got == 0:
                rep.gone += 1
            else:
                rep.moved += 1
            return
        reason = f"delivered {attempts} times (max_attempts={self.s.max_attempts})"
        record, entry = dead_letter_record(
            entry_id, k, fields, reason, attempts, CLI_WORKER, self.limits
        )
        flat = [x for kv in record.items() for x in kv]
        got = self._move(keys=[stream, self.keys.dead(k)], args=[*head, "dead", *flat])
        if got is None:
            rep.raced += 1
            return
        if got == 0:
            rep.gone += 1
            return
        rep.dead += 1
        if entry is not None:
            self.record_failure(entry, failed_result(entry, k, CLI_WORKER, reason))
            self.r.hincrby(self.keys.load, str(k), -entry.work)

    def record_failure(self, e: Entry, res: Result) -> None:
        """Record a failed result exactly once (the writer's script and arguments)."""
        keys = self.keys
        reply = self._record(
            keys=[keys.results(e.burst), keys.burst(e.burst), keys.events(e.burst)],
            args=[
                e.index,
                wire.encode(res.to_wire(), self.s.codec),
                1,
                self.s.result_ttl_s,
                repr(time.time()),
                0,
                0,
                0,
            ],
        )
        if reply == _BURST_DONE:  # the last outstanding request: its callback, once
            from prefixq.rq_jobs import enqueue_on_complete_sync

            enqueue_on_complete_sync(self.r, self.s, e.burst)

    # ---- dead letters ----------------------------------------------------------------------
    def letters(self, shard: int | None = None, limit: int = 1000) -> list[DeadLetter]:
        """Dead letters, oldest first, at most ``limit`` per shard."""
        out: list[DeadLetter] = []
        for k in self.shards(shard):
            for dead_id, f in self.r.xrange(self.keys.dead(k), count=limit):
                out.append(DeadLetter.from_fields(k, dead_id, f))
        return out

    def requeue(self, shard: int | None = None, ids: list[str] | None = None) -> RequeueReport:
        """Re-submit dead letters (all of the shards', or those with the given ids)."""
        rep = RequeueReport()
        for i in ids or ():
            if not _STREAM_ID.fullmatch(i):
                raise ConfigError(f"{i!r} is not a dead letter id (like 1712345678901-0)")
        for k in self.shards(shard):
            dead = self.keys.dead(k)
            if ids:
                letters = [x for i in ids for x in self.r.xrange(dead, i, i)]
            else:
                letters = self.r.xrange(dead)
            for dead_id, f in letters:
                self._requeue_one(k, dead_id, f, rep)
        return rep

    def _requeue_one(
        self, k: int, dead_id: bytes, f: dict[bytes, bytes], rep: RequeueReport
    ) -> None:
        did = dead_id.decode()
        data = f.get(FIELD)
        if data is None:
            rep.skipped.append((did, "no payload to requeue (the entry had no 'd' field)"))
            return
        try:
            entry = Entry.from_wire(wire.decode(data, self.limits))
        except PrefixqError as err:
            rep.skipped.append((did, f"payload does not decode ({err}); it would fail again"))
            return
        results, meta = self.keys.results(entry.burst), self.keys.burst(entry.burst)
        raw = self.r.hget(results, entry.index)
        if raw is not None:
            try:
                ok = Result.from_wire(wire.decode(raw, self.limits)).error is None
            except (PrefixqError, KeyError, TypeError, ValueError):
                ok = False
            if ok:  # an earlier delivery succeeded after all: nothing to run again
                self.r.xdel(self.keys.dead(k), dead_id)
                rep.resolved += 1
                return
            rep.cleared += int(self._unrecord(keys=[results, meta], args=[entry.index, raw]))
        new = self._requeue(
            keys=[self.keys.stream(k), self.keys.dead(k)], args=[dead_id, FIELD, data]
        )
        if new is None:
            rep.skipped.append((did, "already requeued by another call"))
            return
        self.r.hincrby(self.keys.load, str(k), entry.work)
        rep.requeued += 1
