"""`Producer`: a burst in, entries on the shards' streams out — its head first.

`Producer.asubmit` checks its arguments (submit_args.py), then validates, places and encodes the
burst's head (its first `HEAD` requests in enqueue order: burst_requests.py), creates the burst
record with the ids of all its requests (enqueue.py, lua/create_burst.lua: an id is taken once,
and a burst never exists without its ids), sends the head, and only then validates, places and
sends the rest in growing chunks (`_Submission.run`), so that the engines start within
milliseconds whatever the burst's size. Where the entries go is layout.py's; the enqueue order is
order.py's. The invariant to keep: once the record exists, no failure may leave the burst half
sent (`_Submission._abandon` cancels it as a whole); before that, a refusal leaves nothing behind.
docs/architecture.md, "The producer: the head first", has the steps, the failure cases and the
measured start. A `RequestFile` (request_file.py) was checked whole before anything is sent and
is read again chunk by chunk; every request is dropped once its entry is sent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import RedisError, ResponseError

from prefixq.affinity.placement import HashPlacer, Placed, Placer, RandomPlacer, RoundRobinPlacer
from prefixq.affinity.prefix_map import AffinityPlacer
from prefixq.affinity.serving import for_task
from prefixq.client.burst import Burst
from prefixq.client.burst_requests import BurstRequests
from prefixq.client.encoding import Encoded, EntryEncoder
from prefixq.client.enqueue import BurstWriter
from prefixq.client.items import ItemBuilder
from prefixq.client.layout import Layout
from prefixq.client.order import enqueue_order, peeks
from prefixq.client.shared_pass import PASS_ORDERS, arrangement
from prefixq.client.submit_args import (
    Progress,
    check_burst_id,
    check_options,
    check_requests,
    new_burst_id,
)
from prefixq.core.errors import BurstIdTaken, ValidationError
from prefixq.core.keys import Keys
from prefixq.core.records import Request
from prefixq.core.settings import Settings
from prefixq.store.burst_end import OnBurstDone, acancel
from prefixq.store.census import count_enqueued
from prefixq.store.connection import async_client
from prefixq.store.deployment import aresolve_shards
from prefixq.store.liveness import placement_types, read_tasks, repaired
from prefixq.store.redis_errors import TRANSIENT, adescribe
from prefixq.store.webhook_outbox import watch_burst

log = logging.getLogger(__name__)

#: requests sent before the rest of the burst is even validated: a few, so that the engines
#: have a first step's work within milliseconds (each engine then reads the rest as it comes)
HEAD = 4
#: requests per chunk after the head grow 4x per chunk up to this
_CHUNK = 1024
#: new ids a submit tries when the one it made is taken (two producers in the same second drew
#: the same 6 random hex digits: at tens of bursts a second, a matter of days)
_NEW_ID_ATTEMPTS = 5


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
            running = False
        else:
            running = True
        if not running:  # outside the except: its errors do not chain "no running event loop"
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
        on_complete_url: str | None = None,
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
        burst id once the burst's last request is recorded; ``on_complete_url`` (http(s)) is sent
        a signed ``batch.completed``, ``batch.cancelled`` or ``batch.expired`` webhook once the
        burst ends (docs/operations.md, "Receiving webhooks"). ``deadline`` (epoch seconds):
        requests not admitted by then get an expired result. ``metadata``: string pairs kept on
        the burst record (field ``metadata``, JSON). ``order``: the enqueue order (`ORDERS`;
        default the ``enqueue_order`` setting). ``priority`` (high, normal, low) and ``tenant``:
        how the burst shares the workers with others (default: the settings' ``priority`` and
        ``tenant``; prefixq.core.sharing).
        """
        s = self.settings
        order = order or s.enqueue_order
        raw = check_requests(requests)
        meta = check_options(
            s,
            order=order,
            placement=placement,
            on_complete=on_complete,
            rq_queue=rq_queue,
            on_complete_url=on_complete_url,
            progress=progress,
            deadline=deadline,
            metadata=metadata,
            priority=priority,
            tenant=tenant,
        )
        kept = self._kept if self._kept_loop is asyncio.get_running_loop() else None
        r = kept if kept is not None else async_client(s)
        try:
            for attempt in range(_NEW_ID_ATTEMPTS):
                burst = new_burst_id() if burst_id is None else check_burst_id(burst_id)
                if on_complete_url:  # a deliverer sends its webhook whoever ends it
                    await watch_burst(r, s, burst)
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
        """The deployment's shard count, read for each burst: it grows when a worker joins
        (`prefixq worker --join`)."""
        return await aresolve_shards(r, self.settings)

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
    """One burst on its way in (`Producer.asubmit`): its requests (burst_requests.py) and its
    writes (enqueue.py), in the order that starts the engines first and never leaves a created
    burst half sent."""

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
        self.burst, self.meta, self.progress = burst, meta, progress
        self.n = len(raw)
        self.enc = EntryEncoder(self.s, burst=burst, enqueued=time.time())
        self.enc.deadline = meta.get("deadline")
        self.enc.priority, self.enc.tenant = meta["priority"], meta["tenant"]
        self.layout = Layout(self.keys, burst, meta["priority"], meta["tenant"])
        self.requests = BurstRequests(raw, self.s, r=r, items=producer.items, enc=self.enc)
        self.writer = BurstWriter(
            r, self.s, self.keys, burst, n=self.n, meta=meta, enc=self.enc, layout=self.layout
        )
        self.shards = 0

    async def _place_head(
        self, head: list[int], placer: Placer, shards: int
    ) -> tuple[Placer, tuple[Encoded, list[Placed]]]:
        """The burst's placer, on the shards that serve its kind of work (refused here when none
        does), and its first requests placed and encoded."""
        reqs = self.requests
        tasks = await read_tasks(self.r, self.keys, shards)
        placer = for_task(placer, reqs.task or "generate", tasks, self.s)
        return placer, await reqs.encode(head, placer, shards, inline=True)

    async def run(self, placement: str | Placer, seed: int | None, order: str) -> str:
        shards = self.shards = await self.p.shards(self.r)
        placer = await self.p.placer(self.r, placement, seed)
        reqs = self.requests
        looks = reqs.file.peeks(order) if reqs.file is not None else peeks(reqs.raw, order)
        long_enough = self.enc.long_enough
        reqs.prefix_keys = [p.group if long_enough(p.size) else None for p in looks]
        # counted before the head, which then marks only the groups that others share, and
        # before the arrangement, which follows the same groups
        self.enc.count(reqs.prefix_keys)
        arrange = None
        if order in PASS_ORDERS:  # several bursts over one corpus walk it together
            arrange = await arrangement(self.r, self.s, self.keys, looks, self.enc.uses, shards)
        perm = enqueue_order(order, looks, arrange)
        del looks
        head, rest = perm[:HEAD], perm[HEAD:]
        reqs.validate(head)
        try:
            placer, head_chunk = await self._place_head(head, placer, shards)
        except ResponseError as err:  # a hint's key of another type: replaced, placed again
            if not await repaired(self.r, err, placement_types(self.keys)):
                raise
            placer, head_chunk = await self._place_head(head, placer, shards)
        if arrange is not None:
            arrange.placed(head, head_chunk[1])
        try:
            # a create that raises after the record was written (its deadline's index refused)
            # leaves a burst to cancel like any other
            await self._create(shards, placement, order)
            await self._send(head, head_chunk, first=True)
            if reqs.file is None:  # a file was checked whole before anything was sent
                reqs.validate(rest)
            size, start = 4 * HEAD, 0
            while start < len(rest):
                chunk = rest[start : start + size]
                reqs.validate(chunk)  # a file's: read again now
                encoded = await reqs.encode(chunk, placer, shards)
                if arrange is not None:
                    arrange.placed(chunk, encoded[1])
                await self._send(chunk, encoded)
                start, size = start + len(chunk), min(4 * size, _CHUNK)
            await self.writer.fence()  # min_replicas_acked: every write, read back
        except Exception as e:  # ours, Redis's, or a bug: never a created burst left half sent
            await self._abandon(e)
            raise
        await self.writer.finish(shards)
        if arrange is not None:  # where its groups went: the next burst's groups follow them
            await arrange.remember(self.r, self.keys)
        return self.burst

    # ---- steps -------------------------------------------------------------------------------
    async def _create(self, shards: int, placement: str | Placer, order: str) -> None:
        """The burst record and its id list, once, in one round trip (BurstIdTaken, a
        ValidationError, if the id is taken)."""
        await self.writer.create(self.requests.id_list(), shards, placement, order)

    async def _send(
        self, idx: Sequence[int], chunk: tuple[Encoded, list[Placed]], *, first: bool = False
    ) -> None:
        """Requests ``idx``'s pipeline (`BurstWriter.send`; with the head, the burst indexes);
        once it is answered they are dropped, and ``progress`` hears of them."""
        await self.writer.send(len(idx), chunk, first=first)
        self.requests.drop(idx)
        if self.progress:
            self.progress(self.writer.sent, self.n)

    async def _abandon(self, err: BaseException) -> None:
        """A request refused, or Redis failed, after the head was sent: cancel the burst as a
        whole (its remaining requests get cancelled results) and say so in the error, with the
        number of its requests Redis really holds (store/census.py: a pipeline Redis processed
        in part before the connection dropped counts too), or, when Redis cannot be asked, the
        bounds the producer knows."""
        w = self.writer
        if not w.created:
            return
        log.error(
            "burst %s: submit failed with %d of its %d requests confirmed sent: %s",
            self.burst,
            w.sent,
            self.n,
            err,
        )
        enqueued: int | None = None
        try:  # apart from the cancel: a count Redis refuses must not leave the burst queued
            enqueued = await count_enqueued(
                self.r,
                self.s,
                self.burst,
                shards=self.shards,
                priority=self.layout.info.priority,
                created=self.enc.enqueued,
            )
        except Exception as e:
            log.warning("burst %s: its enqueued requests could not be counted: %s", self.burst, e)
        part = w.held(enqueued) if enqueued is not None else self._sent_bounds()
        try:
            done = self.p.on_burst_done
            await acancel(self.burst, self.s, self.r, on_burst_done=done.adone if done else None)
            if self.layout.lanes:
                pipe = self.r.pipeline(transaction=False)
                self.layout.seal(pipe)
                await pipe.execute()
            note = (
                f"; {part} had been enqueued, so burst {self.burst} "
                "was cancelled as a whole (what already finished keeps its result)"
            )
        except Exception as e:  # Redis itself may be what failed
            log.error("could not cancel burst %s: %s", self.burst, e)
            note = (
                f"; burst {self.burst} is partly enqueued ({part}) and could not be cancelled: "
                f"run `prefixq cancel {self.burst}`"
            )
        if err.args:
            err.args = (f"{err.args[0]}{note}", *err.args[1:])

    def _sent_bounds(self) -> str:
        """What Redis may hold of the burst when it cannot be asked: the bounds the producer
        knows (a pipeline Redis processed in part before it stopped answering counts too)."""
        w = self.writer
        if w.sending:
            first, last = w.sent + 1, w.sent + w.sending
            return (
                f"at least {w.sent} and at most {last} of its {self.n} requests: Redis "
                f"stopped answering while requests {first}-{last} were being sent"
            )
        return f"{w.sent} of its {self.n} requests"
