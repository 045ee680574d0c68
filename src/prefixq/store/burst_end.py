"""A burst's end before all its requests ran: `cancel` (an operator, the HTTP server, the CLI) and
`expire_due` (its deadline passed; every worker calls it periodically).

Both fail every request of the burst that has no result yet (``error_code`` ``cancelled`` or
``expired``) through lua/finish_missing.lua, ``HSETNX`` per input index and 1,000 indexes per
call: each request keeps exactly one result, and a result recorded before stays. Only once nothing
is missing is the notice posted to `Keys.cancels` (workers then abort the burst's requests and
skip its entries), so the counters and the final status are this module's. The call that
completes the burst queues its ``on_complete_url`` webhook (prefixq.store.webhook_outbox) and runs
the ``on_burst_done`` hook its caller passes (RQ's enqueue, from prefixq.integrations.rq_callbacks):
this module imports no integration. docs/delivery.md,
"Cancel and deadlines", has the steps, the statuses and the exactly-once argument. Each result
carries the id submitted for its index (the producer writes the id list with the record); an
index past the end of a list an older producer left short gets no id (`NO_ID`), never one made up
from the index.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Generator, Iterator
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import redis
import redis.asyncio as aredis

from prefixq.core import wire
from prefixq.core.errors import BurstNotFound, BurstRecordLost
from prefixq.core.keys import Keys
from prefixq.core.result_record import ENDED_ERRORS, Result
from prefixq.core.settings import Settings
from prefixq.store.connection import sync_client
from prefixq.store.lua_script import LuaScript
from prefixq.store.redis_errors import TRANSIENT, describe
from prefixq.store.webhook_outbox import aadd_burst_event, queue_burst_event

__all__ = [
    "CHUNK",
    "AsyncBurstDone",
    "BurstDone",
    "CancelReport",
    "OnBurstDone",
    "acancel",
    "cancel",
    "expire_due",
]

log = logging.getLogger(__name__)

#: what runs when a call here records a burst's last result (``client, settings, burst``): the
#: burst's ``on_complete`` (prefixq.integrations.rq_callbacks.enqueue_on_complete); idempotent
BurstDone = Callable[[redis.Redis, Settings, str], object]
#: the same on an event loop (prefixq.integrations.rq_callbacks.aenqueue_on_complete)
AsyncBurstDone = Callable[[aredis.Redis, Settings, str], Awaitable[object]]

#: one Redis call as a function of the client: a blocking client's gives the reply, an asyncio
#: client's an awaitable of it
_Call = Callable[[Any], Any]
T = TypeVar("T")
#: Redis calls written once for both kinds of client: a generator that yields each `_Call` and
#: is sent its reply; `_run` drives it with a blocking client, `_arun` on an event loop
_Steps = Generator[_Call, Any, T]
#: fails the missing indexes of a burst, or marks or completes it (lua/finish_missing.lua)
_FINISH = LuaScript("finish_missing")


@dataclass(frozen=True, slots=True)
class OnBurstDone:
    """Both forms of one burst-done hook, for what cancels from blocking code and from an event
    loop alike (a `Producer` and the `Burst` handles it returns):
    prefixq.integrations.rq_callbacks.RQ_ON_COMPLETE."""

    done: BurstDone
    adone: AsyncBurstDone


#: indexes per finish_missing call
CHUNK = 1000
#: cancel notices kept in `Keys.cancels` (workers read new ones only)
_NOTICES_KEPT = 10_000
_KEEP: dict[str, Any] = {"maxlen": _NOTICES_KEPT, "approximate": True}
#: bursts `expire_due` takes per call
_DUE_PER_CALL = 100
#: seconds past its deadline a deadline index entry without a record stays: its producer indexes
#: it just before creating the record, in one round trip (client/enqueue.py)
_CREATING_S = 60.0
_STILL_MISSING, _COMPLETED, _WAS_COMPLETE, _NO_RECORD = 1, 2, 3, -2
#: what the result of a request whose id the burst has no record of adds to its error
NO_ID = (
    " (its request id was never recorded: the burst's producer stopped before writing it, so "
    "this result has no id; its place in the burst's results is its input index)"
)
#: the worker name failed results carry
_WRITER = {"cancelled": "prefixq-cancel", "expired": "prefixq-expire"}
#: the fields of a burst record `_counts` reads
_COUNTED = ("total", "done", "failed", "status")


@dataclass(slots=True)
class CancelReport:
    """What `cancel` found and did. ``already_finished``: the burst had no request left to
    cancel (nothing was changed); ``cancelled``: requests this call failed as cancelled;
    ``ended``: this call recorded the burst's last result (and enqueued its ``on_complete``)."""

    burst: str
    status: str
    total: int
    done: int
    failed: int
    cancelled: int
    already_finished: bool
    ended: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class _Finisher:
    """The I/O-free part of finishing a burst's missing results, for `_finishing`: which
    commands to send for a chunk, and what to make of the replies."""

    def __init__(self, keys: Keys, settings: Settings, burst: str, reason: str) -> None:
        self.keys, self.settings, self.burst, self.reason = keys, settings, burst, reason
        self.now = time.time()
        self.recorded = 0
        self.completed = False
        self.state = _STILL_MISSING

    @property
    def script_keys(self) -> list[str]:
        k, b = self.keys, self.burst
        return [k.results(b), k.burst(b), k.events(b), k.ids(b)]

    def chunks(self, total: int) -> Iterator[range]:
        for start in range(0, total, CHUNK):
            if self.state in (_WAS_COMPLETE, _NO_RECORD) or self.completed:
                return
            yield range(start, min(total, start + CHUNK))

    def args(self, chunk: range, exists: list[Any], ids: list[bytes]) -> list[Any] | None:
        """The script's ARGV for the indexes of ``chunk`` without a result (None: none)."""
        missing = [i for i, there in zip(chunk, exists, strict=True) if not there]
        if not missing:
            return None
        out: list[Any] = [self.reason, self.settings.result_ttl_s, repr(self.now)]
        for i in missing:
            at = i - chunk.start
            rid = ids[at].decode("utf-8", "replace") if at < len(ids) else ""
            why = ENDED_ERRORS[self.reason] + ("" if rid else NO_ID)  # never an id made up
            res = Result.failed(rid, i, self.reason, why, worker=_WRITER[self.reason], now=self.now)
            out += [i, wire.encode(res.to_wire(), self.settings.codec)]
        return out

    def absorb(self, reply: Any) -> None:
        recorded, state = int(reply[0]), int(reply[1])
        self.recorded += recorded
        self.state = state
        self.completed = self.completed or state == _COMPLETED

    def look(self, chunk: range) -> _Call:
        """A pipeline asking which indexes of ``chunk`` have a result, and their request ids."""

        def call(r: Any) -> Any:
            pipe = r.pipeline(transaction=False)
            for i in chunk:
                pipe.hexists(self.keys.results(self.burst), str(i))
            pipe.lrange(self.keys.ids(self.burst), chunk.start, chunk.stop - 1)
            return pipe.execute()

        return call

    def script(self, args: list[Any]) -> _Call:
        """A finish_missing call with ARGV ``args``."""
        keys = self.script_keys
        return lambda r: _FINISH.either(r, keys, args)


def _no_index(f: _Finisher) -> list[Any]:
    """ARGV for a call with no index: it marks the burst ``cancelling``/``expiring`` (first
    call), or completes it if every result is in by now (last call)."""
    return [f.reason, f.settings.result_ttl_s, repr(f.now)]


# ---- the steps, written once, and their drivers -------------------------------------------------
def _finishing(f: _Finisher, total: int) -> _Steps[None]:
    """Fail every index of the burst below ``total`` that has no result, a chunk at a time."""
    f.absorb((yield f.script(_no_index(f))))
    for chunk in f.chunks(total):
        *exists, ids = yield f.look(chunk)
        args = f.args(chunk, exists, ids)
        if args is not None:
            f.absorb((yield f.script(args)))
    if not f.completed and f.state == _STILL_MISSING:
        f.absorb((yield f.script(_no_index(f))))


def _cancelling(
    settings: Settings, burst: str, on_burst_done: Callable[..., Any] | None
) -> _Steps[CancelReport]:
    """`cancel` and `acancel`, step by step."""
    keys = settings.keys
    before = _counts((yield lambda r: r.hmget(keys.burst(burst), *_COUNTED)), burst)
    if before is None:
        raise BurstNotFound(f"no burst {burst!r} in namespace {settings.namespace!r}")
    total, done, failed, status = before
    if done + failed >= total:
        return CancelReport(burst, status, total, done, failed, 0, True)
    f = _Finisher(keys, settings, burst, "cancelled")
    yield from _finishing(f, total)
    notice = _notice(burst, (yield lambda r: r.hget(keys.burst(burst), "created")))
    yield lambda r: r.xadd(keys.cancels, notice, **_KEEP)
    yield lambda r: r.zrem(keys.deadlines, burst)
    if f.completed:
        yield lambda r: queue_burst_event(r, settings, burst)  # its on_complete_url, if any
    if f.completed and on_burst_done is not None:
        yield lambda r: on_burst_done(r, settings, burst)
    after = _counts((yield lambda r: r.hmget(keys.burst(burst), *_COUNTED)), burst)
    total, done, failed, status = after or before
    log.info("burst %s cancelled: %d requests failed as cancelled", burst, f.recorded)
    return CancelReport(burst, status, total, done, failed, f.recorded, False, f.completed)


def _run(r: redis.Redis, steps: _Steps[T]) -> T:
    """Make the calls of ``steps`` with a blocking client; what the steps return."""
    reply = None
    while True:
        try:
            call = steps.send(reply)
        except StopIteration as end:
            value: T = end.value
            return value
        reply = call(r)


async def _arun(r: aredis.Redis, steps: _Steps[T]) -> T:
    """`_run` with an asyncio client."""
    reply = None
    while True:
        try:
            call = steps.send(reply)
        except StopIteration as end:
            value: T = end.value
            return value
        reply = await call(r)


# ---- sync -------------------------------------------------------------------------------------
def cancel(
    burst: str,
    settings: Settings,
    *,
    client: redis.Redis | None = None,
    on_burst_done: BurstDone | None = None,
) -> CancelReport:
    """Cancel ``burst``: queued requests are not run, requests in an engine are aborted, every
    request without a result gets one with ``error_code`` ``cancelled``; finished results stay.
    Idempotent; a burst with nothing left to cancel is reported as such and left unchanged.
    BurstNotFound for an unknown (or expired) burst. ``on_burst_done`` runs if this call ends it.
    """
    r = client or sync_client(settings)
    try:
        return _run(r, _cancelling(settings, burst, on_burst_done))
    except TRANSIENT as e:
        raise describe(settings, e) from e
    finally:
        if client is None:
            r.close()


# ---- async ------------------------------------------------------------------------------------
async def acancel(
    burst: str,
    settings: Settings,
    r: aredis.Redis,
    *,
    on_burst_done: AsyncBurstDone | None = None,
) -> CancelReport:
    """`cancel` inside an event loop, on the caller's client."""
    return await _arun(r, _cancelling(settings, burst, on_burst_done))


async def expire_due(
    r: aredis.Redis,
    settings: Settings,
    now: float | None = None,
    *,
    on_burst_done: AsyncBurstDone | None = None,
) -> list[str]:
    """Expire every burst whose deadline is at or before ``now``: its requests without a result
    get one with ``error_code`` ``expired``, its status becomes ``expired`` (finished results
    stay), and it leaves `Keys.deadlines`. Safe to run from several workers at once (each index
    is recorded once); returns the bursts this call expired. The record's deadline is the truth:
    a producer indexes its deadline before the record and only ever lowers an entry, so a submit
    whose id was taken may have lowered another burst's; a later deadline on the record moves the
    entry back to it, a record without one drops it. Bursts that had finished anyway, or whose
    record is gone (`_CREATING_S` after the deadline: a create may still be on its way) or
    corrupt, and members that are no burst id, only leave the index."""
    keys = settings.keys
    now = time.time() if now is None else now
    due = await r.zrangebyscore(
        keys.deadlines, "-inf", now, start=0, num=_DUE_PER_CALL, withscores=True
    )
    expired: list[str] = []
    for raw, score in due:
        try:  # anything with write access may have written the index: skip what is not a burst
            burst = raw.decode() if isinstance(raw, bytes) else str(raw)
            *counted, deadline = await r.hmget(keys.burst(burst), *_COUNTED, "deadline")
            before = _counts(counted, burst)
            when = None if before is None or deadline is None else float(deadline)
        except (UnicodeDecodeError, BurstRecordLost, ValueError) as e:
            log.warning("deadline index entry %r dropped: %s", raw, e)
            await r.zrem(keys.deadlines, raw)
            continue
        if before is None and score > now - _CREATING_S:
            continue
        if when is not None and when > now:  # lowered by a submission whose id was taken
            await r.zadd(keys.deadlines, {burst: when})
            continue
        if before is not None and when is not None and before[1] + before[2] < before[0]:
            f = _Finisher(keys, settings, burst, "expired")
            await _arun(r, _finishing(f, before[0]))
            notice = _notice(burst, await r.hget(keys.burst(burst), "created"), "expired")
            await r.xadd(keys.cancels, notice, **_KEEP)
            if f.completed:
                await aadd_burst_event(r, settings, burst)  # its on_complete_url, if any
            if f.completed and on_burst_done is not None:
                await on_burst_done(r, settings, burst)
            if f.recorded:
                expired.append(burst)
                log.info("burst %s expired: %d requests failed as expired", burst, f.recorded)
        await r.zrem(keys.deadlines, burst)
    return expired


def _notice(burst: str, created: bytes | None, reason: str = "") -> dict[Any, Any]:
    """A burst-end notice: the burst, why (absent: cancelled) and when the ended burst was
    created (``c``), so that workers do not apply it to a later burst of the same id."""
    notice: dict[Any, Any] = {"b": burst}
    if reason:
        notice["r"] = reason
    if created is not None:
        notice["c"] = created
    return notice


def _counts(raw: list[Any], burst: str = "") -> tuple[int, int, int, str] | None:
    """(total, done, failed, status) of a burst record, None if there is none (or no total);
    BurstRecordLost if its counters are not counts (a corrupt record)."""
    total, done, failed, status = raw
    if total is None:
        return None
    text = status.decode(errors="replace") if isinstance(status, bytes) else (status or "queued")
    try:
        counts = int(total), int(done or 0), int(failed or 0)
    except ValueError:
        raise BurstRecordLost(
            f"burst {burst!r}: its record is corrupt (total {total!r}, done {done!r}, failed "
            f"{failed!r} are not counts); nothing was changed"
        ) from None
    return (*counts, text)
