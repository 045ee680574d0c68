"""The shards' rolling history as series over time: what the dashboard's charts draw.

Workers write the samples (prefixq.worker.history: one per worker every ``history_every_s``,
waiting and pending entries of the shard, and the requests the worker finished, failed and
admitted since its previous sample). `series` reads the window asked for (one ``XRANGE`` per
shard, pipelined) and puts the samples into equal steps: per step and shard, the last sample's
``waiting``, ``pending`` and ``in_engine`` (summed over the workers that sampled in that step),
and the requests finished and failed per second (the workers' deltas summed, over the step).
A step without any sample of a shard is ``null`` there (no worker sampled: none was alive, or
Redis was unreachable); ``total`` adds the shards up where at least one has a value.
"""

from __future__ import annotations

import math
import time
from typing import Any

import redis

from prefixq.core.keys import Keys

__all__ = ["MAX_POINTS", "series"]

#: most steps a series has (the step grows with the window)
MAX_POINTS = 120
_GAUGES = ("waiting", "pending")
_RATES = ("done_per_s", "failed_per_s")
#: sample field -> series
_FIELDS = {"q": "waiting", "p": "pending", "d": "done_per_s", "f": "failed_per_s"}


def _int(raw: bytes | None) -> int:
    try:
        return int(raw or 0)
    except ValueError:
        return 0


def series(
    r: redis.Redis,
    keys: Keys,
    shards: int,
    *,
    window_s: float = 3600.0,
    step_s: float = 0.0,
    now: float | None = None,
) -> dict[str, Any]:
    """Per shard and in total, ``MAX_POINTS`` steps at most ending at ``now``: ``t`` (each step's
    start), ``waiting``, ``pending``, ``in_engine``, ``done_per_s``, ``failed_per_s``."""
    now = time.time() if now is None else now
    step = max(step_s, window_s / MAX_POINTS, 1.0)
    n = max(1, math.ceil(window_s / step))
    start = now - n * step
    pipe = r.pipeline(transaction=False)
    for k in range(shards):
        pipe.xrange(keys.history(k), min=int(start * 1000))
    replies = pipe.execute() if shards else []
    per_shard: list[dict[str, Any]] = []
    for k, entries in enumerate(replies):
        per_shard.append({"shard": k, **_steps(entries, start, step, n)})
    total: dict[str, list[float | None]] = {}
    for name in (*_GAUGES, "in_engine", *_RATES):
        total[name] = [
            None if all(s[name][i] is None for s in per_shard) else
            round(sum(s[name][i] or 0 for s in per_shard), 3)
            for i in range(n)
        ]  # fmt: skip
    return {
        "window_s": window_s,
        "step_s": step,
        "t": [round(start + i * step, 3) for i in range(n)],
        "total": total,
        "shards": per_shard,
        "at": now,
    }


def _steps(entries: list[Any], start: float, step: float, n: int) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {name: [None] * n for name in (*_GAUGES, "in_engine", *_RATES)}
    #: per step: worker -> its last sample's engine count; the step's last gauges
    engines: list[dict[bytes, int]] = [{} for _ in range(n)]
    for entry_id, f in entries:
        t = int(entry_id.split(b"-")[0]) / 1000
        i = int((t - start) / step)
        if not 0 <= i < n:
            continue
        for field, name in _FIELDS.items():
            v = _int(f.get(field.encode()))
            if name in _GAUGES:
                out[name][i] = v  # entries come oldest first: the last one stays
            else:
                out[name][i] = (out[name][i] or 0) + v
        engines[i][f.get(b"w", b"")] = _int(f.get(b"e"))
    for i in range(n):
        if engines[i]:
            out["in_engine"][i] = sum(engines[i].values())
        for name in _RATES:
            if out[name][i] is not None:
                out[name][i] = round(out[name][i] / step, 3)
    return out
