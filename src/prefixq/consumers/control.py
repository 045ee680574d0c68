"""Operator commands to live workers, through a control stream (used by `prefixq bench`).

A command is an entry ``{cmd, id}`` on `Keys.control`; every worker reads the stream from the
moment it starts (XREAD BLOCK, no consumer group: each worker sees every command), runs the
command, and writes its answer under ``<id>:<worker>`` in `Keys.control_acks`. Commands:
``reset_prefix_cache`` (between benchmark runs), ``gc_freeze`` / ``gc_unfreeze`` (to measure GC
pauses with and without a frozen heap), ``reset_gc_stats`` and ``gc_stats`` (answers only).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

import redis.asyncio as aredis

from prefixq.connection import TRANSIENT
from prefixq.keys import Keys

if TYPE_CHECKING:
    from prefixq.consumers.worker import Worker

log = logging.getLogger(__name__)

COMMANDS = ("reset_prefix_cache", "gc_freeze", "gc_unfreeze", "reset_gc_stats", "gc_stats")


async def control_loop(w: Worker) -> None:
    """Run inside a worker: answer every command posted after the worker started."""
    last = "$"
    while True:
        try:
            resp = await w.r.xread({w.keys.control: last}, count=10, block=1000)
        except TRANSIENT as e:
            log.warning("control stream unavailable: %s", e)
            await asyncio.sleep(1.0)
            continue
        for entry_id, fields in resp[0][1] if resp else []:
            last = entry_id
            cmd = fields.get(b"cmd", b"").decode()
            cid = fields.get(b"id", b"").decode()
            answer = await _run(w, cmd)
            await w.r.hset(w.keys.control_acks, f"{cid}:{w.name}", json.dumps(answer))
            await w.r.expire(w.keys.control_acks, 3600)


async def _run(w: Worker, cmd: str) -> dict[str, Any]:
    if cmd == "reset_prefix_cache":
        await w.engine.reset_prefix_cache()
    elif cmd == "gc_freeze":
        w.heap.freeze()
    elif cmd == "gc_unfreeze":
        w.heap.unfreeze()
    elif cmd == "gc_stats":
        pass
    elif cmd == "reset_gc_stats":
        w.gc.reset()
    else:
        return {"ok": False, "error": f"unknown command {cmd!r}"}
    log.info("control: %s done", cmd)
    return {"ok": True, "frozen": gc.get_freeze_count(), **w.gc.stats(), **w.heap.stats()}


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
