"""Bursts that ended before all their requests ran: cancelled, or past their deadline.

prefixq.store.burst_end ends them (their missing results are recorded as ``cancelled``/``expired``)
and
posts a notice to `Keys.cancels`. A worker keeps the recent notices (`BurstEnds`): entries of an
ended burst it reads later are not run (their requests get the same ended result, recorded once:
usually the burst's end recorded it already, and the worker only acks the entry), and on a new
notice it aborts that burst's requests inside its engine (and ``on_end`` lets those waiting for the
KV budget go: worker/kv_budget.py). Every worker also looks for bursts past
their deadline once a second (`burst_end.expire_due`: each index is failed once, however many
workers look).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import redis.asyncio as aredis
from redis.exceptions import ResponseError

from prefixq.core.entries import Entry
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.store.burst_end import AsyncBurstDone, expire_due
from prefixq.store.redis_errors import TRANSIENT, inside_redis_py
from prefixq.store.retry import retry

log = logging.getLogger(__name__)

#: seconds between two looks for bursts past their deadline
EXPIRY_EVERY_S = 1.0
#: ended bursts remembered (as many as prefixq.store.burst_end keeps notices of)
KEPT = 10_000


class BurstEnds:
    """One worker's view of ended bursts."""

    def __init__(
        self, r: aredis.Redis, settings: Settings, *, on_burst_done: AsyncBurstDone | None = None
    ) -> None:
        self.r = r
        self.settings = settings
        #: runs for a burst that an expiry here ended (the worker's middleware hooks)
        self.on_burst_done = on_burst_done
        self.keys = Keys(settings.namespace)
        #: burst -> "cancelled" or "expired"
        self.ended: OrderedDict[str, str] = OrderedDict()
        #: burst -> the ended burst's ``created`` (its entries' ``enqueued``), when the notice
        #: says it: a burst id may be used again once the ended burst's record has expired
        self.created: dict[str, float] = {}
        self._seen = "0-0"
        #: entry -> (burst, engine request id), while the request is inside the engine
        self._running: dict[tuple[str, bytes], tuple[str, str]] = {}
        #: called with each burst ended from now on (its requests not yet in the engine leave)
        self.on_end: Callable[[str], None] | None = None

    def running(self, ref: tuple[str, bytes], burst: str, request_id: str) -> None:
        """The request of entry ``ref`` is now inside the engine as ``request_id``."""
        self._running[ref] = (burst, request_id)

    def done(self, ref: tuple[str, bytes]) -> None:
        self._running.pop(ref, None)

    def ended_reason(self, e: Entry) -> str | None:
        """Why ``e``'s burst ended ("cancelled", "expired"), or None. A notice about an earlier
        burst of the same id (its record expired, and the id was submitted again) is forgotten:
        the new burst's entries were enqueued at another time than the ended one was created."""
        reason = self.ended.get(e.burst)
        created = self.created.get(e.burst)
        if (  # an entry without its time (0): the notice holds
            reason is not None
            and created is not None
            and e.enqueued
            and abs(created - e.enqueued) > 1e-3
        ):
            log.info("burst %s was submitted again after it ended; its old notice dropped", e.burst)
            del self.ended[e.burst], self.created[e.burst]
            return None
        return reason

    def reason(self, e: Entry, now: float) -> str | None:
        """Why ``e`` must not run (its burst ended, or its deadline passed), or None."""
        reason = self.ended_reason(e)
        if reason is None and e.deadline is not None and now > e.deadline:
            return "expired"
        return reason

    async def load(self) -> None:
        """The notices posted before this worker started."""
        for entry_id, fields in await self.r.xrange(self.keys.cancels):
            self._note(entry_id, fields)

    async def watch(self, abort: Callable[[str], Awaitable[None]]) -> None:
        """For every burst ended from now on, ``abort(request_id)`` each of its requests inside
        the engine (runs as a task)."""
        while True:
            resp = await retry(
                "reading burst-end notices",
                lambda: self.r.xread({self.keys.cancels: self._seen}, count=100, block=1000),
            )
            for entry_id, fields in resp[0][1] if resp else []:
                burst = self._note(entry_id, fields)
                if burst and self.on_end is not None:
                    self.on_end(burst)
                rids = [rid for b, rid in self._running.values() if b == burst]
                if rids:
                    log.info("burst %s ended: aborting its %d requests", burst, len(rids))
                for rid in rids:
                    await abort(rid)

    async def expire(self) -> None:
        """End bursts whose deadline passed, once a second (runs as a task)."""
        while True:
            await asyncio.sleep(EXPIRY_EVERY_S)
            try:
                await expire_due(self.r, self.settings, on_burst_done=self.on_burst_done)
            except (*TRANSIENT, ResponseError) as e:
                log.warning("expiring bursts failed: %s", e)
            except Exception as e:  # whatever Redis holds, deadlines must keep being enforced
                if inside_redis_py(e):  # a connection closed under it in a failover: no bug
                    log.warning("expiring bursts failed: %s: %s", type(e).__name__, e)
                else:
                    log.exception("expiring bursts failed")

    def _note(self, entry_id: bytes, fields: dict[bytes, bytes]) -> str | None:
        self._seen = entry_id.decode()
        burst = fields.get(b"b", b"").decode(errors="replace")
        if not burst:
            return None
        self.ended[burst] = fields.get(b"r", b"cancelled").decode(errors="replace")
        self.ended.move_to_end(burst)
        try:
            self.created[burst] = float(fields[b"c"])
        except (KeyError, ValueError):  # an older notice: it applies to any burst of that id
            self.created.pop(burst, None)
        while len(self.ended) > KEPT:
            self.created.pop(self.ended.popitem(last=False)[0], None)
        return burst
