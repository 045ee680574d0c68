"""Queue and latency statistics: what `prefixq inspect` prints and the metrics exporter serves.

Per shard: entries in the stream (undelivered + pending, since acked entries are deleted),
pending (delivered, not acked), age of the oldest undelivered entry, live workers, in flight,
estimated outstanding prefill tokens, dead letters, predicted vs actual cached prompt tokens.
Per burst: progress and p50/p95/p99 of queue wait (enqueued -> admitted), admit -> first token,
and end to end (enqueued -> finished); prompt tokens served from the prefix cache.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import redis

from prefixq import results as results_api
from prefixq.deployment import resolve_shards_sync
from prefixq.keys import GROUP
from prefixq.records import Result
from prefixq.settings import Settings

PERCENTILES = (50, 95, 99)


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(p / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]


def _dist(values: list[float]) -> dict[str, float]:
    out = {f"p{p}": round(percentile(values, p), 6) for p in PERCENTILES}
    out["max"] = round(max(values), 6) if values else 0.0
    return out


def latency_summary(results: list[Result]) -> dict[str, Any]:
    """Counts, per-stage latency percentiles (seconds), tokens and cache hits of some results."""
    ok = [r for r in results if r.error is None]
    t = [r.timings for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    span = (max(x.finished for x in t) - min(x.enqueued for x in t)) if t else 0.0
    return {
        "results": len(results),
        "ok": len(ok),
        "failed": len(results) - len(ok),
        "queue_wait_s": _dist([x.admitted - x.enqueued for x in t]),
        "first_token_s": _dist([x.first_token - x.admitted for x in t if x.first_token]),
        "end_to_end_s": _dist([x.finished - x.enqueued for x in t]),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "predicted_cached_tokens": sum(r.predicted_cached_tokens for r in ok),
        "cached_ratio": round(cached / prompt, 4) if prompt else 0.0,
        "output_tokens": sum(r.output_tokens for r in ok),
        "span_s": round(span, 3),
        "requests_per_s": round(len(ok) / span, 3) if span > 0 else 0.0,
    }


def entry_age(entry_id: bytes | str | None, now: float) -> float:
    """Seconds since a stream entry was added (its id's millisecond part); 0 for none."""
    if not entry_id:
        return 0.0
    ms = int((entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-")[0])
    return round(max(0.0, now - ms / 1000), 3)


def queue_counts(length: int, group: Mapping[str, Any] | None) -> tuple[int, int, str | None]:
    """(waiting, pending, XRANGE start of the oldest waiting entry or None) of a shard stream,
    from its XLEN and its consumer group's XINFO GROUPS record (None before the group exists).

    Acked entries are deleted, so the stream holds exactly the waiting and the pending entries.
    """
    pending = int((group or {}).get("pending", 0) or 0)
    waiting = max(0, length - pending)
    if not waiting:
        return waiting, pending, None
    if group is None:
        return waiting, pending, "-"
    last = group["last-delivered-id"]
    return waiting, pending, "(" + (last.decode() if isinstance(last, bytes) else str(last))


def shard_stats(r: redis.Redis, settings: Settings, shards: int) -> list[dict[str, Any]]:
    """One dict per shard (see module docstring)."""
    keys = settings.keys
    now = time.time()
    load = {k.decode(): int(v) for k, v in r.hgetall(keys.load).items()}
    sstats = {k.decode(): int(v) for k, v in r.hgetall(keys.shard_stats).items()}
    out = []
    for k in range(shards):
        stream = keys.stream(k)
        pipe = r.pipeline(transaction=False)
        pipe.xlen(stream)
        pipe.xrange(stream, count=1)
        pipe.xlen(keys.dead(k))
        pipe.zrange(keys.workers(k), 0, -1)
        length, first, dead, names = pipe.execute()
        groups = {g["name"].decode(): g for g in r.xinfo_groups(stream)} if length or names else {}
        waiting, pending, start = queue_counts(length, groups.get(GROUP))
        oldest_waiting = 0.0
        if start is not None:
            nxt = first if start == "-" else r.xrange(stream, min=start, count=1)
            oldest_waiting = entry_age(nxt[0][0] if nxt else None, now)
        live, inflight = [], 0
        for name in names:
            hb = r.hgetall(keys.heartbeat(k, name.decode()))
            if hb:
                live.append(name.decode())
                inflight += int(hb.get(b"inflight", 0))
        out.append(
            {
                "shard": k,
                "stream_length": length,
                "waiting": waiting,
                "pending": pending,
                "oldest_waiting_s": oldest_waiting,
                "oldest_entry_age_s": entry_age(first[0][0] if first else None, now),
                "workers": len(live),
                "worker_names": live,
                "inflight": inflight,
                "outstanding_prefill_tokens": load.get(str(k), 0),
                "dead_letters": dead,
                "prompt_tokens": sstats.get(f"{k}:prompt", 0),
                "cached_tokens": sstats.get(f"{k}:cached", 0),
                "predicted_cached_tokens": sstats.get(f"{k}:predicted", 0),
            }
        )
    return out


def burst_stats(r: redis.Redis, settings: Settings, burst: str) -> dict[str, Any]:
    """Progress, byte counts and latency summary of one burst."""
    st = results_api.status(burst, settings, client=r)
    res = results_api.collect(burst, settings, client=r)
    m = st.meta
    raw, enc = int(m.get("raw_bytes", 0)), int(m.get("encoded_bytes", 0))
    return {
        "burst": burst,
        "status": "finished" if st.finished else st.status,
        "total": st.total,
        "done": st.done,
        "failed": st.failed,
        "created": st.created,
        "finished_at": st.finished_at,
        "placement": m.get("placement"),
        "per_shard": [int(x) for x in m.get("per_shard", "").split(",") if x],
        "raw_bytes": raw,
        "encoded_bytes": enc,
        "compression": round(raw / enc, 2) if enc else 0.0,
        **latency_summary(res),
    }


def snapshot(
    settings: Settings,
    *,
    burst: str | None = None,
    recent: int = 5,
    client: redis.Redis | None = None,
) -> dict[str, Any]:
    """Everything `inspect` shows: shards, then the given burst or the most recent ones."""
    from prefixq.connection import sync_client

    r = client or sync_client(settings)
    shards = resolve_shards_sync(r, settings)
    bursts = (
        [burst] if burst else [b.decode() for b in r.zrevrange(settings.keys.bursts, 0, recent - 1)]
    )
    return {
        "namespace": settings.namespace,
        "shards": shard_stats(r, settings, shards),
        "bursts": [
            burst_stats(r, settings, b)
            for b in bursts
            if r.exists(settings.keys.burst(b)) or b == burst
        ],
        "at": time.time(),
    }
