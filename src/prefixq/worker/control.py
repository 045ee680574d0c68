"""Operator commands to live workers, through a control stream (used by `prefixq bench`).

A command is an entry ``{cmd, id}`` on `Keys.control`; every worker reads the stream from the
moment it starts (XREAD BLOCK, no consumer group: each worker sees every command), runs the
command, and writes its answer under ``<id>:<worker>`` in `Keys.control_acks`. The worker passes
its handlers in (`Handlers`); the commands are ``reset_prefix_cache`` (between benchmark runs),
``gc_freeze`` / ``gc_unfreeze`` (to measure GC pauses with and without a frozen heap),
``reset_stats`` and ``stats`` (GC pauses, event-loop lag, admission timings), ``admission:NAME``
(worker/groups.py) and ``steal:on`` / ``steal:off`` (worker/fleet.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import ResponseError

from prefixq.core.keys import Keys
from prefixq.store.redis_errors import TRANSIENT
from prefixq.worker.groups import ADMISSIONS

log = logging.getLogger(__name__)

COMMANDS = (
    "reset_prefix_cache",
    "gc_freeze",
    "gc_unfreeze",
    "reset_stats",
    "stats",
    # worker/groups.py's admission orders, for `prefixq bench`
    *(f"admission:{name}" for name in ADMISSIONS),
    # worker/fleet.py's tail stealing, for `prefixq bench --fleet`
    "steal:off",
    "steal:on",
)
#: command -> coroutine that runs it; every answer also carries the worker's stats
Handlers = Mapping[str, Callable[[], Awaitable[None]]]


async def newest(r: aredis.Redis, keys: Keys) -> str | bytes | None:
    """The control stream's newest id ("0-0" when empty), where a worker's `control_loop`
    starts; None when Redis did not answer (the loop takes it itself). A worker takes it before
    it says it serves: a sender that waits for that (`prefixq bench` sends ``stats`` and
    ``reset_prefix_cache`` at once) posts after it, however late the loop's first read."""
    try:
        got = await r.xrevrange(keys.control, count=1)
    except (*TRANSIENT, ResponseError) as e:
        log.warning("control stream unavailable: %s", e)
        return None
    return got[0][0] if got else "0-0"


async def control_loop(
    r: aredis.Redis,
    keys: Keys,
    name: str,
    handlers: Handlers,
    stats: Callable[[], dict[str, Any]],
    start: str | bytes | None = None,
) -> None:
    """Run inside a worker: answer every command posted after ``start`` (`newest`, taken before
    the worker said it serves; None: the newest id when the loop starts). By id, never ``$``:
    each XREAD with ``$`` would wait for entries added after it was sent, so a command posted
    between two of them (one that timed out and the next, a moment that grows with the event
    loop's lag) was never answered."""
    last = start
    while True:
        try:
            if last is None:
                last = await newest(r, keys)
                if last is None:
                    await asyncio.sleep(1.0)
                    continue
            resp = await r.xread({keys.control: last}, count=10, block=1000)
        except (*TRANSIENT, ResponseError) as e:
            log.warning("control stream unavailable: %s", e)
            await asyncio.sleep(1.0)
            continue
        for entry_id, fields in resp[0][1] if resp else []:
            last = entry_id
            # anything with write access may have posted it: never let a field stop the loop
            cmd = fields.get(b"cmd", b"").decode(errors="replace")
            cid = fields.get(b"id", b"").decode(errors="replace")
            answer = await _run(cmd, handlers, stats)
            try:
                await r.hset(keys.control_acks, f"{cid}:{name}", json.dumps(answer))
                await r.expire(keys.control_acks, 3600)
            except (*TRANSIENT, ResponseError) as e:
                log.warning("control: could not answer %s: %s", cmd, e)


async def _run(cmd: str, handlers: Handlers, stats: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    handler = handlers.get(cmd)
    if handler is None and cmd != "stats":
        return {"ok": False, "error": f"unknown command {cmd!r}"}
    if handler is not None:
        await handler()
    log.info("control: %s done", cmd)
    return {"ok": True, **stats()}


async def send(
    r: aredis.Redis, keys: Keys, cmd: str, workers: list[str], wait_s: float = 60.0
) -> dict[str, dict[str, Any]]:
    """Post ``cmd`` and wait for every named worker's answer."""
    if cmd not in COMMANDS:
        raise ValueError(f"unknown control command {cmd!r} (one of {', '.join(COMMANDS)})")
    cid = secrets.token_hex(6)
    await r.xadd(keys.control, {"cmd": cmd, "id": cid}, maxlen=1000, approximate=True)
    deadline = time.monotonic() + wait_s
    fields = [f"{cid}:{name}" for name in workers]
    while True:
        got = await r.hmget(keys.control_acks, fields)
        if all(g is not None for g in got):
            return {n: json.loads(g) for n, g in zip(workers, got, strict=True)}
        if time.monotonic() > deadline:
            missing = [n for n, g in zip(workers, got, strict=True) if g is None]
            raise TimeoutError(f"no answer to {cmd} from {missing}")
        await asyncio.sleep(0.05)
