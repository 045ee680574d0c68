"""The webhook outbox in Redis: deliveries queued durably where the end they announce is written,
claimed by deliverers (prefixq.ops.webhook_delivery) and settled after each attempt.

A delivery is a JSON record in `Keys.hooks` (``url``, the event ``body`` sent as is on every
attempt, ``first``: when it was queued, ``attempts``, the last ``error``) under its ``webhook-id``,
and its next attempt's time in `Keys.hooks_due`. Both live in the ``{oai}`` slot, so that:

- a batch's deliveries are queued by lua/batch_transition.lua in the same script that moves it to
  its final status (`transition_args`): a batch that ended has its deliveries, whatever dies next;
- a burst's delivery (its ``on_complete_url``) is queued by whoever sees it end (the worker that
  records its last result, a cancel, an expiry, `prefixq reclaim`: `add_burst_event`), under an id
  derived from the burst, once (lua/hook_add.lua); its producer lists the burst in
  `Keys.hook_bursts` before creating it, and every deliverer's `sweep_bursts` queues the event of
  a listed burst that ended, so one that died before queueing it loses nothing.

`claim` takes due deliveries (lua/hook_claim.lua) and pushes them past the attempt, so two
deliverers send each one once while both live; `settle` records the outcome (lua/hook_settle.lua)
and counts it in `Keys.hooks_stats`. docs/operations.md, "Receiving webhooks", has the whole
design.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aredis

from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.core.webhooks import NamespaceHooks, event_body, new_delivery_id
from prefixq.store.lua_script import LuaScript

__all__ = [
    "BURST_EVENTS",
    "Delivery",
    "aadd_burst_event",
    "add_burst_event",
    "claim",
    "queue_burst_event",
    "settle",
    "sweep_bursts",
    "transition_args",
    "watch_burst",
]

log = logging.getLogger(__name__)

#: the outbox's scripts: queue a delivery once, claim due ones, settle an attempt
_ADD, _CLAIM, _SETTLE = LuaScript("hook_add"), LuaScript("hook_claim"), LuaScript("hook_settle")

#: a burst's end status -> the event its ``on_complete_url`` is sent
BURST_EVENTS = {
    b"finished": "batch.completed",
    b"cancelled": "batch.cancelled",
    b"expired": "batch.expired",
}


@dataclass(slots=True)
class Delivery:
    """One queued delivery, as a deliverer claimed it."""

    id: str
    url: str
    body: str
    first: float
    attempts: int = 0
    error: str = ""

    @classmethod
    def load(cls, delivery_id: str, raw: str | bytes) -> Delivery:
        d = json.loads(raw)
        first, attempts = float(d["first"]), int(d["attempts"])
        return cls(delivery_id, d["url"], d["body"], first, attempts, str(d.get("error", "")))

    def dumps(self) -> str:
        fields = ("url", "body", "first", "attempts", "error")
        return json.dumps({f: getattr(self, f) for f in fields})


def transition_args(hooks: NamespaceHooks, batch_id: str, status: str, now: float) -> list[Any]:
    """lua/batch_transition.lua's ARGV[6..] before the fields: when due, how many deliveries and
    each (id, record), for a move to ``status`` (the endpoints that take ``batch.<status>``)."""
    out: list[Any] = [int(now * 1000)]
    wanting = hooks.wanting(f"batch.{status}")
    out.append(len(wanting))
    if wanting:
        body = event_body(f"batch.{status}", batch_id, now)  # one event, to each endpoint
        for e in wanting:
            out += [new_delivery_id(), Delivery("", e.url, body, now).dumps()]
    return out


def _burst_delivery(
    settings: Settings, burst: str, raw: list[Any]
) -> tuple[list[str], list[Any]] | None:
    """lua/hook_add.lua's KEYS and ARGV for a burst whose record fields (``on_complete_url``,
    ``status``, ``created``) are ``raw``; None when it has no URL or has not ended."""
    url, status, created = raw
    event = BURST_EVENTS.get(status if isinstance(status, bytes) else b"")
    if url is None or event is None:
        return None
    k, now = settings.keys, time.time()
    stamp = created.decode() if isinstance(created, bytes) else ""
    did = new_delivery_id(settings.namespace, burst, stamp)
    body = event_body(event, burst, now, "evt_" + did[3:])
    rec = Delivery(did, url.decode(), body, now).dumps()
    return (
        [k.hooks, k.hooks_due, k.hook_seen(did)],
        [did, rec, int(now * 1000), settings.result_ttl_s],
    )


_FIELDS = ("on_complete_url", "status", "created")


def add_burst_event(r: redis.Redis, settings: Settings, burst: str) -> bool:
    """Queue the burst's ``on_complete_url`` delivery if it has one and has ended (once, whoever
    calls); True if this call queued it."""
    call = _burst_delivery(settings, burst, r.hmget(settings.keys.burst(burst), _FIELDS))
    if call is None:
        return False
    return bool(_ADD.call(r, keys=call[0], args=call[1]))


async def aadd_burst_event(r: aredis.Redis, settings: Settings, burst: str) -> bool:
    """`add_burst_event` on an event loop."""
    raw = await r.hmget(settings.keys.burst(burst), _FIELDS)
    call = _burst_delivery(settings, burst, raw)
    if call is None:
        return False
    return bool(await _ADD.acall(r, keys=call[0], args=call[1]))


def queue_burst_event(r: Any, settings: Settings, burst: str) -> Any:
    """`add_burst_event` with either kind of client: an asyncio client's call gives an awaitable
    (for prefixq.store.burst_end's steps, written once for both)."""
    if isinstance(r, aredis.Redis | aredis.RedisCluster):
        return aadd_burst_event(r, settings, burst)
    return add_burst_event(r, settings, burst)


#: bursts `sweep_bursts` looks at per call
_WATCHED_PER_CALL = 500
#: seconds a watched burst without a record stays watched (its producer lists it just before
#: creating it; a submit that failed leaves none)
_CREATING_S = 600.0


async def watch_burst(r: aredis.Redis, settings: Settings, burst: str) -> None:
    """List a burst with an ``on_complete_url`` for `sweep_bursts` (its producer, before the
    burst's record is written)."""
    await r.zadd(settings.keys.hook_bursts, {burst: time.time()})


async def sweep_bursts(r: aredis.Redis, settings: Settings) -> int:
    """Queue the event of every watched burst that has ended (once: `aadd_burst_event`) and stop
    watching it, and bursts that have no URL or no record; returns how many were queued. Whoever
    ends a burst queues its event at once; this catches a process that died before it did."""
    k, now = settings.keys, time.time()
    watched = await r.zrange(k.hook_bursts, 0, _WATCHED_PER_CALL - 1, withscores=True)
    pipe = r.pipeline(transaction=False)
    for raw, _ in watched:
        pipe.hmget(k.burst(raw.decode() if isinstance(raw, bytes) else str(raw)), _FIELDS)
    records = await pipe.execute() if watched else []
    queued = 0
    for (raw, since), (url, status, created) in zip(watched, records, strict=True):
        burst = raw.decode() if isinstance(raw, bytes) else str(raw)
        if created is None and now - since < _CREATING_S:
            continue  # being created, or gone (dropped after _CREATING_S)
        if created is not None and url is not None and status not in BURST_EVENTS:
            continue  # still running
        if url is not None and status in BURST_EVENTS:
            queued += await aadd_burst_event(r, settings, burst)
        await r.zrem(k.hook_bursts, raw)
    return queued


async def claim(r: aredis.Redis, keys: Keys, most: int, hold_s: float) -> list[Delivery]:
    """Take up to ``most`` due deliveries, each held for ``hold_s`` (past one attempt)."""
    now = time.time()
    reply = await _CLAIM.acall(
        r,
        keys=[keys.hooks_due, keys.hooks],
        args=[int(now * 1000), int((now + hold_s) * 1000), most],
    )
    out = []
    for i in range(0, len(reply), 2):
        did = reply[i].decode() if isinstance(reply[i], bytes) else str(reply[i])
        try:
            out.append(Delivery.load(did, reply[i + 1]))
        except (ValueError, KeyError, TypeError) as e:  # written by something else: never sent
            log.error("webhook %s: its outbox record is not one (%s): dropped", did, e)
            await settle(r, keys, Delivery(did, "", "", 0.0), "gave_up")
    return out


async def settle(r: aredis.Redis, keys: Keys, d: Delivery, outcome: str, due: float = 0.0) -> bool:
    """Record an attempt's ``outcome``: ``delivered``, ``retried`` (next attempt at ``due``,
    epoch s; ``d`` as updated) or ``gave_up``; False if another deliverer settled it."""
    args: list[Any] = [d.id, outcome]
    if outcome == "retried":
        args += [d.dumps(), int(due * 1000)]
    keys_ = [keys.hooks_due, keys.hooks, keys.hooks_stats]
    return bool(await _SETTLE.acall(r, keys=keys_, args=args))
