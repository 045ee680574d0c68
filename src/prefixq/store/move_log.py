"""The record of work moved between shards: one entry per prefix group in the moves stream
(`Keys.moves`, its newest 10,000 kept) and running totals per ``why`` (`Keys.move_totals`), so
that `inspect`, the dashboard and the metrics read the totals without reading the stream.

``why``: ``orphaned`` (a dead shard's queue), ``steal`` (a backlogged shard's tail), ``drain``
(a stopping worker's own queue), ``operator`` (``prefixq handover``), or absent for the
placement's load guard (a new prefix group placed away from its mapped shard): ``guard``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import redis

from prefixq.core.keys import Keys

__all__ = ["GUARD", "MOVES_KEPT", "add_moves", "parse_totals", "read_moves"]

#: entries the moves stream keeps (approximately: MAXLEN ~)
MOVES_KEPT = 10_000
#: the ``why`` of a move without one: the placement's load guard
GUARD = "guard"
_COUNTS = ("groups", "requests", "tokens")


def add_moves(pipe: Any, keys: Keys, records: Iterable[Mapping[str, Any]]) -> None:
    """Queue on ``pipe`` (a sync or asyncio pipeline, ``transaction=False``: the two keys are
    in different slots on a cluster) each record's stream entry and its share of the totals."""
    totals: dict[str, int] = {}
    for rec in records:
        pipe.xadd(keys.moves, dict(rec), maxlen=MOVES_KEPT, approximate=True)
        why = str(rec.get("why") or GUARD)
        counts = (1, rec.get("requests", 0), rec.get("tokens", 0))
        for name, n in zip(_COUNTS, counts, strict=True):
            totals[f"{why}:{name}"] = totals.get(f"{why}:{name}", 0) + int(n)
    for field, n in totals.items():
        pipe.hincrby(keys.move_totals, field, n)


def _int(v: bytes | None) -> int:
    try:
        return int(v) if v is not None else 0
    except ValueError:
        return 0


def parse_totals(raw: Mapping[bytes, bytes]) -> dict[str, dict[str, int]]:
    """``{why: {groups, requests, tokens}}`` from the `Keys.move_totals` hash."""
    totals: dict[str, dict[str, int]] = {}
    for field, v in raw.items():
        why, _, name = field.decode(errors="replace").rpartition(":")
        if why and name in _COUNTS:
            totals.setdefault(why, dict.fromkeys(_COUNTS, 0))[name] = _int(v)
    return totals


def read_moves(
    r: redis.Redis, keys: Keys, recent: int
) -> tuple[dict[str, dict[str, int]], list[dict[str, str]]]:
    """``({why: {groups, requests, tokens}}, the ``recent`` newest entries, newest first)``."""
    pipe = r.pipeline(transaction=False)
    pipe.hgetall(keys.move_totals)
    pipe.xrevrange(keys.moves, count=recent)
    raw, newest = pipe.execute()
    return parse_totals(raw), [
        {k.decode(errors="replace"): v.decode(errors="replace") for k, v in f.items()}
        for _, f in newest
    ]
