"""The fleet as `inspect` shows it (`fleet`): which shards have a live worker, which are orphaned,
and what moved between shards (the moves stream: orphaned queues, steals, drains, the operator's
hand-overs, and the placement's load guard), and a burst's results by worker (`shares`, from its
record).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import redis

from prefixq.core.settings import Settings
from prefixq.ops.tolerant import tolerant
from prefixq.store.liveness import Liveness
from prefixq.store.move_log import read_moves

__all__ = ["fleet", "shares"]

#: moves listed one by one
_RECENT = 5


def _float(v: bytes | None, default: float) -> float:
    try:
        return float(v) if v is not None else default
    except ValueError:
        return default


def fleet(
    r: redis.Redis, settings: Settings, shards: int, now: float, problems: list[str] | None = None
) -> dict[str, Any]:
    """Per shard: live, seconds without a live worker, orphaned, what it serves (generate or
    embed); the moves' totals by why
    (store/move_log.py) and the newest few."""
    keys = settings.keys
    pipe = r.pipeline(transaction=False)
    pipe.hgetall(keys.live)
    pipe.hgetall(keys.orphans)
    pipe.hget(keys.config, "orphan_after_s")
    pipe.hgetall(keys.tasks)
    live_raw, orphans_raw, workers_wait, tasks_raw = pipe.execute()
    state = Liveness.of(live_raw, orphans_raw, settings, shards, now, tasks_raw)
    # the workers' setting (they move the queues), else this reader's
    wait = _float(workers_wait, settings.orphan_after_s)
    per_shard = []
    for k in range(shards):
        alive, dead_for = state.alive(k), state.dead_for(k)
        orphaned = not alive and wait > 0 and dead_for >= wait
        per_shard.append(
            {
                "shard": k,
                "live": alive,
                "dead_for_s": round(dead_for, 1),
                "orphaned": orphaned,
                "task": state.task(k),
            }
        )
    nothing: tuple[dict[str, dict[str, int]], list[dict[str, str]]] = ({}, [])
    bad = problems if problems is not None else []
    totals, recent = tolerant(bad, "moves", nothing, read_moves, r, keys, _RECENT)
    return {
        "shards": per_shard,
        "orphan_after_s": wait,
        "moves": totals,
        "recent_moves": recent,
    }


def shares(meta: Mapping[str, str]) -> dict[str, int]:
    """How many of a burst's results each worker recorded, most first, from its record's
    ``w:<worker>`` counters (lua/record_result.lua; results a cancel or an expiry ended are
    nobody's)."""
    counts: Counter[str] = Counter()
    for k, v in meta.items():
        if k.startswith("w:") and v.lstrip("-").isdigit():
            counts[k[2:]] = int(v)
    return dict(counts.most_common())
