"""How many of a burst's requests Redis really holds: what a failed submit reports.

A request of a burst is in Redis once it has a result, or an entry in one of its shard's streams
(its lane on that shard, the intake of its priority, or the dead-letter stream). The union is
exact at any moment (the streams are read before the results, the way requests go): a worker
deletes an entry only after its result is recorded, a move between streams (reclaim, give-back,
requeue) is one script, and dead-lettering records the failed result before it acks. Counting
from Redis, rather than from the producer's replies, also counts a chunk Redis processed in part
before the connection dropped, whose reply never came.
"""

from __future__ import annotations

import contextlib
from typing import Any

import redis.asyncio as aredis

from prefixq.core import wire
from prefixq.core.entries import Entry
from prefixq.core.errors import WireError
from prefixq.core.keys import FIELD, Keys
from prefixq.core.settings import Settings

__all__ = ["count_enqueued"]

#: entries per XRANGE page
_PAGE = 1000


async def count_enqueued(
    r: aredis.Redis,
    settings: Settings,
    burst: str,
    *,
    shards: int,
    priority: str,
    created: float | None = None,
) -> int:
    """The number of distinct input indexes of ``burst`` that have a result or an entry in a
    stream of any of its ``shards`` (its lanes, the intakes of ``priority``, the dead letters).
    ``created``: the burst record's, which its entries carry as their enqueue time (entries left
    by an earlier burst of the same id are not counted)."""
    keys = Keys(settings.namespace)
    of = _Of(burst, created, wire.Limits.from_settings(settings))
    seen: set[int] = set()
    for k in range(shards):
        for key in (keys.lane(k, burst), keys.intake(k, priority)):
            async for f in _rows(r, key):
                of.add(seen, f)
        async for f in _rows(r, keys.dead(k)):
            if f.get(b"burst") == burst.encode() and f.get(b"index", b"").isdigit():
                seen.add(int(f[b"index"]))
    # the results last: a request goes from a stream to a result, never back, so one whose
    # result was recorded and entry deleted while the streams were read is counted here (read
    # first, it was counted nowhere: "0 of 10 enqueued" while 4 had run)
    seen.update(int(i) for i in await r.hkeys(keys.results(burst)))
    return len(seen)


async def _rows(r: aredis.Redis, key: str) -> Any:
    """Every entry's fields of stream ``key`` (none if it does not exist), a page at a time."""
    start = "-"
    while True:
        page = await r.xrange(key, start, "+", count=_PAGE)
        for _, fields in page:
            yield fields
        if len(page) < _PAGE:
            return
        start = "(" + page[-1][0].decode()


class _Of:
    """Which entries are the burst's."""

    def __init__(self, burst: str, created: float | None, limits: wire.Limits) -> None:
        self.burst, self.created, self.limits = burst, created, limits

    def add(self, seen: set[int], fields: dict[bytes, bytes]) -> None:
        """The index of an entry of the burst (other bursts' entries and garbage are skipped)."""
        data = fields.get(FIELD)
        if data is None:
            return
        with contextlib.suppress(WireError, KeyError, TypeError, ValueError):
            e = Entry.from_wire(wire.decode(data, self.limits))
            if e.burst != self.burst:
                return
            if self.created is not None and e.enqueued and abs(e.enqueued - self.created) > 1e-3:
                return
            seen.add(e.index)
