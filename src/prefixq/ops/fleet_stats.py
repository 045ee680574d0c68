"""The fleet as `inspect` shows it (`fleet`): which shards have a live worker, which are orphaned,
and what moved between shards (the moves stream: orphaned queues, steals, drains, the operator's
hand-overs, and the placement's load guard), and a burst's results by worker (`shares`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import redis

from prefixq.core import wire
from prefixq.core.errors import PrefixqError
from prefixq.core.settings import Settings
from prefixq.store.liveness import Liveness

__all__ = ["fleet", "shares"]

#: moves read from the stream for the totals (its newest; the stream keeps 10,000)
_MOVES = 10_000
#: moves listed one by one
_RECENT = 5


def _num(v: bytes | None) -> float:
    try:
        return float(v) if v is not None else 0.0
    except ValueError:
        return 0.0


def fleet(r: redis.Redis, settings: Settings, shards: int, now: float) -> dict[str, Any]:
    """Per shard: live, seconds without a live worker, orphaned; the moves by why."""
    keys = settings.keys
    pipe = r.pipeline(transaction=False)
    pipe.hgetall(keys.live)
    pipe.hgetall(keys.orphans)
    pipe.xrevrange(keys.moves, count=_MOVES)
    live_raw, orphans_raw, moves = pipe.execute()
    state = Liveness.of(live_raw, orphans_raw, settings, shards, now)
    per_shard = []
    for k in range(shards):
        alive, dead_for = state.alive(k), state.dead_for(k)
        orphaned = not alive and settings.orphan_after_s > 0 and dead_for >= settings.orphan_after_s
        per_shard.append(
            {"shard": k, "live": alive, "dead_for_s": round(dead_for, 1), "orphaned": orphaned}
        )
    totals: dict[str, dict[str, int]] = {}
    recent: list[dict[str, str]] = []
    for _, f in moves:
        why = (f.get(b"why") or b"guard").decode(errors="replace")
        t = totals.setdefault(why, {"groups": 0, "requests": 0, "tokens": 0})
        t["groups"] += 1
        t["requests"] += int(_num(f.get(b"requests")))
        t["tokens"] += int(_num(f.get(b"tokens")))
        if len(recent) < _RECENT:
            recent.append(
                {k.decode(errors="replace"): v.decode(errors="replace") for k, v in f.items()}
            )
    return {"shards": per_shard, "moves": totals, "recent_moves": recent}


def shares(r: redis.Redis, settings: Settings, burst: str) -> dict[str, int]:
    """How many of a burst's results each worker recorded (a failed or ended one by its
    recorder), most first."""
    counts: Counter[str] = Counter()
    limits = wire.Limits.from_settings(settings)
    for _, raw in r.hscan_iter(settings.keys.results(burst), count=1000):
        try:
            d = wire.decode(raw, limits)
        except PrefixqError:
            continue
        if isinstance(d, dict):
            counts[str(d.get("w") or "?")] += 1
    return dict(counts.most_common())
