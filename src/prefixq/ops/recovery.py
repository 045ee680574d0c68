"""Recovery without an engine: `prefixq reclaim` and `prefixq dead` (list, ``--requeue``), as
`Recovery.reclaim`, `Recovery.letters` and `Recovery.requeue`.

Dead letters are described in store/dead_letters.py; workers write them through
`ShardStream.dead_letter`, and `Recovery.reclaim` with the same `dead_letter_record`. Two
invariants. ``reclaim`` never XCLAIMs an entry to a live worker's consumer name (that worker never
read it: its heartbeat would not keep it alive, and its reclaimer would count a second delivery);
it moves the entry to its intake with the deliveries it had (``n``, `CARRIED`), in one script
that first checks the entry is still idle there. ``requeue`` takes back the dead-lettered result
before it re-adds the entry and deletes the dead letter: the two steps touch different Cluster
slots, and in this order a crash between them is repaired by running it again. docs/delivery.md,
"`prefixq reclaim`" and "`prefixq dead` and `prefixq dead --requeue`", has the rest.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from prefixq.core import wire
from prefixq.core.entries import Entry
from prefixq.core.errors import ConfigError, PrefixqError
from prefixq.core.keys import CARRIED, FIELD, GROUP, LANE, Keys
from prefixq.core.records import Result
from prefixq.core.settings import Settings
from prefixq.core.sharing import DEFAULT_PRIORITY
from prefixq.store.connection import sync_client
from prefixq.store.dead_letters import (
    DeadLetter,
    carried,
    dead_letter_record,
    dead_lettered_result,
    identify,
)
from prefixq.store.deployment import resolve_shards
from prefixq.store.liveness import add_load
from prefixq.store.lua_script import LuaScript
from prefixq.store.scripts import BURST_DONE, FINISHED_DUPLICATE, record_call
from prefixq.store.webhook_outbox import add_burst_event
from prefixq.worker.deliveries import group_lost
from prefixq.worker.reclaim import over_limit

__all__ = ["ReclaimReport", "Recovery", "RequeueReport"]

#: the name dead letters and failed results carry when `prefixq reclaim` wrote them
CLI_WORKER = "prefixq-reclaim"
_PAGE = 1000
_STREAM_ID = re.compile(r"\d+-\d+")
#: a burst status a cancel or an expiry set (or is setting) -> what to call it
_ENDED_EARLY = {
    b"cancelling": "cancelled",
    b"cancelled": "cancelled",
    b"expiring": "expired",
    b"expired": "expired",
}
#: a Batch API batch (its burst has the batch's id) in these statuses has written, or is
#: writing, its output and error files from its burst's results (openai/batches.py FINAL)
_BATCH_WRITTEN = frozenset({b"finalizing", b"completed", b"failed", b"expired", b"cancelled"})
#: the error code of the failed result dead-lettering records (dead_letters.dead_lettered_result)
DEAD_LETTERED = "dead_lettered"


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
    #: dead letters whose request had a result other than dead-lettering's anyway (an earlier
    #: delivery succeeded after all): only deleted
    resolved: int = 0
    #: (dead letter id, why) for those left in place
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Recovery:
    """Reclaim, list and requeue over a blocking client (the CLI's)."""

    def __init__(
        self,
        settings: Settings,
        client: redis.Redis | None = None,
        *,
        on_burst_done: Callable[[redis.Redis, Settings, str], object] | None = None,
    ) -> None:
        """``on_burst_done(client, settings, burst)`` runs when a failed result this records
        completes a burst (the CLI passes
        prefixq.integrations.rq_callbacks.enqueue_on_complete)."""
        self.s = settings
        self.on_burst_done = on_burst_done
        self.r = client or sync_client(settings)
        self.keys = Keys(settings.namespace)
        self.limits = wire.Limits.from_settings(settings)
        self._move = LuaScript("reclaim_entry")
        self._unrecord = LuaScript("unrecord_result")
        self._requeue = LuaScript("requeue_dead")
        self._record = LuaScript("record_result")

    def shards(self, shard: int | None = None) -> list[int]:
        """``[shard]`` (checked against the deployment's shard count), or every shard."""
        n = resolve_shards(self.r, self.s)
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

    def queue_keys(self, k: int) -> list[str]:
        """Every stream of shard ``k``: its intakes, then the lanes of its lane index."""
        lanes = [b.decode(errors="replace") for b in self.r.hkeys(self.keys.lanes(k))]
        return self.keys.streams(k, lanes)

    def _reclaim_shard(self, k: int, idle_ms: int) -> ReclaimReport:
        rep = ReclaimReport(shard=k)
        alive: dict[bytes, bool] = {}
        for key in self.queue_keys(k):
            start = "-"
            while True:
                try:
                    page = self.r.xpending_range(
                        key, GROUP, min=start, max="+", count=_PAGE, idle=idle_ms
                    )
                except redis.ResponseError as e:
                    if group_lost(e):  # no worker ever joined, or the lane is gone
                        break
                    raise
                for p in page:
                    consumer: bytes = p["consumer"]
                    if consumer not in alive:
                        hb = self.keys.heartbeat(k, consumer.decode(errors="replace"))
                        alive[consumer] = bool(self.r.exists(hb))
                    if alive[consumer]:
                        rep.live += 1
                    else:
                        where = (k, key)
                        self._reclaim_one(
                            where, p["message_id"], consumer, p["times_delivered"], idle_ms, rep
                        )
                if len(page) < _PAGE:
                    break
                start = "(" + page[-1]["message_id"].decode()
        return rep

    def _reclaim_one(
        self,
        where: tuple[int, str],
        entry_id: bytes,
        consumer: bytes,
        delivered: int,
        idle_ms: int,
        rep: ReclaimReport,
    ) -> None:
        k, key = where
        found = self.r.xrange(key, entry_id, entry_id)
        fields: dict[bytes, bytes] = found[0][1] if found else {}
        attempts = carried(fields) + delivered
        head = [GROUP, entry_id, consumer, idle_ms]
        if attempts < self.s.max_attempts:
            entry = identify(fields.get(FIELD), self.limits)
            intake = self.keys.intake(k, entry.priority if entry else DEFAULT_PRIORITY)
            args = [*head, "requeue", CARRIED, attempts, LANE]
            got = self._move.call(self.r, keys=[key, intake], args=args)
            if got is None:
                rep.raced += 1
            elif got == 0:
                rep.gone += 1
            else:
                rep.moved += 1
            return
        reason = over_limit(attempts, self.s.max_attempts)
        record, entry = dead_letter_record(
            entry_id, k, fields, reason, attempts, CLI_WORKER, self.limits
        )
        record["queue"] = key
        flat = [x for kv in record.items() for x in kv]
        got = self._move.call(self.r, keys=[key, self.keys.dead(k)], args=[*head, "dead", *flat])
        if got is None:
            rep.raced += 1
            return
        if got == 0:
            rep.gone += 1
            return
        rep.dead += 1
        if entry is not None:
            self.record_failure(entry, dead_lettered_result(entry, k, CLI_WORKER, reason))
            add_load(self.r, self.keys, k, -entry.work)

    def record_failure(self, e: Entry, res: Result) -> None:
        """Record a failed result exactly once (the writer's script and arguments)."""
        now = repr(time.time())
        call = record_call(self.keys, e.burst, [(res, e.enqueued)], self.s, now, res.worker)
        (reply,) = self._record.call(self.r, keys=call[0], args=call[1])
        if reply in (BURST_DONE, FINISHED_DUPLICATE):
            add_burst_event(self.r, self.s, e.burst)  # its on_complete_url, if any
        if reply in (BURST_DONE, FINISHED_DUPLICATE) and self.on_burst_done is not None:
            self.on_burst_done(self.r, self.s, e.burst)  # the last outstanding request

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
            if not _STREAM_ID.fullmatch(i) or any(int(p) >= 2**64 for p in i.split("-")):
                raise ConfigError(f"{i!r} is not a dead letter id (like 1712345678901-0)")
        found: set[str] = set()
        for k in self.shards(shard):
            dead = self.keys.dead(k)
            if ids:
                letters = [x for i in ids for x in self.r.xrange(dead, i, i)]
            else:
                letters = self.r.xrange(dead)
            for dead_id, f in letters:
                found.add(dead_id.decode())
                self._requeue_one(k, dead_id, f, rep)
        for i in dict.fromkeys(ids or ()):  # asked for by id: say why nothing happened
            if i not in found:
                rep.skipped.append((i, "no such dead letter (requeued or trimmed already?)"))
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
        total, status, created = self.r.hmget(meta, "total", "status", "created")
        if total is None:
            rep.skipped.append((did, f"burst {entry.burst!r} has no record (expired or evicted)"))
            return
        if not _same_burst(created, entry.enqueued):  # its record expired, the id was used again
            rep.skipped.append((did, f"it belongs to an earlier burst {entry.burst!r}"))
            return
        raw = self.r.hget(results, entry.index)
        if raw is not None:
            try:
                res = Result.from_wire(wire.decode(raw, self.limits))
                ours = res.error_code == DEAD_LETTERED or (res.error or "").startswith("dead-")
            except (PrefixqError, KeyError, TypeError, ValueError):
                ours = True  # unreadable: taken back (the compare-and-delete still guards it)
            if not ours:  # its result is not dead-lettering's (an earlier delivery succeeded
                # after all, or a cancel or deadline failed it): it stays the one result
                self.r.xdel(self.keys.dead(k), dead_id)
                rep.resolved += 1
                return
        ended = _ENDED_EARLY.get(status or b"")
        if ended is not None:
            rep.skipped.append((did, f"burst {entry.burst!r} was {ended}: it does not run again"))
            return
        batch = self.r.hget(self.keys.oai_batch(entry.burst), "status")
        if batch in _BATCH_WRITTEN:  # a result taken back would differ from the batch's files
            rep.skipped.append(
                (did, f"batch {entry.burst!r} is {batch.decode()}: its files are written")
            )
            return
        if raw is not None:
            burst_keys = [results, meta, self.keys.events(entry.burst), self.keys.ids(entry.burst)]
            taken = int(self._unrecord.call(self.r, keys=burst_keys, args=[entry.index, raw]))
            if taken < 0:  # cancelled or expired since the look above
                rep.skipped.append((did, f"burst {entry.burst!r} ended early: it does not run"))
                return
            rep.cleared += taken
        new = self._requeue.call(
            self.r,
            keys=[self.keys.intake(k, entry.priority), self.keys.dead(k)],
            args=[dead_id, FIELD, data],
        )
        if new is None:
            rep.skipped.append((did, "already requeued by another call"))
            return
        add_load(self.r, self.keys, k, entry.work)
        rep.requeued += 1


def _same_burst(created: bytes | None, enqueued: float) -> bool:
    """Whether an entry enqueued at ``enqueued`` belongs to the burst record created at
    ``created`` (every entry of a burst carries its record's ``created``); True when either is
    unknown (older records and entries)."""
    try:
        return created is None or not enqueued or abs(float(created) - enqueued) <= 1e-3
    except ValueError:
        return True
