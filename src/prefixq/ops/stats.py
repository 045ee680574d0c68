"""Queue and latency statistics: what `prefixq inspect` prints and the metrics exporter serves
(`snapshot`; per shard `shard_stats`, per priority and tenant `sharing`, per burst `burst_stats`).

Nothing here writes to Redis but the pruning of burst index entries whose record is gone. What
could grow without end costs a bounded amount per call: a burst's percentiles come from a uniform
random sample of at most `SAMPLE` results (``HRANDFIELD``), and at most `PRUNE` of the oldest
index entries are checked. Counts from burst records and consumer groups are exact; percentiles
are a sample's. docs/operations.md, "Live view: `prefixq inspect --watch`", says what each figure
means.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any

import redis
from redis.exceptions import ResponseError

from prefixq.client import results as results_api
from prefixq.core import wire
from prefixq.core.errors import BurstNotFound
from prefixq.core.keys import Keys
from prefixq.core.records import Result
from prefixq.core.settings import Settings
from prefixq.core.sharing import band
from prefixq.ops import distributions, queues
from prefixq.ops.fleet_stats import fleet, shares
from prefixq.ops.queues import ShardQueues
from prefixq.ops.tolerant import tolerant
from prefixq.ops.worker_stats import gone_workers, live_workers
from prefixq.store.deployment import resolve_shards
from prefixq.store.liveness import load_of

PERCENTILES = (50, 95, 99)
#: results read per burst for its latency percentiles (a uniform random sample beyond that)
SAMPLE = 1000
#: index entries of the burst index checked per call for a record that is gone (oldest first)
PRUNE = 100


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


def _latencies(ok: list[Result]) -> dict[str, dict[str, float]]:
    t = [r.timings for r in ok]
    return {
        "queue_wait_s": _dist([x.admitted - x.enqueued for x in t]),
        "first_token_s": _dist([x.first_token - x.admitted for x in t if x.first_token]),
        "end_to_end_s": _dist([x.finished - x.enqueued for x in t]),
    }


def shard_stats(
    r: redis.Redis,
    settings: Settings,
    shards: int,
    lane_bursts: dict[tuple[str, str], set[str]] | None = None,
    problems: list[str] | None = None,
) -> list[dict[str, Any]]:
    """One dict per shard, over all its streams (intakes and lanes: prefixq.ops.queues): entries
    waiting (not yet delivered) and pending (in flight: delivered, not acked; from the consumer
    groups, so exact once results are acked), age of the oldest waiting entry, the same per
    priority and tenant (``queues``), live workers (each with its pending entries and the
    in-flight count of its last heartbeat), estimated outstanding prefill tokens, dead letters,
    predicted vs actual cached prompt tokens, and per priority and tenant the requests admitted
    and their queue waits summed (workers count them as they ack). ``lane_bursts`` gets the ids
    of the bursts with a lane, per priority and tenant, over all shards. A part held in a key of
    another type is left out (zero, none) and named in ``problems`` (ops/tolerant.py)."""
    keys = settings.keys
    now = time.time()
    bad = problems if problems is not None else []
    raw_load: dict[bytes, bytes] = tolerant(bad, "prefill backlog", {}, r.hgetall, keys.load)
    load = load_of(raw_load, range(shards))
    raw: dict[bytes, bytes] = tolerant(bad, "cached tokens", {}, r.hgetall, keys.shard_stats)
    sstats = {k.decode(): v for k, v in raw.items()}
    out = []
    for k in range(shards):
        q = tolerant(bad, f"shard {k}'s queues", ShardQueues(), queues.read, r, keys, k)
        if lane_bursts is not None:
            for x in q.queues():
                lane_bursts.setdefault((x.priority, x.tenant), set()).update(x.burst_ids)
        dead: int = tolerant(bad, f"shard {k}'s dead letters", 0, r.xlen, keys.dead(k))
        names: list[bytes] = tolerant(
            bad, f"shard {k}'s workers", [], r.zrange, keys.workers(k), 0, -1
        )
        workers = live_workers(r, keys, k, [n.decode() for n in names], now)
        gone = (
            gone_workers(r, keys, k, {w["name"] for w in workers}, now)
            if len(workers) < len(names)
            else []
        )
        out.append(
            {
                "shard": k,
                "stream_length": q.waiting + q.pending + q.ended,
                "waiting": q.waiting,
                # entries of cancelled or expired bursts that no worker has skipped yet
                "ended_waiting": q.ended,
                "pending": q.pending,
                "oldest_waiting_s": q.oldest_waiting_s,
                "oldest_entry_age_s": q.oldest_entry_age_s,
                "lanes": q.lanes,
                "queues": [x.to_json() for x in q.queues()],
                "workers": len(workers),
                "worker_names": [w["name"] for w in workers],
                "worker_detail": workers,
                "workers_gone": gone,
                "inflight": q.pending,
                "outstanding_prefill_tokens": int(load[k]),
                "dead_letters": dead,
                "prompt_tokens": int(sstats.get(f"{k}:prompt", 0)),
                "cached_tokens": int(sstats.get(f"{k}:cached", 0)),
                "predicted_cached_tokens": int(sstats.get(f"{k}:predicted", 0)),
                "admitted": _admitted(sstats, k),
            }
        )
    return out


def _admitted(sstats: Mapping[str, bytes], k: int) -> dict[str, tuple[int, float]]:
    """``"priority tenant"`` -> (requests admitted, their queue waits summed, s), as workers
    count them when they ack (`ShardStream.ack`)."""
    out: dict[str, tuple[int, float]] = {}
    head = f"{k}:admitted:"
    for field, raw in sstats.items():
        if field.startswith(head):
            prio, _, tenant = field[len(head) :].partition(":")
            waited = float(sstats.get(f"{k}:waited:{prio}:{tenant}", b"0"))
            out[f"{prio} {tenant}"] = (int(raw), waited)
    return out


def sharing(
    shards: list[dict[str, Any]], lane_bursts: dict[tuple[str, str], set[str]] | None = None
) -> list[dict[str, Any]]:
    """Per priority and tenant over every shard: waiting, in flight, oldest wait, active bursts
    (each once, given ``lane_bursts``, however many shards it has a lane on; else summed over
    shards), and the mean queue wait of the requests admitted so far."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}

    def row(prio: str, tenant: str) -> dict[str, Any]:
        return rows.setdefault(
            (prio, tenant),
            {
                "priority": prio,
                "tenant": tenant,
                "waiting": 0,
                "in_flight": 0,
                "oldest_waiting_s": 0.0,
                "bursts": 0,
                "admitted": 0,
                "mean_queue_wait_s": 0.0,
            },
        )

    waited: dict[tuple[str, str], float] = {}
    for sh in shards:
        for q in sh.get("queues", ()):
            x = row(q["priority"], q["tenant"])
            x["waiting"] += q["waiting"]
            x["in_flight"] += q["pending"]
            x["bursts"] += q["bursts"]
            x["oldest_waiting_s"] = max(x["oldest_waiting_s"], q["oldest_waiting_s"])
        for name, (n, w) in sh.get("admitted", {}).items():
            prio, _, tenant = name.partition(" ")
            row(prio, tenant)["admitted"] += n
            waited[(prio, tenant)] = waited.get((prio, tenant), 0.0) + w
    for key, x in rows.items():
        if lane_bursts is not None:
            x["bursts"] = len(lane_bursts.get(key, ()))
        if x["admitted"]:
            x["mean_queue_wait_s"] = round(waited.get(key, 0.0) / x["admitted"], 3)
    return sorted(rows.values(), key=lambda x: (band(x["priority"]), x["tenant"]))


def shown_status(st: results_api.BurstStatus) -> str:
    """What `inspect` calls a burst: its record's end (cancelled, expired) or finished once
    every request has a result; running once the first result is in; else its record's own
    (queued, cancelling)."""
    if st.status in ("cancelled", "expired"):
        return st.status
    if st.finished:
        return "finished"
    if st.status == "queued" and st.done + st.failed > 0:
        return "running"
    return st.status


def burst_stats(
    r: redis.Redis, settings: Settings, burst: str, problems: list[str] | None = None
) -> dict[str, Any]:
    """Progress, byte counts and token counters of one burst (its record), and latency
    percentiles from at most `SAMPLE` of its results, read at random; results held in a key of
    another type are left out and named in ``problems``."""
    st = results_api.status(burst, settings, client=r)

    def sample_results() -> tuple[int, list[bytes]]:
        pipe = r.pipeline(transaction=False)
        pipe.hlen(settings.keys.results(burst))
        pipe.hrandfield(settings.keys.results(burst), SAMPLE, withvalues=True)
        n, flat = pipe.execute()
        return n, flat

    bad = problems if problems is not None else []
    nothing: tuple[int, list[bytes]] = (0, [])
    n, flat = tolerant(bad, f"burst {burst}'s results", nothing, sample_results)
    limits = wire.Limits.from_settings(settings)
    pairs = zip((flat or [])[::2], (flat or [])[1::2], strict=True)
    sample = [
        results_api.read_stored(v, int(k) if k.isdigit() else -1, "", limits) for k, v in pairs
    ]
    ok = [x for x in sample if x.error is None]
    m = st.meta
    raw, enc = int(m.get("raw_bytes", 0)), int(m.get("encoded_bytes", 0))
    prompt, cached = int(m.get("prompt_tokens", 0)), int(m.get("cached_tokens", 0))
    # throughput over the burst: from its first enqueue to its last finish (the record's time
    # once finished; before that the latest finish in the sample)
    t = [x.timings for x in ok]
    end = (
        st.finished_at
        if st.finished and st.finished_at
        else max((x.finished for x in t), default=0)
    )
    begin = min((x.enqueued for x in t), default=st.created)
    span = max(0.0, end - begin) if end else 0.0
    # output tokens are not counted in the record: summed when every result was read, else
    # the sample's mean per successful request times the successful requests
    out_tokens = sum(x.output_tokens for x in ok)
    if len(sample) < n and ok:
        out_tokens = round(out_tokens / len(ok) * st.done)
    return {
        "burst": burst,
        # a cancelled or expired burst is finished too; its record says which
        "status": shown_status(st),
        "total": st.total,
        "done": st.done,
        "failed": st.failed,
        "created": st.created,
        "finished_at": st.finished_at,
        "placement": m.get("placement"),
        "priority": m.get("priority", "normal"),
        "tenant": m.get("tenant", "default"),
        "per_shard": [int(x) for x in m.get("per_shard", "").split(",") if x],
        # results recorded by each worker (its share of the burst), most first
        "workers": shares(m),
        "raw_bytes": raw,
        "encoded_bytes": enc,
        "compression": round(raw / enc, 2) if enc else 0.0,
        "results": n,
        "ok": st.done,
        "sampled": len(sample),
        **_latencies(ok),
        "histograms": distributions.histograms(ok),
        "timeline": distributions.timeline(sample, n / len(sample) if sample else 1.0),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "predicted_cached_tokens": int(m.get("predicted_cached_tokens", 0)),
        "cached_ratio": round(cached / prompt, 4) if prompt else 0.0,
        "output_tokens": out_tokens,
        "span_s": round(span, 3),
        "requests_per_s": round(st.done / span, 3) if span > 0 else 0.0,
    }


def recent_bursts(r: redis.Redis, keys: Keys, recent: int) -> list[str]:
    """The ``recent`` newest bursts of the index that still have a record. Index entries whose
    record is gone (expired, evicted) are dropped as they are met: among the newest looked at and
    the `PRUNE` oldest, so a call does bounded work however long the index has grown."""
    newest = [b.decode() for b in r.zrevrange(keys.bursts, 0, recent + PRUNE - 1)]
    oldest = [b.decode() for b in r.zrange(keys.bursts, 0, PRUNE - 1)]
    seen = list(dict.fromkeys(newest + oldest))
    pipe = r.pipeline(transaction=False)
    for b in seen:
        pipe.exists(keys.burst(b))
    alive = dict(zip(seen, pipe.execute() if seen else [], strict=True))
    gone = [b for b in seen if not alive[b]]
    if gone:
        with contextlib.suppress(ResponseError):  # a read-only user leaves it to the producers
            r.zrem(keys.bursts, *gone)
    return [b for b in newest if alive[b]][:recent]


def _burst_or_why(
    r: redis.Redis, settings: Settings, burst: str, asked: bool, problems: list[str]
) -> dict[str, Any]:
    """`burst_stats`; for a recent burst whose record is incomplete or went away meanwhile, what
    happened (``{"burst", "status": "lost", "error"}``) instead of failing the whole snapshot."""
    try:
        return burst_stats(r, settings, burst, problems)
    except BurstNotFound as e:  # BurstRecordLost too
        if asked:
            raise
        return {"burst": burst, "status": "lost", "error": str(e)}


def snapshot(
    settings: Settings,
    *,
    burst: str | None = None,
    recent: int = 5,
    client: redis.Redis | None = None,
) -> dict[str, Any]:
    """Everything `inspect` shows: shards, then the given burst or the most recent ones."""
    from prefixq.store.connection import sync_client

    r = client or sync_client(settings)
    shards = resolve_shards(r, settings)
    bursts = [burst] if burst else recent_bursts(r, settings.keys, recent)
    lane_bursts: dict[tuple[str, str], set[str]] = {}
    problems: list[str] = []
    per_shard = shard_stats(r, settings, shards, lane_bursts, problems)
    now = time.time()
    return {
        "namespace": settings.namespace,
        "shards": per_shard,
        "fleet": fleet(r, settings, shards, now, problems),
        "sharing": sharing(per_shard, lane_bursts),
        "bursts": [_burst_or_why(r, settings, b, b == burst, problems) for b in bursts],
        "problems": problems,
        "at": now,
    }
