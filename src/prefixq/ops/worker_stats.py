"""A shard's workers as `inspect` shows them: the live ones (heartbeat present) with their pending
entries and what their last heartbeat said (`live_workers`), and those whose heartbeat expired
while they are still in the shard's worker set (`gone_workers`).
"""

from __future__ import annotations

import math
from typing import Any

import redis

from prefixq.core.keys import GROUP, Keys
from prefixq.ops import queues
from prefixq.ops.tolerant import tolerant

__all__ = ["gone_workers", "live_workers"]

#: workers with an expired heartbeat listed per shard (``workers_gone``), newest first
_GONE_SHOWN = 20


def live_workers(
    r: redis.Redis, keys: Keys, shard: int, names: list[str], now: float
) -> list[dict[str, Any]]:
    """The live workers of a shard (heartbeat present): their pending entries in every stream of
    the shard (consumer groups, exact) and what their last heartbeat said (``inflight_at_beat``,
    ``beat_age_s`` old)."""
    pending: dict[str, int] = {}
    if names:
        # a lane index of another type: the intakes alone (`queues.read` names the problem)
        index: dict[bytes, bytes] = tolerant([], "lanes", {}, r.hgetall, keys.lanes(shard))
        streams = queues.QueueRead(keys, shard).set_index(index)
        pipe = r.pipeline(transaction=False)
        for key in streams:
            pipe.xpending(key, GROUP)
        for summary in pipe.execute(raise_on_error=False):
            if isinstance(summary, Exception):
                continue
            for c in summary.get("consumers") or ():
                name = c["name"].decode()
                pending[name] = pending.get(name, 0) + int(c["pending"])
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.hmget(keys.heartbeat(shard, name), ["inflight", "beat", *_BEAT_DETAIL])
    beats = pipe.execute() if names else []
    out = []
    for name, (inflight, beat, *detail) in zip(names, beats, strict=True):
        if inflight is None and beat is None:  # heartbeat expired: not live
            continue
        age = round(max(0.0, now - _number(beat, now)), 3)
        every = _number(detail[_BEAT_DETAIL.index("every_s")], 0.0)
        out.append(
            {
                "name": name,
                "pending": pending.get(name, 0),
                "inflight_at_beat": int(inflight or 0),
                "beat_age_s": age,
                **{
                    k: _number(v, 0.0) if k not in ("host", "gpu") else _text(v)
                    for k, v in zip(_BEAT_DETAIL, detail, strict=True)
                },
                # missed three beats: still listed until its heartbeat's TTL ends, but quiet
                "quiet": bool(every) and age > 3 * every,
            }
        )
    return out


#: heartbeat fields a worker's row carries besides the above (worker.health and heartbeat.py)
_BEAT_DETAIL = (
    "host",
    "gpu",
    "engine_up",
    "stopping",
    "max_inflight",
    "started",
    "every_s",
    "admitted",
    "finished",
    "failed",
    "gc_max_pause_ms",
    "gc_pauses",
    "loop_lag_p99_ms",
    "loop_lag_max_ms",
)


def _number(raw: bytes | None, default: float) -> float:
    """A heartbeat field as a number (ints stay ints); ``default`` when absent or not one."""
    try:
        v = float(raw) if raw is not None else default
    except ValueError:
        return default
    if not math.isfinite(v):
        return default
    return int(v) if v.is_integer() and b"." not in (raw or b"") else v


def _text(raw: bytes | None) -> str:
    return raw.decode(errors="replace")[:200] if raw is not None else ""


def gone_workers(r: redis.Redis, keys: Keys, shard: int, live: set[str], now: float) -> list[Any]:
    """Workers still in the shard's worker set whose heartbeat expired (killed, hung, or cut off
    from Redis): name and age of their last beat, newest first."""
    rows = r.zrevrange(keys.workers(shard), 0, len(live) + _GONE_SHOWN - 1, withscores=True)
    return [
        {"name": n.decode(errors="replace"), "last_beat_age_s": round(max(0.0, now - t), 3)}
        for n, t in rows
        if n.decode(errors="replace") not in live
    ]
