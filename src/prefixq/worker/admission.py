"""Admission: what the worker admits goes into its engine at once, one task per request.

`Admission` takes the entries a worker admits — a read round's picks (`launch`), its own pending
entries of a restart (`admit`: no scheduling), entries claimed from a dead worker (`take_over`:
stocked to go before anything else) — and hands each request to the engine as soon as it has it
(an embeddings request to `Engine.embed`, every other to `Engine.generate`):
a request of a burst that ended meanwhile gets its ended result instead (worker/ends.py), stored
prefixes are resolved with one MGET per round (worker/prefixes.py), an entry on its last allowed
delivery runs alone (worker/solo.py), and the engine's queue follows priorities, or fair shares
(worker/engine_order.py). Each request is a task in the worker's in-flight table until its result
is handed to the writer: whatever goes wrong with one request is its result; only the engine's
death leaves it pending (the worker stops: ``on_engine_dead``). The worker (worker.py) owns the
window these tasks fill and its lifecycle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from prefixq.core.entries import Entry
from prefixq.core.errors import (
    EngineAborted,
    EngineDead,
    EngineError,
    PrefixqError,
    ValidationError,
)
from prefixq.core.result_record import ENDED_ERRORS, error_code_of
from prefixq.core.settings import Settings
from prefixq.core.sharing import PRIORITIES
from prefixq.engine.protocol import (
    EmbedOutput,
    EmbedRequest,
    Engine,
    EngineOutput,
    EngineRequest,
)
from prefixq.store.retry import retry
from prefixq.worker.deliveries import Delivery, Ref, last_allowed
from prefixq.worker.ends import BurstEnds
from prefixq.worker.engine_order import EngineOrder, band_priority
from prefixq.worker.intake import Intake
from prefixq.worker.kv_budget import KvBudget
from prefixq.worker.lanes import Picked, Tenant
from prefixq.worker.middleware import Middleware
from prefixq.worker.prefixes import PrefixCache
from prefixq.worker.probes import Probes
from prefixq.worker.scheduler import Scheduler
from prefixq.worker.shared_pass import PassMarks
from prefixq.worker.solo import SoloGate
from prefixq.worker.writer import ResultWriter

__all__ = ["ENGINE_PRIORITY", "Admission"]

log = logging.getLogger(__name__)

#: a request's place in its engine's own queue (vLLM: lower first), by its burst's priority
#: alone (``engine_fair_order`` off; on, worker/engine_order.py adds the burst's fair share)
ENGINE_PRIORITY = {p: band_priority(p) for p in PRIORITIES}


class Admission:
    """Hands admitted requests to ``engine``, each as a task in ``inflight`` until its result
    is with ``writer``; ``room`` is set as each leaves (and after a take-over), ``request_done``
    called; ``counts``: the worker's admitted / finished / failed counters."""

    def __init__(
        self,
        *,
        settings: Settings,
        shard: int,
        name: str,
        engine: Engine,
        sched: Scheduler,
        intake: Intake,
        ends: BurstEnds,
        prefixes: PrefixCache,
        writer: ResultWriter,
        probes: Probes,
        gate: SoloGate,
        middleware: list[Middleware],
        inflight: dict[Ref, asyncio.Task[None]],
        counts: dict[str, int],
        room: asyncio.Event,
        request_done: Callable[[], None],
        on_engine_dead: Callable[[str], None],
    ) -> None:
        self.settings, self.shard, self.name, self.engine = settings, shard, name, engine
        self.sched, self.intake, self.ends, self.prefixes = sched, intake, ends, prefixes
        self.writer, self.probes, self.gate = writer, probes, gate
        self.middleware, self.inflight, self.counts = middleware, inflight, counts
        self._room, self._request_done, self._engine_died = room, request_done, on_engine_dead
        #: engine priorities by fair share (worker/engine_order.py), or by priority alone
        self.order = EngineOrder() if settings.engine_fair_order else None
        #: where the pass is: the groups of the requests the engine finished last
        #: (worker/shared_pass.py; the heartbeat's, which publishes it)
        self.marks: PassMarks | None = None
        #: the distinct prefixes inside the engine, held to a share of its cache
        #: (``kv_inflight_share``, or ``kv_history_tokens``: sized with the engine, kv_sizing.size)
        #: (worker/kv_budget.py; sized once the engine states its cache); an ended burst's
        #: requests waiting for it leave at once
        self.budget = probes.budget = KvBudget(settings.kv_inflight_share)
        ends.on_end = self.budget.end

    async def admit(self, deliveries: list[Delivery]) -> None:
        """Take the entries in (worker/intake.py) and hand each request to the engine at
        once (the backlog replay: no scheduling)."""
        t_read = time.perf_counter()
        now, sched = time.time(), self.sched
        picked = []
        for d, e in await self.intake.decode(deliveries):
            t = sched.tenant_of(e)
            sched.admitted(t, e, now)
            picked.append((d, e, t))
        await self.launch(picked, t_read)

    async def take_over(self, deliveries: list[Delivery]) -> None:
        """Entries claimed from a dead worker: admitted before anything else (worker/
        scheduler.py), in turn as room frees up."""
        for item in await self.intake.decode(deliveries):
            self.sched.take_over(item)
        self._room.set()

    async def launch(self, items: list[Picked], t_read: float) -> None:
        """Hand each admitted request to the engine at once (counted in flight for its tenant
        already). An entry whose delivery is its last allowed one runs alone
        (worker/solo.py); one of a burst that ended meanwhile gets its ended result."""
        ready = items
        if self.ends.ended or any(e.deadline is not None for _, e, _ in items):
            now, ready = time.time(), []
            for d, e, t in items:
                if self.intake.ended(d, e, now):
                    self.sched.left(t)
                else:
                    ready.append((d, e, t))
            if not ready:
                return
        entries = [e for _, e, _ in ready]
        prefixes = await retry("reading stored prefixes", lambda: self.prefixes.resolve(entries))
        max_attempts = self.settings.max_attempts
        order = self.order
        # one loop step: each task runs until it awaits the engine, which then holds its
        # request; no collection runs meanwhile, and what they all hold is frozen after it
        # (worker/gc_policy.py)
        with self.probes.gc_policy.admitting(len(ready)):
            for d, e, t in ready:
                self.counts["admitted"] += 1
                solo = last_allowed(d.deliveries, max_attempts)
                prio = ENGINE_PRIORITY[e.priority]
                if order is not None:  # in admission order: the engine's queue follows the shares
                    prio = order.enter(e.priority, t.name, e.burst, t.weight)
                serve = self._serve(d, e, t, prefixes, solo, t_read, prio)
                self.inflight[d.ref] = asyncio.create_task(serve)
            await asyncio.sleep(0)

    def _ended(self, e: Entry) -> None:
        """EngineAborted if ``e``'s burst ended or its deadline passed."""
        why = self.ends.reason(e, time.time())
        if why is not None:
            raise EngineAborted(why)

    async def _serve(
        self,
        d: Delivery,
        e: Entry,
        tenant: Tenant,
        prefixes: dict[str, dict[str, Any] | str],
        solo: bool,
        t_read: float,
        priority: int,
    ) -> None:
        res, ref = e.result(self.shard, self.name), d.ref
        try:
            # its burst may have ended after it was read and before this task ran: the budget
            # lets only the requests waiting when the notice came go (`KvBudget.end`), so one
            # that came later would wait for room it never needs
            self._ended(e)
            prefix = prefixes.get(e.prefix_ref) if e.prefix_ref else None
            if isinstance(prefix, str):
                raise EngineError(prefix)
            req = e.to_request(prefix)
            req.validate(
                max_chars=self.settings.max_prompt_chars, max_messages=self.settings.max_messages
            )
            if req.refusal is not None:  # refused per line at submit: its result is the refusal
                raise ValidationError(req.refusal)
            prompt = self.engine.render_chat(req.messages) if req.messages else req.prompt
            out: EngineOutput | EmbedOutput
            # one that waits for the budget when the worker stops is given back (worker.py)
            async with self.budget.holding(e, priority, (d, e)), self.gate.call(solo):
                self._ended(e)  # it ended, or its deadline passed, while this waited
                res.timings.admitted = time.time()
                self.probes.read_to_engine.add(time.perf_counter() - t_read)
                rid = f"{e.burst}:{e.index}:{ref[1].decode()}"
                self.ends.running(ref, e.burst, rid)
                if self.marks is not None:  # the window may follow what the engine runs
                    self.marks.enter(ref, e, priority)
                if req.inputs is not None:  # an embeddings request: one vector per input
                    dims = req.pooling.get("dimensions")
                    out = await self.engine.embed(EmbedRequest(rid, req.inputs, dims, priority))
                else:
                    out = await self.engine.generate(
                        EngineRequest(
                            request_id=rid,
                            prompt=prompt,
                            prompt_token_ids=req.prompt_token_ids,
                            sampling=req.sampling,
                            chat=req.messages is not None,
                            priority=priority,
                        )
                    )
                    if self.marks is not None:  # its prefix is in the engine's cache now
                        self.marks.note(e)
            out.apply(res)
        except EngineDead as err:
            self._engine_died(str(err))
            return
        except EngineAborted:  # its burst was cancelled or expired (BurstEnds.watch)
            why = self.ends.reason(e, time.time()) or "cancelled"
            res.error, res.error_code = ENDED_ERRORS[why], why
        except PrefixqError as err:  # EngineError, ValidationError, WireError: this request only
            res.error, res.error_code = str(err), error_code_of(err)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # never let one payload take the worker down
            log.exception("unexpected error serving %s", e.id)
            res.error = f"internal error: {type(err).__name__}: {err}"
            res.error_code = error_code_of(err)
        finally:
            self.inflight.pop(ref, None)
            self.sched.left(tenant)
            if self.order is not None:
                self.order.left(e.priority, e.burst, priority)
            self.ends.done(ref)
            if self.marks is not None:
                self.marks.leave(ref)
            self._room.set()
            self._request_done()
        if not res.timings.admitted:
            res.timings.admitted = time.time()
        res.timings.finished = time.time()
        self.counts["failed" if res.error else "finished"] += 1
        for m in self.middleware:
            m.after_result(res)
        self.writer.put(ref, e, res)
