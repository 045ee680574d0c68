"""The long-lived consumer of one shard: stream -> engine -> results, with continuous admission.

`Worker` owns the in-flight window and the worker's lifecycle: up to ``max_inflight`` requests
inside the engine or waiting to be written; the reader (reader.py) reads more as room frees up, in
the order the scheduler (scheduler.py: priorities, tenants, bursts) picks, after the worker's own
pending entries of a restart (backlog.py), and admission (admission.py) hands each request to the
engine as soon as it is picked. Everything else is a collaborator with its own module: the stream
protocol (shard.py), intake (intake.py), the writer, heartbeat, reclaimer, burst ends, probes and
middleware; docs/architecture.md draws who owns what.
``stop()`` (SIGTERM) stops reading, lets in-flight requests finish within ``grace_s``, writes and
acks them; the rest stays pending (those waiting for the KV budget, never started, are given
back as those read ahead are). Whatever Redis does, the stop ends within `stop_bound_s`
(``grace_s`` + `FLUSH_S`): a read waiting on Redis is given up after `READ_STOP_S`.
An engine death leaves in-flight entries pending (not failed) and exits with code 3.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import redis.asyncio as aredis

from prefixq.core.settings import Settings
from prefixq.engine.protocol import Engine
from prefixq.store.connection import async_client
from prefixq.store.retry import retry
from prefixq.store.webhook_outbox import aadd_burst_event
from prefixq.worker import kv_sizing
from prefixq.worker.admission import Admission
from prefixq.worker.aio import cancel_all, drain, first_of, unless_stopped, within
from prefixq.worker.backlog import replay_backlog
from prefixq.worker.control import control_loop, newest
from prefixq.worker.deliveries import Delivery, Ref
from prefixq.worker.ends import BurstEnds
from prefixq.worker.fleet import FleetWatch
from prefixq.worker.groups import commands as admission_commands
from prefixq.worker.health import health
from prefixq.worker.heartbeat import Heartbeat
from prefixq.worker.intake import Intake
from prefixq.worker.lanes import Picked
from prefixq.worker.lifecycle import (
    _UNREGISTER_S,
    EXIT_ENGINE_DEAD,
    EXIT_OK,
    FLUSH_S,
    READ_STOP_S,
    default_name,
    stop_bound_s,
)
from prefixq.worker.middleware import Middleware
from prefixq.worker.prefixes import PrefixCache
from prefixq.worker.probes import Probes
from prefixq.worker.reader import Reader
from prefixq.worker.reclaim import Reclaimer
from prefixq.worker.scheduler import Scheduler
from prefixq.worker.shard import ShardStream
from prefixq.worker.shared_pass import resetting
from prefixq.worker.solo import SoloGate
from prefixq.worker.startup import record_engine, register, warm_up
from prefixq.worker.writer import ResultWriter

log = logging.getLogger(__name__)

__all__ = ["EXIT_ENGINE_DEAD", "EXIT_OK", "Worker", "default_name", "stop_bound_s"]


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
        hand_over: bool = False,
    ) -> None:
        """``hand_over``: when it stops, the worker moves what is left of its shard's queue to
        live shards (unless another worker serves the shard; worker/fleet.py)."""
        self.settings, self.shard, self.engine, self.gpu = settings, shard, engine, gpu
        self.name = name or default_name(shard, gpu)
        self.r = redis or async_client(settings)
        self.stream = ShardStream(self.r, settings, shard, self.name)
        self.keys, self.limits = self.stream.keys, self.stream.limits
        self.middleware: list[Middleware] = list(middleware)
        self.max_inflight = settings.max_inflight
        #: requests inside the engine (or on their way in), by entry
        self.inflight: dict[Ref, asyncio.Task[None]] = {}
        self.counts = {"admitted": 0, "finished": 0, "failed": 0, "dead": 0}
        self.started = time.time()
        self.engine_up = False
        self.probes = Probes(gc_freeze=settings.gc_freeze)
        self.gc, self.gc_policy = self.probes.gc, self.probes.gc_policy
        self._stopping = asyncio.Event()
        self._stopped_at = 0.0  # monotonic time of the first `stop()`
        self._room = asyncio.Event()
        self._gate = SoloGate()
        self._dead: str | None = None
        #: called at the first `stop()` (cli/worker_signals.py arms its watchdog)
        self.on_stop: Callable[[], None] | None = None
        #: bursts cancelled or expired: their queued entries are not run (worker/ends.py)
        done = self._burst_done
        self.ends = BurstEnds(self.r, settings, on_burst_done=lambda _r, _s, b: done(b))
        self.prefixes = PrefixCache(self.r, self.keys, self.limits, settings.prefix_cache_entries)
        self.gc_policy.known = self.prefixes.held_ids  # live, acyclic: not growth to collect
        self.writer = ResultWriter(
            self.stream,
            write_batch=settings.write_batch,
            on_burst_done=self._burst_done,
            on_written=self._room.set,
        )
        self.intake = Intake(
            stream=self.stream,
            writer=self.writer,
            ends=self.ends,
            prefixes=self.prefixes,
            counts=self.counts,
            retry=self._retry,
        )
        self.sched = Scheduler.of(self.stream, settings)
        self.reader = Reader(
            stream=self.stream,
            sched=self.sched,
            intake=self.intake,
            work=self,
            ended=self.ends.ended,
        )
        self.reclaimer = Reclaimer(self.stream, self, settings)
        self.heartbeat = Heartbeat(
            self.stream,
            every_s=settings.heartbeat_s,
            ttl_s=settings.heartbeat_ttl_s,
            health=self.health,
            holding=self.holding,
            tallies=self.sched.tallies,
            busy=self.busy,
            gc_policy=self.gc_policy,
            reads=lambda: self.reader.delivered,
            serving=lambda: self.serving and not self.stopping,
        )
        self.hand_over = hand_over
        self.fleet = FleetWatch(self.r, settings, shard=shard, name=self.name, idle=self.idle)
        self.admission = Admission(
            settings=settings,
            shard=shard,
            name=self.name,
            engine=engine,
            sched=self.sched,
            intake=self.intake,
            ends=self.ends,
            prefixes=self.prefixes,
            writer=self.writer,
            probes=self.probes,
            gate=self._gate,
            middleware=self.middleware,
            inflight=self.inflight,
            counts=self.counts,
            room=self._room,
            request_done=self.heartbeat.request_done,
            on_engine_dead=self._engine_died,
        )
        self.admission.marks = self.admission.budget.resident = self.heartbeat.marks

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

    @property
    def exit_code(self) -> int:
        """What `run` returns, and a stop's watchdog exits with (cli/worker_signals.py)."""
        return EXIT_OK if self._dead is None else EXIT_ENGINE_DEAD

    def stop(self) -> None:
        """Stop reading; in-flight requests get ``grace_s`` to finish. The first stop, whatever
        its cause (a signal, the engine's death), calls ``on_stop`` (a watchdog's arming)."""
        if not self._stopping.is_set():
            log.info("worker %s stopping (grace %.0fs)", self.name, self.settings.grace_s)
            self._stopped_at = time.monotonic()
            if self.on_stop is not None:
                self.on_stop()
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

    async def _prepare(self) -> None:
        await register(self.stream, self.settings)
        await self._retry("reading the burst-end notices", self.ends.load)

    async def _run(self) -> int:
        # the Redis steps of the start wait for Redis as long as it takes; stop() ends them
        started = await unless_stopped(self._prepare(), self._stopping)
        if started:
            await self.engine.start()
            recorded = record_engine(self.stream, self.settings, self.engine)
            started = await unless_stopped(recorded, self._stopping)
        if not started:
            log.info("worker %s stopped before it served", self.name)
            await self.engine.close()
            await self.r.aclose()
            return EXIT_OK
        self.max_inflight = self.max_inflight or max(2 * self.engine.max_num_seqs, 1)
        self.sched.window = self.admission.budget.window = self.max_inflight
        await self._warm_up()
        control_from = await newest(self.r, self.keys)  # before the beat says it serves
        self.engine_up = True
        probes, marks, s = self.probes, self.heartbeat.marks, self.settings
        kv_sizing.size(self.admission.budget, marks, getattr(self.engine, "kv_tokens", 0), s)
        commands = {
            "reset_prefix_cache": resetting(self.engine.reset_prefix_cache, marks),
            **probes.commands(),
            **kv_sizing.commands(admission_commands(self.sched), self.admission.budget, marks, s),
            **self.fleet.commands(),
        }
        tasks = [
            asyncio.create_task(c, name=n)
            for n, c in (
                ("writer", self.writer.run()),
                ("heartbeat", self.heartbeat.run()),
                ("reclaim", self.reclaimer.run()),
                ("loop-watch", probes.loop.run()),
                ("burst-ends", self.ends.watch(self.engine.abort)),
                ("expiry", self.ends.expire()),
                (
                    "control",
                    control_loop(
                        self.r, self.keys, self.name, commands, probes.stats, control_from
                    ),
                ),
                ("lanes", self.reader.refresh_loop()),
                ("fleet", self.fleet.run(self._stopping)),
                ("shared-pass", self.heartbeat.marks.run(self.r)),
            )
        ]
        final = time.monotonic() + stop_bound_s(self.settings)  # when the stop must be over
        reading = asyncio.create_task(self._serve_queues(), name="reader")
        try:
            await first_of(asyncio.shield(reading), self._stopping.wait())
            if not self.stopping:  # the reader failed: exit as a stop would
                self.stop()
            grace_end = self._stopped_at + self.settings.grace_s
            final = grace_end + FLUSH_S
            if reading.done():
                reading.result()  # the reader's error, if it failed
            else:  # the round under way ends by itself, unless it waits on an absent Redis
                await within(reading, min(READ_STOP_S, final - time.monotonic()))
            unstarted = self.admission.budget.give_back()  # waiting for it: never started
            await within(self.reader.release(unstarted), final - time.monotonic())
            await drain(list(self.inflight.values()), grace_end - time.monotonic())
            final = min(final, time.monotonic() + FLUSH_S)  # from the end of the drain
        finally:
            await self.writer.close(final - _UNREGISTER_S - time.monotonic())
            await cancel_all([reading, *tasks])
            left = max(_UNREGISTER_S, final - time.monotonic())
            unregister = asyncio.ensure_future(self.heartbeat.unregister())
            reached = await within(unregister, left) and unregister.result()
            if not reached:
                log.warning("could not unregister: the heartbeat expires by its TTL")
            if self.hand_over and not self._dead:
                await self.fleet.hand_over_on_stop(reached)
            self.gc.stop()
            await self.engine.close()
            await self.r.aclose()
        if self._dead:
            log.error("worker %s exits: %s", self.name, self._dead)
        return self.exit_code

    async def _serve_queues(self) -> None:
        """Read and admit until `stop()` (the lane index first, then over-limit entries)."""
        await self._retry("reading the lane index", self.reader.refresh)
        await self.reclaimer.dead_letter_over_limit()
        await self._read_loop()

    async def _retry(self, what: str, call: Callable[[], Awaitable[Any]]) -> None:
        await retry(what, call, settings=self.settings)

    async def _warm_up(self) -> None:
        took = await warm_up(self.engine, f"warmup-{self.name}-{os.getpid()}", self.settings.task)
        if self.gc_policy.enabled:
            self.gc_policy.freeze()
        self.gc.start()
        log.info(
            "worker %s warm in %.2fs; max_inflight=%d; serving %s",
            self.name,
            took,
            self.max_inflight,
            self.stream.stream,
        )

    # ---- what the helpers see (worker/view.py) ---------------------------------------------
    def room(self) -> int:  # those waiting for the KV budget are not in the engine (kv_budget.py)
        outside = self.admission.budget.outside(self.max_inflight)
        return self.max_inflight - len(self.inflight) + outside - self.writer.backlog

    def busy(self) -> bool:
        return bool(self.inflight)

    def idle(self) -> bool:
        """Serving, nothing read and waiting, room in the engine: free to take work elsewhere."""
        return self.serving and not self.stopping and not self.sched.held and self.room() > 0

    def holds(self, ref: Ref) -> bool:
        return ref in self.inflight or self.writer.holds(ref) or ref in self.sched.held

    def holding(self) -> list[Ref]:
        """Entries this worker holds: read and not yet admitted, in flight, or finished with
        results not yet acked."""
        return [*self.sched.held, *self.inflight, *self.writer.holding()]

    def queue_keys(self) -> list[str]:
        return self.reader.keys()

    async def wait_room(self) -> None:
        """Until room frees up (a request finished, results were written), or `stop()`."""
        self._room.clear()
        await first_of(self._room.wait(), self._stopping.wait())

    async def wait_done(self, ref: Ref) -> None:
        """Until the request of entry ``ref`` has left the engine, or `stop()`."""
        task = self.inflight.get(ref)
        if task is None:
            return
        stop = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()

    async def dead_letter(self, delivery: Delivery, reason: str) -> None:
        await self.intake.dead_letter(delivery, reason)

    # ---- reading and admission -------------------------------------------------------------
    async def _read_loop(self) -> None:
        s = self.settings
        # our own pending entries first (a restart)
        await replay_backlog(self.stream, self, page=s.read_count, max_attempts=s.max_attempts)
        await self.reader.run()

    async def admit(self, deliveries: list[Delivery]) -> None:
        """Take the entries in and hand each request to the engine at once (the backlog
        replay: no scheduling; worker/admission.py)."""
        await self.admission.admit(deliveries)

    async def take_over(self, deliveries: list[Delivery]) -> None:
        """Entries claimed from a dead worker: admitted before anything else, in turn as room
        frees up (worker/admission.py)."""
        await self.admission.take_over(deliveries)

    async def launch(self, items: list[Picked], t_read: float) -> None:
        """Hand each picked request to the engine at once (worker/admission.py)."""
        await self.admission.launch(items, t_read)

    def _engine_died(self, why: str) -> None:
        if self._dead is None:
            self._dead = why
            log.error(
                "engine died (%s): %d in-flight entries stay pending", why, len(self.inflight)
            )
        self.stop()

    async def _burst_done(self, burst: str) -> None:
        await aadd_burst_event(self.r, self.settings, burst)  # its on_complete_url, if any
        for m in self.middleware:
            await m.after_burst_done(burst)

    # ---- what inspect, check, metrics and the control stream read ---------------------------
    def health(self, now: float) -> dict[str, Any]:
        """The heartbeat hash's fields (worker/health.py)."""
        return health(self, now)
