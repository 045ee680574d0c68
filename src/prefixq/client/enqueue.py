"""A submitted burst's writes to Redis (`BurstWriter`): its record, id list and deadline in one
round trip (`create`: lua/create_burst.lua), each chunk's pipeline of prefixes, entries and load
counters (`send`, ridden through a Redis Cluster failover by `execute`; a pipeline sent again adds
no entry twice: lua/enqueue.lua), and at the end the record's counts and the burst index's pruning
(`finish`). It counts what Redis acknowledged, so that a submit that fails can say what Redis
holds (`held`). Where the entries go is layout.py's.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import RedisError

from prefixq.affinity.placement import Placed, Placer
from prefixq.client.encoding import Encoded, EntryEncoder
from prefixq.client.layout import Layout
from prefixq.core.errors import BurstIdTaken, WritesLost
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.store.connection import is_cluster, lua
from prefixq.store.fence import afence
from prefixq.store.liveness import add_load
from prefixq.store.redis_errors import transient
from prefixq.store.retry import Backoff

log = logging.getLogger(__name__)

#: burst index entries a submit looks at for pruning (the oldest)
_PRUNE = 32
#: seconds a submit on a Redis Cluster keeps sending a chunk through a failover (`execute`):
#: a replica is promoted within about twice ``cluster-node-timeout``
RIDE_THROUGH_S = 30.0
#: a deadline this close (seconds) when the submit fences may have expired the burst meanwhile
_DEADLINE_MARGIN_S = 5.0
#: request ids per RPUSH of the burst's id list
_IDS_CHUNK = 10_000
#: seconds a staged id list lives if its producer dies before the create call (Keys.staged_ids)
_STAGED_TTL_S = 3600


class BurstWriter:
    """The Redis writes of one burst of ``n`` requests, on client ``r``."""

    def __init__(
        self,
        r: aredis.Redis,
        settings: Settings,
        keys: Keys,
        burst: str,
        *,
        n: int,
        meta: dict[str, Any],
        enc: EntryEncoder,
        layout: Layout,
    ) -> None:
        self.r, self.s, self.keys, self.burst, self.n = r, settings, keys, burst, n
        self.meta, self.enc, self.layout = meta, enc, layout
        #: a Redis Cluster client: the prefixes go in a pipeline of their own (`send`)
        self.cluster = is_cluster(r)
        self.per_shard: Counter[int] = Counter()
        #: requests whose pipeline Redis acknowledged; requests of the pipeline awaiting its reply
        self.sent = 0
        self.sending = 0
        #: entries a pipeline sent again found already added, and skipped
        self.skipped = 0
        self.created = False
        #: the stored prefixes this submission's entries refer to (the fence reads them back)
        self.prefix_refs: list[str] = []
        #: tells this submission's create apart from another producer's of the same burst id
        self.token = secrets.token_hex(8)

    async def create(
        self, ids: list[str], shards: int, placement: str | Placer, order: str
    ) -> None:
        """The burst record and its id list (``ids``), once, in one round trip (BurstIdTaken, a
        ValidationError, if the id is taken). A deadline is indexed in the same round trip, just
        before the record (with ``min_replicas_acked``, in a round trip and a fence before it):
        a producer that dies after the record leaves a burst that expires."""
        meta = {
            "total": self.n,
            "done": 0,
            "failed": 0,
            "created": self.enc.enqueued,
            "status": "queued",
            "shards": shards,
            "codec": self.s.codec,
            "placement": placement if isinstance(placement, str) else type(placement).__name__,
            "order": order,
            **self.meta,
        }
        flat = [x for kv in meta.items() for x in kv]
        keys = self.keys
        # the deadline's index entry, in the create's round trip; with min_replicas_acked, on
        # the replicas before the record exists instead (on a cluster the index and the record
        # are on two masters): no failover leaves a record that nothing indexes (a producer
        # dead before its head never fences; docs/delivery.md)
        deadline = "deadline" in self.meta
        fenced = deadline and self.s.min_replicas_acked > 0
        if fenced:
            await self._index_deadline()
            await self._fenced(written=(), scored={keys.deadlines: [self.burst]})
        staged = keys.staged_ids(self.burst, self.token)
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(staged)  # a pipeline the client sends again starts the list afresh
        for start in range(0, len(ids), _IDS_CHUNK):
            pipe.rpush(staged, *ids[start : start + _IDS_CHUNK])
        pipe.expire(staged, _STAGED_TTL_S)
        if deadline and not fenced:
            self._zadd_deadline(pipe)
        keys_args = [keys.burst(self.burst), staged, keys.ids(self.burst)]
        pipe.eval(lua("create_burst"), 3, *keys_args, self.token, self.n, len(meta), *flat)
        *writes, created = await pipe.execute(raise_on_error=False)
        if isinstance(created, Exception):
            raise created
        if created == -1:  # a push of the ids was refused (out of memory): nothing was created
            raise next((x for x in writes if isinstance(x, Exception)), RedisError(str(writes)))
        if not created:
            raise BurstIdTaken(f"burst {self.burst!r} already exists")
        self.created = True
        if deadline and not fenced and isinstance(writes[-1], Exception):
            # the index's master refused or could not be reached while the record's took it (on
            # a cluster they are two masters): index it again, riding through a failover, or fail
            # the submit (its burst cancelled): a record left unindexed would never expire
            await self._index_deadline()

    def _zadd_deadline(self, pipe: Any) -> None:
        """The burst's deadline into the index, lowered only (an entry of another burst of this
        id is corrected by `burst_end.expire_due` from the record)."""
        pipe.zadd(self.keys.deadlines, {self.burst: self.meta["deadline"]}, lt=True)

    async def _index_deadline(self) -> None:
        """`_zadd_deadline` on its own, riding through a failover."""
        for x in await self.execute(self._zadd_deadline, 0):
            if isinstance(x, Exception):
                raise x

    async def send(
        self, count: int, chunk: tuple[Encoded, list[Placed]], *, first: bool = False
    ) -> None:
        """One pipeline for a chunk of ``count`` requests: new prefixes (SET NX + TTL, before the
        entries that refer to them), the entries (to the intakes and the lanes: layout.py) and
        the shards' load counters; with the head, the ids and the burst indexes."""
        encoded, placed = chunk
        keys, ttl = self.keys, self.s.prefix_ttl_s

        def prefixes(pipe: Any) -> None:
            for ref, value in encoded.new_prefixes.items():
                pipe.set(keys.prefix(ref), value, nx=True, ex=ttl)
                pipe.expire(keys.prefix(ref), ttl)

        def entries(pipe: Any) -> None:
            self.layout.add(pipe, encoded.by_shard, first=first, token=self.token)
            if first:
                pipe.zadd(keys.bursts, {self.burst: self.enc.enqueued})

        def both(pipe: Any) -> None:
            prefixes(pipe)
            entries(pipe)

        self.sending = count
        if self.cluster and encoded.new_prefixes:
            # the prefix keys live in other slots (other masters) than the streams, and a cluster
            # pipeline sends to each master at once: the prefixes are written (answered) first,
            # so an entry never reaches a worker before the prefix it refers to (ordering in
            # place of one pipeline's order)
            stored = await self.execute(prefixes, count)
            replies = [*stored, *await self.execute(entries, count)]
        else:
            replies = await self.execute(both, count)
        self.sending = 0  # answered: what was refused is raised below, and was not written
        for x in replies:
            if isinstance(x, Exception):
                raise x
        at = 2 * len(encoded.new_prefixes)
        fresh = [bool(x) for x in replies[:at:2]]
        self.enc.stored(encoded.new_prefixes, fresh)
        self.prefix_refs += encoded.new_prefixes
        self._lost(encoded.by_shard, replies[at::2])
        await self._skipped(count, encoded.by_shard, replies[at::2])
        self.per_shard.update(p.shard for p in placed)
        self.sent += count

    def _lost(self, by_shard: dict[int, list[tuple[bytes, int]]], replies: list[Any]) -> None:
        """`WritesLost` when a shard's master lacks entries this submission sent it before and
        was answered for (``replies``: lua/enqueue.lua's, negative: the number missing; a failover
        lost them, and the promoted replica took this chunk's call): the burst would never
        finish."""
        lost = {k: -int(x) for k, x in zip(sorted(by_shard), replies, strict=False) if int(x) < 0}
        if lost:
            raise WritesLost(
                f"burst {self.burst}: entries sent before are missing on the master of shard(s) "
                + ", ".join(f"{k} ({n})" for k, n in sorted(lost.items()))
                + " (a Redis failover lost them after their master had answered)"
            )

    async def fence(self) -> None:
        """``min_replicas_acked``: the replicas hold every write of the submit before it returns
        (store/fence.py), read back on the masters that serve them now, so that a failover since
        they were answered fails the submit (`WritesLost`): the burst record's ``total``, each
        shard's count of this submission's entries (lua/enqueue.lua's guard), the burst's
        deadline index entry and the stored prefixes its entries refer to. An
        error a failover elsewhere leaves (a stale connection, a moved slot) fences again, for
        up to `RIDE_THROUGH_S`, as a pipeline is sent again."""
        keys = self.keys
        scored: dict[str, list[str]] = {}
        if float(self.meta.get("deadline", 0)) > time.time() + _DEADLINE_MARGIN_S:
            # a deadline that passes during the submit is expired, and its entry dropped, by
            # any worker (store/burst_end.py): only a later one must still be there
            scored[keys.deadlines] = [self.burst]
        await self._fenced(
            present={keys.burst(self.burst): ["total"]},
            counted=self.layout.counts(self.token),
            scored=scored,
            keys=[keys.prefix(ref) for ref in self.prefix_refs],
        )

    async def _fenced(self, **proofs: Any) -> None:
        """`afence` every master with ``proofs``, fenced again on a transient error."""
        backoff = Backoff(0.05, 1.0)
        give_up = time.monotonic() + RIDE_THROUGH_S
        while True:
            try:
                await afence(self.r, self.s, **proofs)
                return
            except Exception as e:
                if not transient(e) or time.monotonic() >= give_up:
                    raise
                await backoff.wait(f"burst {self.burst}: confirming its writes on the replicas", e)

    async def _skipped(
        self, count: int, by_shard: dict[int, list[tuple[bytes, int]]], replies: list[Any]
    ) -> None:
        """What a pipeline sent again found already added (``replies``: lua/enqueue.lua's, one per
        shard in shard order): one INFO line, and the load counters it raised again lowered."""
        skipped = {k: int(x) for k, x in zip(sorted(by_shard), replies, strict=False) if x}
        if not skipped:
            return
        pipe = self.r.pipeline(transaction=False)
        for k, n in skipped.items():  # the first n entries of the shard's part were in already
            add_load(pipe, self.keys, k, -sum(w for _, w in by_shard[k][:n]))
        await pipe.execute(raise_on_error=False)  # an estimate: a refused update only drifts it
        n = sum(skipped.values())
        self.skipped += n
        first, last = self.sent + 1, self.sent + count
        log.info(
            "burst %s: requests %d-%d sent again: %d of them had been enqueued already, skipped "
            "(%d in this submit)",
            self.burst,
            first,
            last,
            n,
            self.skipped,
        )

    def held(self, counted: int) -> str:
        """What a failed submit says Redis holds, from `count_enqueued`'s ``counted``. On a
        cluster a pipeline goes to every master at once, and when one master fails redis-py raises
        while the others may still be writing their part of the chunk: the count is then a lower
        bound, and the chunk in flight the upper one."""
        if self.cluster and self.sending and counted < self.sent + self.sending:
            return (
                f"at least {counted} and at most {self.sent + self.sending} of its {self.n} "
                "requests"
            )
        return f"{counted} of its {self.n} requests"

    async def execute(self, build: Callable[[Any], None], count: int) -> list[Any]:
        """The replies of a pipeline that ``build`` fills (for a chunk of ``count`` requests). On
        a Redis Cluster an error a failover causes (the master gone, CLUSTERDOWN or TRYAGAIN while
        its replica is promoted, a slot moved) sends the pipeline again, for up to
        `RIDE_THROUGH_S`, with one log line per outage: the submit rides through. What the failed
        try wrote stays, and the try again adds no entry that is in already (lua/enqueue.lua:
        `send` logs how many it skipped); prefixes and indexes are written idempotently. On a
        single Redis an error is raised at once (the producer's `_Submission._abandon`)."""
        backoff = Backoff(0.05, 1.0)
        give_up = time.monotonic() + RIDE_THROUGH_S
        mark = self.layout.mark()
        while True:
            self.layout.rewind(mark)  # a lane's group, index entry and places are sent again too
            pipe = self.r.pipeline(transaction=False)
            build(pipe)
            try:
                replies: list[Any] = await pipe.execute(raise_on_error=False)
            except Exception as e:
                if not (self.cluster and transient(e)) or time.monotonic() >= give_up:
                    raise
                err: BaseException = e
            else:
                bad = [x for x in replies if isinstance(x, Exception) and transient(x)]
                if not (self.cluster and bad) or time.monotonic() >= give_up:
                    backoff.reset()
                    return replies
                err = bad[0]
            first, last = self.sent + 1, self.sent + count
            await backoff.wait(f"burst {self.burst}: sending requests {first}-{last}", err)

    async def finish(self, shards: int) -> None:
        """The record's per-shard and byte counts, the lanes sealed, the burst index pruned."""
        sz = self.enc.sizes
        fields = {
            "per_shard": ",".join(str(self.per_shard[k]) for k in range(shards)),
            "prefixes": sz.prefixes,
            "prefix_bytes": sz.prefixes_new,
            "prefix_bytes_reused": sz.prefixes_reused,
            "raw_bytes": sz.raw,
            "entry_bytes": sz.entries,
            "encoded_bytes": sz.entries + sz.prefixes_new,
        }
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(self.keys.burst(self.burst), mapping=fields)
        self.layout.seal(pipe)
        pipe.zrange(self.keys.bursts, 0, _PRUNE - 1)
        oldest = (await pipe.execute())[-1]
        await self._prune(oldest)
        log.info(
            "burst %s: %d requests on %d shards (%s), %d -> %d bytes",
            self.burst,
            self.n,
            shards,
            fields["per_shard"],
            sz.raw,
            fields["encoded_bytes"],
        )

    async def _prune(self, oldest: list[bytes]) -> None:
        """Drop the burst index's oldest entries whose record is gone (expired after its
        ``result_ttl_s``, or evicted): a few per submit, so the index stays as long as the
        bursts Redis still holds (`prefixq inspect` prunes the same way)."""
        if not oldest:
            return
        pipe = self.r.pipeline(transaction=False)
        for b in oldest:
            pipe.exists(self.keys.burst(b.decode()))
        gone = [b for b, alive in zip(oldest, await pipe.execute(), strict=True) if not alive]
        if gone:
            await self.r.zrem(self.keys.bursts, *gone)
