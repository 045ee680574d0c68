"""The long-lived consumer of one shard: stream -> engine -> results, with continuous admission.

Who owns what (docs/architecture.md has the picture):
  * `ShardStream` (shard.py) owns the shard's stream protocol: every Redis command about entries;
  * `Worker` (here) owns the in-flight window and admission: the reader keeps up to
    ``max_inflight`` requests inside the engine or waiting to be written, reading more as room
    frees up (its own pending entries first, after a restart, backlog.py); each request is handed
    to the engine as soon as it is read;
  * `ResultWriter` (writer.py) records finished results (exactly once per request, Lua) and then
    acks their entries; results not yet written count against the window (back-pressure);
  * `Heartbeat` (heartbeat.py) renews a TTL'd health key and the lease on every entry the worker
    holds; `Reclaimer` (reclaim.py) takes over entries idle on dead workers and dead-letters those
    delivered ``max_attempts`` times; both see the worker only through `Admission` (admission.py);
  * integrations (RQ completion callbacks, Prometheus metrics) plug in as `Middleware`
    (middleware.py), registered by whoever builds the worker; the worker imports none of them.
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
from collections.abc import Iterable
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import ResponseError

from prefixq import wire
from prefixq.connection import TRANSIENT, Backoff, async_client, describe, refused
from prefixq.consumers.backlog import replay_backlog
from prefixq.consumers.control import control_loop
from prefixq.consumers.engine import Engine, EngineRequest
from prefixq.consumers.gc_policy import GcPolicy
from prefixq.consumers.gcwatch import GcWatch
from prefixq.consumers.heartbeat import Heartbeat
from prefixq.consumers.letters import failed_result
from prefixq.consumers.loopwatch import Latency, LoopWatch
from prefixq.consumers.middleware import Middleware
from prefixq.consumers.prefixes import PrefixCache
from prefixq.consumers.reclaim import Reclaimer
from prefixq.consumers.shard import Delivery, ShardStream, last_allowed
from prefixq.consumers.solo import SoloGate
from prefixq.consumers.writer import ResultWriter
from prefixq.entries import Entry
from prefixq.errors import ConfigError, EngineDead, EngineError, PrefixqError
from prefixq.keys import FIELD
from prefixq.records import Result, error_code_of
from prefixq.redis_policy import check_policy
from prefixq.settings import Settings

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
        middleware: Iterable[Middleware] = (),
    ) -> None:
        self.settings = settings
        self.shard = shard
        self.engine = engine
        self.name = name or default_name(shard, gpu)
        self.gpu = gpu
        self.r = redis or async_client(settings)
        self.stream = ShardStream(self.r, settings, shard, self.name)
        self.keys = self.stream.keys
        self.limits = wire.Limits.from_settings(settings)
        self.middleware: list[Middleware] = list(middleware)
        self.max_inflight = settings.max_inflight
        #: requests inside the engine (or on their way in), by entry id
        self.inflight: dict[bytes, asyncio.Task[None]] = {}
        self.counts = {"admitted": 0, "finished": 0, "failed": 0, "dead": 0}
        self.started = time.time()
        self.engine_up = False
        self.gc = GcWatch()
        self.loop_watch = LoopWatch()
        #: from a stream read returning to the request being handed to the engine
        self.read_to_engine = Latency()
        self._stopping = asyncio.Event()
        self._room = asyncio.Event()
        self._gate = SoloGate()
        self._dead: str | None = None
        self.prefixes = PrefixCache(self.r, self.keys, self.limits, settings.prefix_cache_entries)
        #: the GC policy (consumers/gc_policy.py); the control stream turns freezing off and on
        self.gc_policy = GcPolicy(self.gc, enabled=settings.gc_freeze)
        self.writer = ResultWriter(
            self.stream,
            write_batch=settings.write_batch,
            grace_s=settings.grace_s,
            on_burst_done=self._burst_done,
            on_written=self._room.set,
        )
        self.reclaimer = Reclaimer(self.stream, self, settings)
        self.heartbeat = Heartbeat(
            self.stream,
            every_s=settings.heartbeat_s,
            ttl_s=settings.heartbeat_ttl_s,
            health=self.health,
            holding=self.holding,
            busy=self.busy,
            gc_policy=self.gc_policy,
        )

    # ---- lifecycle -------------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        """`stop()` was called (or the engine died): no more reading."""
        return self._stopping.is_set()

    @property
    def serving(self) -> bool:
        """The engine is up and alive."""
        return self.engine_up and self._dead is None

    @property
    def gate(self) -> SoloGate:
        return self._gate

    def stop(self) -> None:
        """Stop reading; in-flight requests get ``grace_s`` to finish."""
        if not self._stopping.is_set():
            log.info("worker %s stopping (grace %.0fs)", self.name, self.settings.grace_s)
        self._stopping.set()

    def add_middleware(self, m: Middleware) -> None:
        self.middleware.append(m)

    async def run(self) -> int:
        """Serve until `stop()` or engine death; returns the process exit code."""
        for m in self.middleware:
            await m.before_start(self)
        try:
            return await self._run()
        finally:
            for m in reversed(self.middleware):
                await m.after_stop(self)

    async def _run(self) -> int:
        await self._register()
        await self.engine.start()
        await self._retry("recording the engine's block size", self._record_engine)
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
                ("loop-watch", self.loop_watch.run()),
                (
                    "control",
                    control_loop(self.r, self.keys, self.name, self._control(), self.stats),
                ),
            )
        ]
        try:
            await self.reclaimer.dead_letter_over_limit()
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

    async def _register(self) -> None:
        """Check the server's eviction policy, join the shard's group, and make sure the
        deployment's shard count is recorded."""
        await self._retry(
            "reading the eviction policy", lambda: check_policy(self.r, self.settings)
        )
        await self.stream.join()

        async def shards() -> None:
            if self.settings.shards:
                await self.r.hsetnx(self.keys.config, "shards", self.settings.shards)
                return
            if await self.r.hget(self.keys.config, "shards") is None:
                raise ConfigError(
                    f"no shard count in Redis for namespace {self.settings.namespace!r}: start "
                    "the first worker of a deployment with --shards N (or PREFIXQ_SHARDS)"
                )

        await self._retry("recording the shard count", shards)

    async def _record_engine(self) -> None:
        """Tell producers the engine's KV block size (predicted hits are rounded to it)."""
        await self.r.hset(self.keys.config, "block_size", self.engine.block_size)

    async def _retry(self, what: str, call: Any) -> None:
        """``await call()`` until Redis takes it (unreachable, out of memory, loading...)."""
        backoff = Backoff()
        while True:
            try:
                await call()
                return
            except (*TRANSIENT, ResponseError) as e:
                if refused(e):  # wrong credentials, an ACL, an untrusted certificate
                    raise describe(self.settings, e) from e
                await backoff.wait(what, e)

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
        if self.gc_policy.enabled:
            self.gc_policy.freeze()
        self.gc.start()
        log.info(
            "worker %s warm in %.2fs; max_inflight=%d; serving %s",
            self.name,
            time.perf_counter() - t0,
            self.max_inflight,
            self.stream.stream,
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

    # ---- what the helpers see (consumers/admission.py) --------------------------------------
    def room(self) -> int:
        return self.max_inflight - len(self.inflight) - self.writer.backlog

    def busy(self) -> bool:
        return bool(self.inflight)

    def holds(self, entry_id: bytes) -> bool:
        return entry_id in self.inflight or self.writer.holds(entry_id)

    def holding(self) -> list[bytes]:
        """Entries this worker holds: in flight, or finished with results not yet acked."""
        return [*self.inflight, *self.writer.holding()]

    async def wait_room(self) -> None:
        """Until room frees up (a request finished, results were written), or `stop()`."""
        self._room.clear()
        await _first(self._room.wait(), self._stopping.wait())

    async def wait_done(self, entry_id: bytes) -> None:
        """Until the request of ``entry_id`` has left the engine, or `stop()`."""
        task = self.inflight.get(entry_id)
        if task is None:
            return
        stop = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()

    async def dead_letter(self, delivery: Delivery, reason: str) -> None:
        """Move an entry to the dead-letter stream; its request (if identifiable) gets a failed
        result, recorded and acked before this returns. A Redis error leaves the entry pending:
        it is reclaimed and dead-lettered again later."""
        log.warning(
            "dead letter %s on shard %d: %s", delivery.entry_id.decode(), self.shard, reason
        )
        try:
            entry = await self.stream.dead_letter(delivery, reason)
        except (*TRANSIENT, ResponseError) as e:
            log.error("dead-lettering %s failed (%s); left pending", delivery.entry_id, e)
            return
        self.counts["dead"] += 1
        if entry is not None:
            self.counts["failed"] += 1
            res = failed_result(entry, self.shard, self.name, reason)
            await self.writer.write_now(delivery.entry_id, entry, res)

    # ---- reading and admission -------------------------------------------------------------
    async def _read_loop(self) -> None:
        s = self.settings
        # our own pending entries first (a restart)
        await replay_backlog(self.stream, self, page=s.read_count, max_attempts=s.max_attempts)
        backoff = Backoff()
        while not self._stopping.is_set():
            room = self.room()
            if room <= 0:
                await self.wait_room()
                continue
            try:
                got = await self.stream.read(min(room, s.read_count), block_ms=500)
            except (*TRANSIENT, ResponseError) as e:
                await backoff.wait("reading the stream", e)
                continue
            backoff.reset()
            # already held: redelivered after Redis lost its most recent writes
            got = [d for d in got if not self.holds(d.entry_id)]
            if got:
                await self.admit(got)

    async def admit(self, deliveries: list[Delivery]) -> None:
        """Decode entries and hand each to the engine at once; bad ones go to dead letters. An
        entry whose delivery is its last allowed one runs alone (consumers/solo.py)."""
        t_read = time.perf_counter()
        decoded: list[tuple[Delivery, Entry]] = []
        empty: list[bytes] = []
        for d in deliveries:
            data = d.fields.get(FIELD)
            if data is None:
                if not d.fields:  # deleted after its result was recorded: only ack it
                    empty.append(d.entry_id)
                else:
                    await self.dead_letter(d, "entry has no 'd' field")
                continue
            try:
                decoded.append((d, Entry.from_wire(wire.decode(data, self.limits))))
            except PrefixqError as err:
                await self.dead_letter(d, f"undecodable: {err}")
            except Exception as err:  # a payload must never take the worker down
                log.exception("unexpected error decoding entry %s", d.entry_id.decode())
                await self.dead_letter(d, f"undecodable: {type(err).__name__}: {err}")
        if empty:
            await self._retry("acking deleted entries", lambda: self.stream.ack_ids(empty))
        prefixes = await self.prefixes.resolve([e for _, e in decoded])
        max_attempts = self.settings.max_attempts
        for d, e in decoded:
            self.counts["admitted"] += 1
            solo = last_allowed(d.deliveries, max_attempts)
            task = asyncio.create_task(self._serve(d.entry_id, e, prefixes, solo, t_read))
            self.inflight[d.entry_id] = task
        if decoded:
            # one loop step: each task runs until it awaits the engine, which then holds its
            # request; what they all hold is frozen (consumers/gc_policy.py)
            await asyncio.sleep(0)
            self.gc_policy.admitted(len(decoded))

    async def _serve(
        self,
        entry_id: bytes,
        e: Entry,
        prefixes: dict[str, dict[str, Any] | str],
        solo: bool,
        t_read: float,
    ) -> None:
        res = Result(
            id=e.id,
            index=e.index,
            shard=self.shard,
            worker=self.name,
            predicted_cached_tokens=e.predicted_cached,
        )
        res.timings.enqueued = e.enqueued
        try:
            prefix = prefixes.get(e.prefix_ref) if e.prefix_ref else None
            if isinstance(prefix, str):
                raise EngineError(prefix)
            req = e.to_request(prefix)
            req.validate(
                max_chars=self.settings.max_prompt_chars, max_messages=self.settings.max_messages
            )
            prompt = self.engine.render_chat(req.messages) if req.messages else req.prompt
            async with self._gate.call(solo):
                res.timings.admitted = time.time()
                self.read_to_engine.add(time.perf_counter() - t_read)
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
            res.error, res.error_code = str(err), error_code_of(err)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # never let one payload take the worker down
            log.exception("unexpected error serving %s", e.id)
            res.error = f"internal error: {type(err).__name__}: {err}"
            res.error_code = error_code_of(err)
        finally:
            self.inflight.pop(entry_id, None)
            self._room.set()
            self.heartbeat.request_done()
        if not res.timings.admitted:
            res.timings.admitted = time.time()
        res.timings.finished = time.time()
        self.counts["failed" if res.error else "finished"] += 1
        for m in self.middleware:
            m.after_result(res)
        self.writer.put(entry_id, e, res)

    def _engine_died(self, why: str) -> None:
        if self._dead is None:
            self._dead = why
            log.error(
                "engine died (%s): %d in-flight entries stay pending", why, len(self.inflight)
            )
        self.stop()

    async def _burst_done(self, burst: str) -> None:
        for m in self.middleware:
            await m.after_burst_done(burst)

    # ---- what inspect, check, metrics and the control stream read ---------------------------
    def health(self, now: float) -> dict[str, Any]:
        """The heartbeat hash's fields (read by inspect and check)."""
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "gpu": self.gpu or "cpu",
            "shard": self.shard,
            "beat": now,
            "started": self.started,
            "inflight": len(self.inflight),
            "unwritten": self.writer.backlog,
            "max_inflight": self.max_inflight,
            "engine_up": int(self.serving),
            "stopping": int(self.stopping),
            "gc_max_pause_ms": round(self.gc.max_pause * 1000, 3),
            "gc_pauses": self.gc.count,
            "reclaimed": self.reclaimer.reclaimed,
            **self.counts,
        }

    def stats(self) -> dict[str, Any]:
        """GC, loop-lag and admission figures (the control stream's ``stats``)."""
        import gc

        return {
            "frozen": gc.get_freeze_count(),
            **self.gc.stats(),
            **self.gc_policy.stats(),
            **self.loop_watch.stats(),
            **self.read_to_engine.stats("read_to_engine"),
        }

    def _control(self) -> dict[str, Any]:
        async def reset_stats() -> None:
            self.gc.reset()
            self.loop_watch.lag.reset()
            self.read_to_engine.reset()

        async def gc_freeze() -> None:
            self.gc_policy.freeze()

        async def gc_unfreeze() -> None:
            self.gc_policy.unfreeze()

        return {
            "reset_prefix_cache": self.engine.reset_prefix_cache,
            "gc_freeze": gc_freeze,
            "gc_unfreeze": gc_unfreeze,
            "reset_stats": reset_stats,
        }


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
