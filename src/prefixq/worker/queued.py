"""What waits in a shard's queue, in prefix groups (`scan`, `groups`): what a move can take.

A shard's queue is its intake streams (by priority) and its bursts' lanes. `scan` lists, stream
by stream in queue order, the entries never delivered to any consumer (past the group's
last-delivered id) and, when asked, those pending on a consumer that has no heartbeat (they were
in flight on a dead worker). `groups` gathers them into prefix groups: the entries whose shared
prefix ends at the same checkpoint (``a`` in the entry, core/entries.py), else with the same
stored prefix; a request without a shared prefix is a group of its own. The producer enqueues a
group's requests together, so a group's entries are next to each other in a stream, and its
first entry in queue order tells whether the group has started. A steal leaves started groups
where they are (``skip_started``): the groups of the entries a stream delivered last (those still
pending and `RECENT` before them) are left out, so a group whose first requests the victim read
keeps the rest there, where its prefix is cached.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import ResponseError

from prefixq.core import wire
from prefixq.core.entries import Entry
from prefixq.core.keys import FIELD, GROUP, Keys
from prefixq.store.dead_letters import identify
from prefixq.store.liveness import consumers_gone

__all__ = ["RECENT", "Found", "Group", "group_key", "groups", "scan"]

_PAGE = 1000
#: delivered entries, beyond those still pending, whose groups count as started (`scan`)
RECENT = 64


@dataclass(slots=True)
class Found:
    """One queued entry."""

    stream: str
    id: bytes
    entry: Entry | None
    #: the dead consumer it is pending on (None: never delivered)
    consumer: bytes | None = None


@dataclass(slots=True)
class Group:
    """The queued entries of one prefix group, in queue order."""

    key: tuple[Any, ...]
    items: list[Found] = field(default_factory=list)
    anchor: bytes | None = None
    #: estimated uncached prompt tokens where the entries were placed (`Entry.work`)
    work: int = 0
    #: prompt tokens predicted cached there (computed again on another shard)
    cached: int = 0

    def add(self, f: Found) -> None:
        """``f`` is the group's next entry."""
        self.items.append(f)
        if f.entry is not None:
            self.work += f.entry.work
            self.cached += f.entry.predicted_cached


async def scan(
    r: aredis.Redis,
    keys: Keys,
    limits: wire.Limits,
    shard: int,
    *,
    dead_pending: bool,
    skip_started: bool = False,
) -> list[Found]:
    """Every entry of ``shard``'s streams still to serve and free to move: never delivered, and
    with ``dead_pending`` also those pending on consumers without a heartbeat (first in each
    stream: they were read before the rest); with ``skip_started``, none of a group that has
    started (the module's docstring)."""
    lanes = [b.decode(errors="replace") for b in await r.hkeys(keys.lanes(shard))]
    out: list[Found] = []
    alive: dict[bytes, bool] = {}
    started: set[tuple[Any, ...]] = set()
    for key in keys.streams(shard, lanes):
        try:
            info = await r.xinfo_groups(key)
        except ResponseError:  # no such stream (a lane closed meanwhile)
            continue
        ours = [g for g in info if _name(g) == GROUP]
        last = ours[0]["last-delivered-id"] if ours else b"0-0"
        if ours and dead_pending:  # no group: no worker ever read it, nothing is pending
            out += await _dead_pending(r, keys, limits, shard, key, alive)
        if ours and skip_started and last not in (b"0-0", "0-0"):
            recent = int(ours[0].get("pending") or 0) + RECENT
            rows = await r.xrevrange(key, max=last, min="-", count=recent)
            started |= {group_key(Found(key, eid, _entry(f, limits))) for eid, f in rows}
        start = b"(" + (last if isinstance(last, bytes) else str(last).encode())
        while True:
            rows = await r.xrange(key, min=start, max="+", count=_PAGE)
            out += [Found(key, eid, _entry(f, limits)) for eid, f in rows]
            if len(rows) < _PAGE:
                break
            start = b"(" + rows[-1][0]
    return [f for f in out if group_key(f) not in started] if started else out


async def _dead_pending(
    r: aredis.Redis,
    keys: Keys,
    limits: wire.Limits,
    shard: int,
    key: str,
    alive: dict[bytes, bool],
) -> list[Found]:
    out: list[Found] = []
    start: bytes | str = "-"
    while True:
        page = await r.xpending_range(key, GROUP, min=start, max="+", count=_PAGE)
        new = {p["consumer"] for p in page} - alive.keys()  # each page's new ones in one round
        gone = await consumers_gone(r, keys, shard, new)
        alive.update((c, c not in gone) for c in new)
        for p in page:
            consumer: bytes = p["consumer"]
            if alive[consumer]:
                continue
            eid = p["message_id"]
            rows = await r.xrange(key, eid, eid)
            out.append(Found(key, eid, _entry(rows[0][1], limits) if rows else None, consumer))
        if len(page) < _PAGE:
            return out
        start = "(" + page[-1]["message_id"].decode()


def _entry(fields: dict[bytes, bytes], limits: wire.Limits) -> Entry | None:
    return identify(fields.get(FIELD), limits)


def group_key(f: Found) -> tuple[Any, ...]:
    """The prefix group of ``f``: its checkpoint, else its stored prefix, else itself."""
    e = f.entry
    if e is not None and e.anchor is not None:
        return ("a", e.anchor)
    if e is not None and e.prefix_ref is not None:
        return ("r", e.prefix_ref)
    return ("e", f.stream, f.id)


def groups(found: list[Found]) -> list[Group]:
    """``found`` in prefix groups, each in queue order, the groups in the order they start."""
    out: dict[tuple[Any, ...], Group] = {}
    for f in found:
        e = f.entry
        gk = group_key(f)
        out.setdefault(gk, Group(gk, anchor=e.anchor if e else None)).add(f)
    return list(out.values())


def _name(group: dict[Any, Any]) -> str:
    name = group.get("name", b"")
    return name.decode() if isinstance(name, bytes) else str(name)
