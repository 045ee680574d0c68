"""`Producer`: a burst in, entries on the shards' streams out — its head first.

`Producer.asubmit` validates, places and encodes the burst's head (its first `HEAD` requests in
enqueue order), creates the burst record with the ids of all its requests (lua/create_burst.lua:
an id is taken once, and a burst never exists without its ids), sends the head, and only then
validates, places and sends the rest in growing chunks (`_Submission.run`), so that the engines
start within milliseconds whatever the burst's size. Where the entries go is
layout.py's; the enqueue order is order.py's. The invariant to keep: once the record exists, no
failure may leave the burst half sent (`_Submission._abandon` cancels it as a whole); before
that, a refusal leaves nothing behind. docs/architecture.md, "The producer: the head first", has
the steps, the failure cases and the measured start. A `RequestFile` (request_file.py) was
checked whole before anything is sent and is read again chunk by chunk; every request is dropped
once its entry is sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import secrets
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import RedisError

from prefixq.affinity.placement import (
    HashPlacer,
    Placed,
    Placer,
    RandomPlacer,
    RoundRobinPlacer,
)
from prefixq.affinity.prefix_map import AffinityPlacer
from prefixq.client.burst import Burst
from prefixq.client.encoding import Encoded, EntryEncoder, Parts
from prefixq.client.items import ItemBuilder
from prefixq.client.layout import Layout
from prefixq.client.order import ORDERS, enqueue_order, peeks
from prefixq.client.request_file import RequestFile
from prefixq.core.checks import callback_path
from prefixq.core.entries import split_prefix
from prefixq.core.errors import BurstIdTaken, ValidationError
from prefixq.core.inputs import IdCheck, normalize_one
from prefixq.core.keys import Keys
from prefixq.core.openai_lines import is_openai_line
from prefixq.core.records import Request
from prefixq.core.settings import Settings
from prefixq.core.sharing import check_priority, check_tenant
from prefixq.store.burst_end import OnBurstDone, acancel
from prefixq.store.census import count_enqueued
from prefixq.store.connection import (
    TRANSIENT,
    adescribe,
    async_client,
    is_cluster,
    lua,
    transient,
)
from prefixq.store.deployment import aresolve_shards
from prefixq.store.fence import afence
from prefixq.store.retry import Backoff

log = logging.getLogger(__name__)

#: requests sent before the rest of the burst is even validated: a few, so that the engines
#: have a first step's work within milliseconds (each engine then reads the rest as it comes)
HEAD = 4
#: requests per chunk after the head grow 4x per chunk up to this
_CHUNK = 1024
#: burst index entries a submit looks at for pruning (the oldest)
_PRUNE = 32

#: seconds a submit on a Redis Cluster keeps sending a chunk through a failover (`_execute`):
#: a replica is promoted within about twice ``cluster-node-timeout``
RIDE_THROUGH_S = 30.0
#: request ids per RPUSH of the burst's id list
_IDS_CHUNK = 10_000
#: seconds a staged id list lives if its producer dies before the create call (Keys.staged_ids)
_STAGED_TTL_S = 3600
#: new ids a submit tries when the one it made is taken (two producers in the same second drew
#: the same 6 random hex digits: at tens of bursts a second, a matter of days)
_NEW_ID_ATTEMPTS = 5
_BURST_ID = re.compile(r"[A-Za-z0-9_.:@+-]{1,200}")
#: called with (requests enqueued so far, total)
Progress = Callable[[int, int], None]


def check_burst_id(burst: str) -> str:
    """``burst`` if it is a usable burst id: 1-200 of letters, digits and ``_.:@+-`` (no braces:
    a burst's keys share one Cluster hash tag built from it; no spaces or control characters:
    it is printed and typed). ValidationError otherwise."""
    if not isinstance(burst, str) or not _BURST_ID.fullmatch(burst):
        raise ValidationError(
            f"burst id {burst!r} must be 1-200 characters of letters, digits and _.:@+-"
        )
    return burst


def raw_id(raw: Request | Mapping[str, Any], index: int) -> str:
    """The id request ``index`` of a burst gets once parsed (`Request.from_json`: ``custom_id`` of
    an OpenAI batch line, else ``id``, else its index), read without parsing it."""
    if isinstance(raw, Request):
        return raw.id
    rid = raw.get("custom_id") if is_openai_line(raw) else raw.get("id")
    return str(index) if rid is None else str(rid)


def new_burst_id() -> str:
    """Sortable and unique: UTC time plus 6 random hex digits."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


class Producer:
    """Submits bursts. ``submit`` blocks; ``asubmit`` is the same inside an event loop."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        tokenizer: Any = None,
        model: str = "",
        on_burst_done: OnBurstDone | None = None,
    ) -> None:
        self.settings = settings or Settings.from_env()
        #: runs when a cancel ends a burst: that of a submit that failed midway, and those of the
        #: `Burst` handles returned (the burst's ``on_complete``: `prefixq submit` and `run_burst`
        #: pass prefixq.integrations.rq_callbacks.RQ_ON_COMPLETE)
        self.on_burst_done = on_burst_done
        self.keys = Keys(self.settings.namespace)
        self.items = ItemBuilder(self.settings, tokenizer=tokenizer, model=model)
        #: the connection kept inside ``async with``; the deployment's shard count and engine block
        #: size as Redis recorded them (they never change once recorded)
        self._kept: aredis.Redis | None = None
        self._kept_loop: asyncio.AbstractEventLoop | None = None  # the loop it belongs to
        self._shards = 0
        self._block = 0

    def submit(self, requests: Iterable[Request | Mapping[str, Any]], **options: Any) -> Burst:
        """Enqueue a burst; returns its `Burst` handle (``str(burst)`` is its id). Options as for
        `asubmit`.

        Called where an event loop runs already (a notebook, an async service), it submits from
        a thread of its own and blocks the caller until the burst is enqueued; ``await
        asubmit(...)`` does not block the loop."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.asubmit(requests, **options))
        with ThreadPoolExecutor(1, thread_name_prefix="prefixq-submit") as pool:
            return pool.submit(asyncio.run, self.asubmit(requests, **options)).result()

    async def asubmit(
        self,
        requests: Iterable[Request | Mapping[str, Any]],
        *,
        burst_id: str | None = None,
        placement: str | Placer | None = None,
        on_complete: str | None = None,
        rq_queue: str | None = None,
        progress: Progress | None = None,
        seed: int | None = None,
        deadline: float | None = None,
        metadata: Mapping[str, str] | None = None,
        order: str | None = None,
        priority: str | None = None,
        tenant: str | None = None,
    ) -> Burst:
        """Validate, place and enqueue ``requests``; returns the burst's `Burst` handle.

        ``placement`` overrides the setting (a name, or a `Placer` of your own);
        ``on_complete`` ("pkg.module:func") is enqueued as an RQ job on ``rq_queue`` with the
        burst id once the burst's last request is recorded. ``deadline`` (epoch seconds): requests
        not admitted by then get an expired result. ``metadata``: string pairs kept on the burst
        record (field ``metadata``, JSON). ``order``: the enqueue order (`ORDERS`; default the
        ``enqueue_order`` setting). ``priority`` (high, normal, low) and ``tenant``: how the burst
        shares the workers with others (default: the settings' ``priority`` and ``tenant``;
        prefixq.core.sharing).
        """
        s = self.settings
        order = order or s.enqueue_order
        if isinstance(requests, str | bytes | Mapping | Request):
            raise ValidationError(
                "submit takes a list (an iterable) of requests, not one "
                f"{type(requests).__name__}: wrap a single request in a list"
            )
        if not isinstance(requests, Iterable):  # an int, an async generator, None
            raise ValidationError(
                f"submit takes a list (an iterable) of requests, not {type(requests).__name__}"
            )
        raw: Sequence[Request | Mapping[str, Any]]
        if isinstance(requests, RequestFile):  # checked already, read again chunk by chunk
            raw = requests
        else:
            raw = list(requests)
            for i, x in enumerate(raw):  # the rest is validated after the head went out
                if not isinstance(x, Mapping | Request):
                    raise ValidationError(
                        f"line {i + 1}: expected a JSON object, got {type(x).__name__}"
                    )
        if not raw:
            raise ValidationError("the burst is empty")
        if order not in ORDERS:
            raise ValidationError(f"order must be one of {', '.join(ORDERS)}, not {order!r}")
        if on_complete is not None:
            if not isinstance(on_complete, str):
                raise ValidationError(
                    f"on_complete must look like 'package.module:function', not {on_complete!r}"
                )
            callback_path(on_complete)  # ValidationError unless dotted names around one colon
        if rq_queue is not None and (not isinstance(rq_queue, str) or not rq_queue.strip()):
            raise ValidationError(f"rq_queue must be an RQ queue name, not {rq_queue!r}")
        meta: dict[str, Any] = {
            "priority": check_priority(s.priority if priority is None else priority),
            "tenant": check_tenant(s.tenant if tenant is None else tenant),
        }
        if deadline is not None:
            if isinstance(deadline, bool) or not isinstance(deadline, int | float):
                raise ValidationError(f"deadline must be epoch seconds, not {deadline!r}")
            if not math.isfinite(deadline):
                raise ValidationError(f"deadline must be finite epoch seconds, not {deadline!r}")
            meta["deadline"] = deadline
        if metadata is not None and not isinstance(metadata, Mapping):
            raise ValidationError(f"metadata must map strings to strings, not {metadata!r}")
        if progress is not None and not callable(progress):
            raise ValidationError(f"progress must be a function (done, total), not {progress!r}")
        if (
            placement is not None
            and not isinstance(placement, str)
            and not callable(getattr(placement, "place", None))
        ):
            raise ValidationError(f"placement must be a name or a Placer, not {placement!r}")
        if metadata:
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
                raise ValidationError("metadata must map strings to strings")
            meta["metadata"] = json.dumps(dict(metadata), ensure_ascii=False)
        if on_complete:
            meta["on_complete"] = on_complete
            meta["rq_queue"] = rq_queue or "default"
        kept = self._kept if self._kept_loop is asyncio.get_running_loop() else None
        r = kept if kept is not None else async_client(s)
        try:
            for attempt in range(_NEW_ID_ATTEMPTS):
                burst = new_burst_id() if burst_id is None else check_burst_id(burst_id)
                sub = _Submission(self, r, raw, burst, meta, progress)
                try:
                    burst = await sub.run(placement or s.placement, seed, order)
                    return Burst(burst, s, on_burst_done=self.on_burst_done)
                except BurstIdTaken:  # nothing written yet: a new id of ours is tried again
                    if burst_id is not None or attempt + 1 == _NEW_ID_ATTEMPTS:
                        raise
            raise AssertionError("unreachable")
        except (*TRANSIENT, RedisError) as e:  # ours, with a hint (one exception root)
            raise await adescribe(s, e, r) from e
        finally:
            if kept is None:
                await r.aclose()

    async def __aenter__(self) -> Producer:
        """``async with Producer(s) as p:`` keeps one connection for every `asubmit` inside,
        so a burst starts without connecting first (an upstream service, the benchmark)."""
        self._kept = async_client(self.settings)
        self._kept_loop = asyncio.get_running_loop()
        return self

    async def __aexit__(self, *exc: object) -> None:
        kept, self._kept, self._kept_loop = self._kept, None, None
        if kept is not None:
            await kept.aclose()

    async def shards(self, r: aredis.Redis) -> int:
        """The deployment's shard count (read once)."""
        if not self._shards:
            self._shards = await aresolve_shards(r, self.settings)
        return self._shards

    async def placer(self, r: aredis.Redis, name: str | Placer, seed: int | None) -> Placer:
        """The placement strategy ``name`` (or ``name`` itself, a `Placer`)."""
        if not isinstance(name, str):
            return name
        if name == "affinity":
            if not self._block:
                self._block = int(await r.hget(self.keys.config, "block_size") or 0)
            return AffinityPlacer(self.settings, engine_block=self._block)
        if name == "random":
            return RandomPlacer(seed)
        if name == "round-robin":
            return RoundRobinPlacer()
        if name == "hash":
            return HashPlacer()
        raise ValidationError(f"unknown placement {name!r} (affinity, hash, random, round-robin)")


class _Submission:
    """One burst on its way in (`Producer.asubmit`)."""

    def __init__(
        self,
        producer: Producer,
        r: aredis.Redis,
        raw: Sequence[Request | Mapping[str, Any]],
        burst: str,
        meta: dict[str, Any],
        progress: Progress | None,
    ) -> None:
        self.p, self.s, self.keys, self.r = producer, producer.settings, producer.keys, r
        #: a Redis Cluster client: the prefixes go in a pipeline of their own (`_send`)
        self.cluster = is_cluster(r)
        self.raw, self.burst, self.meta, self.progress = raw, burst, meta, progress
        self.n = len(raw)
        #: a file checked as a whole already, whose requests are read again as they are encoded
        self.file = raw if isinstance(raw, RequestFile) else None
        #: each request's prefix fingerprint when its prefix is long enough to store once
        self.prefix_keys: list[Hashable | None] = []
        #: requests validated and not sent yet (each is dropped once its entry is sent)
        self.reqs: list[Request | None] = [None] * self.n
        self.parts: list[Parts | None] = [None] * self.n
        self.ids = IdCheck()
        self.enc = EntryEncoder(self.s, burst=burst, enqueued=time.time())
        self.enc.deadline = meta.get("deadline")
        self.enc.priority, self.enc.tenant = meta["priority"], meta["tenant"]
        self.layout = Layout(self.keys, burst, meta["priority"], meta["tenant"])
        self.per_shard: Counter[int] = Counter()
        #: requests whose pipeline Redis acknowledged; requests of the pipeline awaiting its reply
        self.sent = 0
        self.sending = 0
        self.shards = 0
        self.created = False
        #: tells this submission's create apart from another producer's of the same burst id
        self.token = secrets.token_hex(8)

    async def run(self, placement: str | Placer, seed: int | None, order: str) -> str:
        shards = self.shards = await self.p.shards(self.r)
        placer = await self.p.placer(self.r, placement, seed)
        looks = self.file.peeks(order) if self.file is not None else peeks(self.raw, order)
        perm = enqueue_order(order, looks)
        long_enough = self.enc.long_enough
        self.prefix_keys = [p.group if long_enough(p.size) else None for p in looks]
        del looks
        head, rest = perm[:HEAD], perm[HEAD:]
        self._validate(head)
        head_chunk = await self._encode(head, placer, shards, inline=True)
        await self._create(shards, placement, order)
        try:
            await self._send(head, head_chunk, first=True)
            if self.file is None:  # a file was checked whole before anything was sent
                self._validate(rest)
            self.enc.count(self.prefix_keys)
            size, start = 4 * HEAD, 0
            while start < len(rest):
                chunk = rest[start : start + size]
                self._validate(chunk)  # a file's: read again now
                await self._send(chunk, await self._encode(chunk, placer, shards))
                start, size = start + len(chunk), min(4 * size, _CHUNK)
            # min_replicas_acked: the replicas hold every entry and the record before submit
            # returns (the writes go to every master: entries, prefixes, record, indexes)
            await afence(self.r, self.s)
        except Exception as e:  # ours, Redis's, or a bug: never a created burst left half sent
            await self._abandon(e)
            raise
        await self._finish(shards)
        return self.burst

    # ---- steps -------------------------------------------------------------------------------
    def _validate(self, idx: Sequence[int]) -> None:
        """Validate (and parse) requests ``idx`` not validated yet: each on its own (its entry's
        size included: `entries.check_size`), and its id across the burst; a checked file's are
        only read again."""
        for i in idx:
            if self.reqs[i] is not None:
                continue
            if self.file is not None:
                q = self.file[i]
            else:
                q = normalize_one(self.raw[i], i, self.s)  # its entry's size too
                self.ids.add(i, [q.id])
            self.reqs[i], self.parts[i] = q, split_prefix(q)

    async def _encode(
        self, idx: Sequence[int], placer: Placer, shards: int, *, inline: bool = False
    ) -> tuple[Encoded, list[Placed]]:
        """Place and encode requests ``idx`` (validated)."""
        reqs, parts = self._validated(idx)
        items = [self.p.items.build(q, p[0]) for q, p in zip(reqs, parts, strict=True)]
        placed = await placer.place(self.r, items, shards)
        encoded = Encoded()
        keys = self.prefix_keys
        for q, part, pl, i in zip(reqs, parts, placed, idx, strict=True):
            # indexes need not touch
            one = self.enc.encode([q], [part], [pl], i, keys=[keys[i]], inline=inline)
            encoded.new_prefixes.update(one.new_prefixes)
            for shard, rows in one.by_shard.items():
                encoded.by_shard.setdefault(shard, []).extend(rows)
        return encoded, placed

    def _validated(self, idx: Sequence[int]) -> tuple[list[Request], list[Parts]]:
        reqs, parts = [], []
        for i in idx:
            q, p = self.reqs[i], self.parts[i]
            assert q is not None and p is not None, f"request {i} not validated"
            reqs.append(q)
            parts.append(p)
        return reqs, parts

    async def _create(self, shards: int, placement: str | Placer, order: str) -> None:
        """The burst record and its id list, once, in one round trip (BurstIdTaken, a
        ValidationError, if the id is taken)."""
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
        staged = keys.staged_ids(self.burst, self.token)
        ids = self._ids()
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(staged)  # a pipeline the client sends again starts the list afresh
        for start in range(0, len(ids), _IDS_CHUNK):
            pipe.rpush(staged, *ids[start : start + _IDS_CHUNK])
        pipe.expire(staged, _STAGED_TTL_S)
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

    async def _send(
        self, idx: Sequence[int], chunk: tuple[Encoded, list[Placed]], *, first: bool = False
    ) -> None:
        """One pipeline: new prefixes (SET NX + TTL, before the entries that refer to them), the
        entries (to the intakes and the lanes: layout.py) and the shards' load counters; with the
        head, the ids and the burst indexes."""
        encoded, placed = chunk
        keys, ttl = self.keys, self.s.prefix_ttl_s

        def prefixes(pipe: Any) -> None:
            for ref, value in encoded.new_prefixes.items():
                pipe.set(keys.prefix(ref), value, nx=True, ex=ttl)
                pipe.expire(keys.prefix(ref), ttl)

        def entries(pipe: Any) -> None:
            self.layout.add(pipe, encoded.by_shard, first=first)
            if first:
                pipe.zadd(keys.bursts, {self.burst: self.enc.enqueued})
                if "deadline" in self.meta:
                    pipe.zadd(keys.deadlines, {self.burst: self.meta["deadline"]})

        def both(pipe: Any) -> None:
            prefixes(pipe)
            entries(pipe)

        self.sending = len(idx)
        if self.cluster and encoded.new_prefixes:
            # the prefix keys live in other slots (other masters) than the streams, and a cluster
            # pipeline sends to each master at once: the prefixes are written (answered) first,
            # so an entry never reaches a worker before the prefix it refers to (ordering in
            # place of one pipeline's order)
            stored = await self._execute(prefixes, idx)
            replies = [*stored, *await self._execute(entries, idx)]
        else:
            replies = await self._execute(both, idx)
        self.sending = 0  # answered: what was refused is raised below, and was not written
        for x in replies:  # a lane left behind by an expired burst of the same id keeps its group
            if isinstance(x, Exception) and "BUSYGROUP" not in str(x):
                raise x
        fresh = [bool(x) for x in replies[: 2 * len(encoded.new_prefixes) : 2]]
        self.enc.stored(encoded.new_prefixes, fresh)
        self.per_shard.update(p.shard for p in placed)
        for i in idx:  # sent: what a submit holds stays one chunk of parsed requests
            self.reqs[i] = self.parts[i] = None
        self.sent += len(idx)
        if self.progress:
            self.progress(self.sent, self.n)

    def _held(self, counted: int) -> str:
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

    async def _execute(self, build: Callable[[Any], None], idx: Sequence[int]) -> list[Any]:
        """The replies of a pipeline that ``build`` fills. On a Redis Cluster an error a failover
        causes (the master gone, CLUSTERDOWN or TRYAGAIN while its replica is promoted, a slot
        moved) sends the pipeline again, for up to `RIDE_THROUGH_S`, with one log line per
        outage: the submit rides through. What the failed try wrote stays: a request of it may
        be enqueued twice, and still gets one result (record_result.lua keeps the first; the
        other is acked unrecorded). On a single Redis an error is raised at once (`_abandon`)."""
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
            first, last = self.sent + 1, self.sent + len(idx)
            await backoff.wait(f"burst {self.burst}: sending requests {first}-{last}", err)

    def _ids(self) -> list[str]:
        """The burst's request ids in input order (a checked file's, or each request's: parsed
        already, or the id its parse will give it, since a cancel may need them before they are
        validated)."""
        if self.file is not None:
            return list(self.file.ids)
        return [self._raw_id(i) for i in range(self.n)]

    def _raw_id(self, i: int) -> str:
        q = self.reqs[i]
        return q.id if q is not None else raw_id(self.raw[i], i)

    async def _finish(self, shards: int) -> None:
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

    async def _abandon(self, err: BaseException) -> None:
        """A request refused, or Redis failed, after the head was sent: cancel the burst as a
        whole (its remaining requests get cancelled results) and say so in the error, with the
        number of its requests Redis really holds (store/census.py: a pipeline Redis processed
        in part before the connection dropped counts too), or, when Redis cannot be asked, the
        bounds the producer knows."""
        if not self.created:
            return
        log.error(
            "burst %s: submit failed after %d of %d requests: %s",
            self.burst,
            self.sent,
            self.n,
            err,
        )
        enqueued: int | None = None
        try:
            enqueued = await count_enqueued(
                self.r,
                self.s,
                self.burst,
                shards=self.shards,
                priority=self.layout.info.priority,
                created=self.enc.enqueued,
            )
            done = self.p.on_burst_done
            await acancel(self.burst, self.s, self.r, on_burst_done=done.adone if done else None)
            if self.layout.lanes:
                pipe = self.r.pipeline(transaction=False)
                self.layout.seal(pipe)
                await pipe.execute()
            note = (
                f"; {self._held(enqueued)} had been enqueued, so burst {self.burst} "
                "was cancelled as a whole (what already finished keeps its result)"
            )
        except Exception as e:  # Redis itself may be what failed
            log.error("could not cancel burst %s: %s", self.burst, e)
            if enqueued is not None:
                part = self._held(enqueued)
            elif self.sending:  # Redis may have processed part of the pipeline it never answered
                first, last = self.sent + 1, self.sent + self.sending
                part = (
                    f"at least {self.sent} and at most {last} of its {self.n} requests: Redis "
                    f"stopped answering while requests {first}-{last} were being sent"
                )
            else:
                part = f"{self.sent} of its {self.n} requests"
            note = (
                f"; burst {self.burst} is partly enqueued ({part}) and could not be cancelled: "
                f"run `prefixq cancel {self.burst}`"
            )
        if err.args:
            err.args = (f"{err.args[0]}{note}", *err.args[1:])
