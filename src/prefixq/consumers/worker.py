"""The long-lived consumer of one shard: stream -> engine -> results, with continuous admission.

Lifecycle: connect, join the consumer group, start and warm the engine, freeze the heap, then
  * the reader keeps up to ``max_inflight`` requests inside the engine, reading more as each
    finishes (one XREADGROUP per refill; its own pending entries first, after a restart);
  * each request is handed to the engine as soon as it is read;
  * the writer records finished results in pipelined groups (exactly once per request, Lua), then
    XACKs and XDELs their entries;
  * the heartbeat renews a TTL'd health key and re-claims in-flight entries so that they never look
    idle to the reclaimer of another worker; the reclaimer takes over entries idle on dead workers
    and dead-letters those delivered ``max_attempts`` times.
``stop()`` (SIGTERM) stops reading, lets in-flight requests finish within ``grace_s``, writes and
acks their results; what did not finish stays pending for a restart or a reclaim. An engine death
leaves in-flight entries pending (not failed) and exits with code 3.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Any

import redis.asyncio as aredis
from redis.exceptions import ResponseError

from prefixq import wire
from prefixq.connection import TRANSIENT, Backoff, async_client, describe, refused
from prefixq.consumers.backlog import replay_backlog
from prefixq.consumers.control import control_loop
from prefixq.consumers.deadletters import carried
from prefixq.consumers.engine import Engine, EngineRequest
from prefixq.consumers.gcwatch import GcWatch
from prefixq.consumers.heap import Heap
from prefixq.consumers.heartbeat import Heartbeat
from prefixq.consumers.prefixes import PrefixCache
from prefixq.consumers.reclaim import Reclaimer
from prefixq.consumers.solo import SoloGate
from prefixq.consumers.writer import ResultWriter
from prefixq.entries import Entry
from prefixq.errors import EngineDead, EngineError, PrefixqError
from prefixq.keys import FIELD, GROUP, Keys
from prefixq.records import Result
from prefixq.rq_jobs import completion_hook
from prefixq.settings import Settings

if TYPE_CHECKING:
    from prefixq.metrics import WorkerMetrics

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_ENGINE_DEAD = 3


def default_name(shard: int, gpu: str | None) -> str:
    """Stable per host, shard and GPU, so a restarted worker resumes its own pending entries."""
    return f"{socket.gethostname()}-s{shard}-{'gpu' + gpu if gpu else 'cpu'}"


class Worker:
    """Drains shard ``shard`` into ``engine``. One per GPU; run with `run()`."""

    def __init__(
        self,
        settings: Settings,
        shard: int,
        engine: Engine,
        *,
        name: str = "",
        gpu: str | None = None,
        redis: aredis.Redis | None = None,
    ) -> None:
        self.settings = settings
        self.shard = shard
        self.engine = engine
        self.name = name or default_name(shard, gpu)
        self.gpu = gpu
        self.keys = Keys(settings.namespace)
        self.stream = self.keys.stream(shard)
        self.limits = wire.Limits.from_settings(settings)
        self.r = redis or async_client(settings)
        self.max_inflight = settings.max_inflight
        self.inflight: dict[bytes, asyncio.Task[None]] = {}
        self.counts = {"admitted": 0, "finished": 0, "failed": 0, "dead": 0, "reclaimed": 0}
        self.started = time.time()
        self.engine_up = False
        self.gc = GcWatch()
        #: Prometheus metrics; set by `prefixq.metrics.MetricsExporter`, None when disabled
        self.metrics: WorkerMetrics | None = None
        self._stopping = asyncio.Event()
        self._room = asyncio.Event()
        #: entries on their last allowed delivery run alone (consumers/solo.py)
        self.gate = SoloGate()
        self._dead: str | None = None
        self.prefixes = PrefixCache(self.r, self.keys, self.limits, settings.prefix_cache_entries)
        #: the GC policy (consumers/heap.py); the control stream turns freezing off and on
        self.heap = Heap(self.gc, enabled=settings.gc_freeze)
        self.writer = ResultWriter(self)
        self.writer.on_burst_done.append(completion_hook(self.r, settings))
        self.reclaimer = Reclaimer(self)
        self.heartbeat = Heartbeat(self)

    # ---- lifecycle -------------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        """`stop()` was called (or the engine died): no more reading."""
        return self._stopping.is_set()

    @property
    def serving(self) -> bool:
        """The engine is up and alive."""
        return self.engine_up and self._dead is None

    def stop(self) -> None:
        """Stop reading; in-flight requests get ``grace_s`` to finish."""
        if not self._stopping.is_set():
            log.info("worker %s stopping (grace %.0fs)", self.name, self.settings.grace_s)
        self._stopping.set()

    async def run(self) -> int:
        """Serve until `stop()` or engine death; returns the process exit code."""
        await self._join_group()
        await self.engine.start()
        await self._record_engine()
        if not self.max_inflight:
            self.max_inflight = max(2 * self.engine.max_num_seqs, 1)
        await self._warm_up()
        self.engine_up = True
        tasks = [
            asyncio.create_task(c, name=n)
            for n, c in (
                ("writer", self.writer.run()),
                ("heartbeat", self.heartbeat.run()),
                ("reclaim", self.reclaimer.run()),
                ("control", control_loop(self)),
            )
        ]
        try:
            await self.reclaimer.dead_letter_over_limit(self.name)
            await self._read_loop()
            await self._drain()
        finally:
            await self.writer.close()
            await _cancel(tasks)
            await self.heartbeat.unregister()
            self.gc.stop()
            await self.engine.close()
            await self.r.aclose()
        if self._dead:
            log.error("worker %s exits: %s", self.name, self._dead)
            return EXIT_ENGINE_DEAD
        return EXIT_OK

    async def _join_group(self) -> None:
        backoff = Backoff()
        while True:
            try:
                await self.r.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
            except ResponseError as e:
                if refused(e):
                    raise describe(self.settings, e) from e
                if "BUSYGROUP" not in str(e):
                    raise
            except TRANSIENT as e:
                if refused(e):  # wrong credentials or CA: retrying cannot help
                    raise describe(self.settings, e) from e
                await backoff.wait("joining the consumer group", e)
                continue
            if self.settings.shards:
                await self.r.hsetnx(self.keys.config, "shards", self.settings.shards)
            return

    async def _record_engine(self) -> None:
        """Tell producers the engine's KV block size (predicted hits are rounded to it)."""
        await self.r.hset(self.keys.config, "block_size", self.engine.block_size)

    async def _warm_up(self) -> None:
        t0 = time.perf_counter()
        await self.engine.generate(
            EngineRequest(
                request_id=f"warmup-{self.name}-{os.getpid()}",
                prompt_token_ids=[1] * 8,
                sampling={"max_tokens": 2, "ignore_eos": True},
            )
        )
        await self.engine.reset_prefix_cache()
        if self.heap.enabled:
            self.heap.freeze()
        self.gc.start()
        log.info(
            "worker %s warm in %.2fs; max_inflight=%d; serving %s",
            self.name,
            time.perf_counter() - t0,
            self.max_inflight,
            self.stream,
        )

    async def _drain(self) -> None:
        pending = list(self.inflight.values())
        if pending:
            log.info("draining %d in-flight requests", len(pending))
            _, late = await asyncio.wait(pending, timeout=self.settings.grace_s)
            for t in late:
                t.cancel()
            await asyncio.gather(*late, return_exceptions=True)
            if late:
                log.warning(
                    "%d requests did not finish in the grace period; left pending", len(late)
                )

    # ---- reading and admission -------------------------------------------------------------
    async def wait_room(self) -> None:
        """Until a request in flight finishes, or `stop()`."""
        self._room.clear()
        await _first(self._room.wait(), self._stopping.wait())

    async def wait_done(self, task: asyncio.Task[None]) -> None:
        """Until ``task`` (a request in flight) is done, or `stop()`."""
        stop = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()

    async def _read_loop(self) -> None:
        await replay_backlog(self)  # our own pending entries first (a restart)
        backoff = Backoff()
        while not self._stopping.is_set():
            room = self.max_inflight - len(self.inflight)
            if room <= 0:
                await self.wait_room()
                continue
            count = min(room, self.settings.read_count)
            try:
                resp = await self.r.xreadgroup(
                    GROUP, self.name, {self.stream: ">"}, count=count, block=500
                )
            except TRANSIENT as e:
                await backoff.wait("reading the stream", e)
                continue
            except ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                # Redis restarted without the group (no AOF, or the group was destroyed): join
                # again from id 0; acked entries are deleted, so only unfinished ones come back
                log.warning("consumer group gone (%s); joining again", e)
                await self._join_group()
                continue
            backoff.reset()
            entries = resp[0][1] if resp else []
            # already in flight: redelivered after Redis lost its most recent writes
            entries = [e for e in entries if e[0] not in self.inflight]
            if entries:
                await self.admit(entries)

    async def admit(
        self,
        entries: list[tuple[bytes, dict[bytes, bytes] | None]],
        delivered: dict[bytes, int] | None = None,
    ) -> None:
        """Decode entries and hand each to the engine at once; bad ones go to dead letters.

        ``delivered``: the stream's delivery count of entries delivered more than once (else 1);
        an entry whose delivery (plus any count it carried over a move) is its last allowed one
        runs alone."""
        decoded: list[tuple[bytes, Entry]] = []
        solo: set[bytes] = set()
        for entry_id, fields in entries:
            n = (delivered or {}).get(entry_id, 1) + carried(fields)
            if 1 < self.settings.max_attempts <= n:
                solo.add(entry_id)
            data = (fields or {}).get(FIELD)
            if data is None:
                if not fields:  # deleted after its result was recorded: only ack it
                    await self.r.xack(self.stream, GROUP, entry_id)
                    continue
                await self.reclaimer.dead_letter(entry_id, fields, "entry has no 'd' field")
                continue
            try:
                decoded.append((entry_id, Entry.from_wire(wire.decode(data, self.limits))))
            except PrefixqError as err:
                await self.reclaimer.dead_letter(entry_id, fields or {}, f"undecodable: {err}")
            except Exception as err:  # a payload must never take the worker down
                log.exception("unexpected error decoding entry %s", entry_id.decode())
                await self.reclaimer.dead_letter(
                    entry_id, fields or {}, f"undecodable: {type(err).__name__}: {err}"
                )
        prefixes = await self.prefixes.resolve([e for _, e in decoded])
        for entry_id, e in decoded:
            self.counts["admitted"] += 1
            task = asyncio.create_task(self._serve(entry_id, e, prefixes, entry_id in solo))
            self.inflight[entry_id] = task
        if decoded:
            # one loop step: each task runs until it awaits the engine, which then holds its
            # request; what they all hold is frozen (consumers/heap.py)
            await asyncio.sleep(0)
            self.heap.admitted(len(decoded))

    async def _serve(
        self,
        entry_id: bytes,
        e: Entry,
        prefixes: dict[str, dict[str, Any] | str],
        solo: bool = False,
    ) -> None:
        res = Result(
            id=e.id,
            index=e.index,
            shard=self.shard,
            worker=self.name,
            predicted_cached_tokens=e.predicted_cached,
        )
        res.timings.enqueued = e.enqueued
        res.timings.admitted = time.time()
        try:
            prefix = prefixes.get(e.prefix_ref) if e.prefix_ref else None
            if isinstance(prefix, str):
                raise EngineError(prefix)
            req = e.to_request(prefix)
            req.validate(
                max_chars=self.settings.max_prompt_chars, max_messages=self.settings.max_messages
            )
            prompt = self.engine.render_chat(req.messages) if req.messages else req.prompt
            async with self.gate.call(solo):
                out = await self.engine.generate(
                    EngineRequest(
                        request_id=f"{e.burst}:{e.index}:{entry_id.decode()}",
                        prompt=prompt,
                        prompt_token_ids=req.prompt_token_ids,
                        sampling=req.sampling,
                        chat=req.messages is not None,
                    )
                )
            out.apply(res)
        except EngineDead as err:
            self._engine_died(str(err))
            return
        except PrefixqError as err:  # EngineError, ValidationError, WireError: this request only
            res.error = str(err)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # never let one payload take the worker down
            log.exception("unexpected error serving %s", e.id)
            res.error = f"internal error: {type(err).__name__}: {err}"
        finally:
            self.inflight.pop(entry_id, None)
            self._room.set()
            self.heartbeat.request_done()
        res.timings.finished = time.time()
        self.counts["failed" if res.error else "finished"] += 1
        if self.metrics is not None:
            self.metrics.observe(res)
        self.writer.put(entry_id, e, res)

    def _engine_died(self, why: str) -> None:
        if self._dead is None:
            self._dead = why
            log.error(
                "engine died (%s): %d in-flight entries stay pending", why, len(self.inflight)
            )
        self.stop()


async def _cancel(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait until they are done, cancelling again while any runs on: on
    Python 3.11 a cancel can be lost (asyncio.wait_for returns the result when the awaited
    operation completes in the same loop step as the cancel, gh-86296), and redis-py sends every
    command through wait_for, so one cancel may leave a task blocked in Redis calls for ever."""
    while pending := [t for t in tasks if not t.done()]:
        for t in pending:
            t.cancel()
        await asyncio.wait(pending, timeout=1.0)
    for t in tasks:  # retrieve their exceptions: nothing is logged as "never retrieved"
        if not t.cancelled():
            t.exception()


async def _first(*aws: Any) -> None:
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
