"""Bursts as the dashboard lists them: summaries from their records alone, filtered; and a burst's
failed requests.

A summary (`summary`) reads no result: the record's counters, priority, tenant, token counters
and status (as `prefixq inspect` names it), plus the burst's recent rate from its events stream
(one entry per recorded result: the requests recorded in the last `RATE_WINDOW_S` seconds, at
most `RATE_EVENTS` of them) and the ETA it gives. `listing` reads the newest `SCAN` bursts of the
index (two pipelined round trips: the records, then the running bursts' recent events) and
filters them by status, tenant and text, so a call costs the same however many bursts the index
holds. `failures` looks through at most `FAILURE_SCAN` of a burst's results for failed ones.
"""

from __future__ import annotations

import time
from typing import Any

import redis

from prefixq.client import results as results_api
from prefixq.core import wire
from prefixq.core.errors import BurstRecordLost
from prefixq.core.settings import Settings
from prefixq.ops.stats import shown_status
from prefixq.ops.tolerant import tolerant

__all__ = ["FAILURE_SCAN", "SCAN", "failures", "listing", "summary"]

#: newest bursts of the index a listing looks at (then filters)
SCAN = 1000
#: the recent rate: results recorded in the last this many seconds ...
RATE_WINDOW_S = 60.0
#: ... at most this many of them
RATE_EVENTS = 1000
#: results of a burst `failures` decodes at most
FAILURE_SCAN = 20_000
#: statuses of a burst still under way
ACTIVE = ("queued", "running", "cancelling", "expiring")


def summary(st: results_api.BurstStatus, recent: list[Any], now: float) -> dict[str, Any]:
    """One burst's row: ``recent`` is its events stream's newest entries (``XREVRANGE``), newest
    first, as far back as `RATE_WINDOW_S`."""
    m = st.meta
    status = shown_status(st)
    settled = st.done + st.failed
    prompt, cached = int(m.get("prompt_tokens", 0)), int(m.get("cached_tokens", 0))
    predicted = int(m.get("predicted_cached_tokens", 0))
    rate = 0.0
    if status in ACTIVE and recent:
        oldest = _event_time(recent[-1][0])
        window = RATE_WINDOW_S if len(recent) < RATE_EVENTS else now - oldest
        window = min(window, max(now - st.created, 1e-3))
        rate = len(recent) / max(window, 1e-3)
    elif status not in ACTIVE and st.finished_at > st.created:
        rate = settled / (st.finished_at - st.created)
    left = max(0, st.total - settled)
    return {
        "burst": st.burst,
        "status": status,
        "total": st.total,
        "done": st.done,
        "failed": st.failed,
        "cancelled": int(m.get("cancelled", 0)),
        "expired": int(m.get("expired", 0)),
        "progress": round(settled / st.total, 4) if st.total else 0.0,
        "created": st.created,
        "finished_at": st.finished_at,
        "priority": m.get("priority", "normal"),
        "tenant": m.get("tenant", "default"),
        "requests_per_s": round(rate, 3),
        "eta_s": round(left / rate, 1) if status in ACTIVE and rate > 0 and left else None,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "predicted_cached_tokens": predicted,
        "cached_ratio": round(cached / prompt, 4) if prompt else 0.0,
        "predicted_ratio": round(predicted / prompt, 4) if prompt else 0.0,
        "per_shard": [int(x) for x in m.get("per_shard", "").split(",") if x.isdigit()],
    }


def _event_time(entry_id: bytes | str) -> float:
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(raw.split("-")[0]) / 1000


def _matches(row: dict[str, Any], status: str, tenant: str, text: str) -> bool:
    if status == "active" and row["status"] not in ACTIVE:
        return False
    if status and status != "active" and row["status"] != status:
        return False
    if tenant and row.get("tenant") != tenant:
        return False
    return not text or text in row["burst"].lower() or text in str(row.get("tenant")).lower()


def listing(
    r: redis.Redis,
    settings: Settings,
    *,
    limit: int = 50,
    status: str = "",
    tenant: str = "",
    text: str = "",
    now: float | None = None,
) -> dict[str, Any]:
    """The newest bursts that match (``status``: one status, or ``active``; ``tenant`` exactly;
    ``text`` in the id or tenant), newest first, at most ``limit``; with the counts per status
    and the tenants among the `SCAN` newest, which the filters offer."""
    keys = settings.keys
    now = time.time() if now is None else now
    pipe = r.pipeline(transaction=False)
    pipe.zcard(keys.bursts)
    pipe.zrevrange(keys.bursts, 0, SCAN - 1)
    size, ids = pipe.execute()
    names = [b.decode(errors="replace") for b in ids]
    pipe = r.pipeline(transaction=False)
    for b in names:
        pipe.hgetall(keys.burst(b))
    records = pipe.execute() if names else []
    rows: list[tuple[results_api.BurstStatus | None, dict[str, Any]]] = []
    for b, h in zip(names, records, strict=True):
        if not h:  # expired: `prefixq inspect` drops it from the index
            continue
        try:
            st = results_api.BurstStatus.from_hash(b, h)
        except BurstRecordLost as e:
            rows.append((None, {"burst": b, "status": "lost", "error": str(e)}))
            continue
        rows.append((st, {}))
    pipe = r.pipeline(transaction=False)
    running = [x for x, _ in rows if x is not None and shown_status(x) in ACTIVE]
    since = int((now - RATE_WINDOW_S) * 1000)
    for x in running:
        pipe.xrevrange(keys.events(x.burst), "+", since, count=RATE_EVENTS)
    recent = dict(zip([x.burst for x in running], pipe.execute() if running else [], strict=True))
    out: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    tenants: set[str] = set()
    text = text.strip().lower()
    for found, row in rows:
        if found is not None:
            row = summary(found, recent.get(found.burst, []), now)
        counts[row["status"]] = counts.get(row["status"], 0) + 1
        if "tenant" in row:
            tenants.add(row["tenant"])
        if len(out) < limit and _matches(row, status, tenant, text):
            out.append(row)
    return {
        "bursts": out,
        "counts": counts,
        "tenants": sorted(tenants),
        "scanned": len(names),
        "indexed": size,
        "at": now,
    }


def failures(r: redis.Redis, settings: Settings, burst: str, *, limit: int = 100) -> dict[str, Any]:
    """Up to ``limit`` failed requests of a burst (index, id, error, code, shard, worker,
    finished), lowest index first among those found in at most `FAILURE_SCAN` results;
    ``complete`` when every result was looked at."""
    key = settings.keys.results(burst)
    limits = wire.Limits.from_settings(settings)
    found: list[dict[str, Any]] = []
    scanned, cursor = 0, 0
    problems: list[str] = []
    none: tuple[int, dict[bytes, bytes]] = (0, {})
    while True:
        cursor, chunk = tolerant(
            problems, f"burst {burst}'s results", none, r.hscan, key, cursor, None, 1000
        )
        for field, raw in chunk.items():
            scanned += 1
            index = int(field) if field.isdigit() else -1
            res = results_api.read_stored(raw, index, "", limits)
            if res.error is not None:
                found.append(
                    {
                        "index": index,
                        "id": res.id,
                        "error": res.error[:2000],
                        "error_code": res.error_code,
                        "shard": res.shard,
                        "worker": res.worker,
                        "finished": res.timings.finished,
                    }
                )
        if cursor == 0 or scanned >= FAILURE_SCAN:
            break
    found.sort(key=lambda x: x["index"])
    return {
        "burst": burst,
        "failed": found[:limit],
        "found": len(found),
        "scanned": scanned,
        "complete": cursor == 0 and not problems,
        "problems": problems,
    }
