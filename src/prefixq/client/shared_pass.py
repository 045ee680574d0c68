"""The shared pass: several bursts over one corpus walk it together, once.

A shard's engine holds the documents (prefix groups) it served last, as many as its KV cache
takes. A second burst over the same documents that starts at its own first document loads again
what the first burst's pass evicted long ago, and drives the first burst's documents out in turn.
As in a database's shared (circular) scan, a burst that arrives mid-pass instead starts where the
pass is and wraps around:

- **one order**: each prefix group gets a place in the corpus order the first time a burst submits
  it (the pass-order hash, lua/pass_order.lua), keyed by its pass key (the 64-bit content hash of
  the prefix, the same in every process: `prefixq.client.encoding.pass_key`), so every later
  burst walks the documents it shares with earlier ones in the order they did. A burst alone
  keeps its own order: its new groups are placed in it.
- **where the pass is**: each worker publishes the pass keys of the groups whose requests its
  engine finished most recently, as many as fill `pass_window` of its KV cache
  (worker/shared_pass.py): the completion front, where a joining burst's requests enter the
  engine's queue (worker/engine_order.py). A burst starts at the first of these in the corpus
  order, read circularly (after the largest gap between them, so that a pass that wrapped
  around is read as one run), and wraps around to the groups before it: it shares the documents
  the engine runs now and those queued after them, and costs the groups before its start once
  more at its end (docs/BENCHMARKS.md, 2026-12-04).

Only the groups' order changes (each group's requests stay together, in the order `ORDERS` gives
them); requests without a shared prefix, and the long answers ``decode-first`` puts first, keep
their places. ``grouped`` and ``decode-first`` (the default) bursts take part; the setting
``shared_pass`` turns it off. docs/architecture.md, "The shared pass", has the measurements.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from prefixq.client.encoding import pass_key
from prefixq.client.order import Peek
from prefixq.core import wire
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.store.connection import lua

__all__ = ["PASS_ORDERS", "Arrange", "arrangement", "join_point", "rotate"]

#: the enqueue orders whose groups follow the shared pass
PASS_ORDERS = ("grouped", "decode-first")
#: the corpus order is kept this long after its last use
ORDER_TTL_S = 7 * 24 * 3600
#: places kept in the corpus order; beyond it the order starts over
ORDER_MAX = 2_000_000
#: pass keys per call of the script
_CHUNK = 10_000

#: reorders a burst's groups (lists of request indices) for the pass
Arrange = Callable[[list[list[int]]], list[list[int]]]


async def arrangement(
    r: Any, s: Settings, keys: Keys, looks: Sequence[Peek], shards: int
) -> Arrange | None:
    """How the groups of a burst (``looks``: its `Peek`s) follow the shared pass: their places in
    the corpus order (placing its new groups), and where the shards' passes are. None when the
    burst has fewer than two shared groups (nothing to arrange)."""
    if not s.shared_pass:
        return None
    least = s.prefix_store_min_chars
    uses = Counter(p.group for p in looks if p.group is not None and p.size >= least)
    order: dict[int, None] = {}  # pass keys of groups used twice or more, first appearance first
    for g, n in uses.items():
        k = pass_key(g) if n > 1 else None
        if k is not None:
            order[k] = None
    if len(order) < 2:
        return None
    pkeys = list(order)
    script = r.register_script(lua("pass_order"))
    places: list[int] = []
    size = 0
    for i in range(0, len(pkeys), _CHUNK):  # only the first call may start the order over
        args = [ORDER_TTL_S, ORDER_MAX if i == 0 else 0, *pkeys[i : i + _CHUNK]]
        got = await script(keys=[keys.pass_order], args=args)
        places += [int(x) for x in got[:-1]]
        size = int(got[-1])
    place = dict(zip(pkeys, places, strict=True))
    window = await _marks(r, keys, shards)
    start = join_point([place[k] for k in pkeys if k in window], size)

    def arrange(members: list[list[int]]) -> list[list[int]]:
        def key_of(group: list[int]) -> int | None:
            g: Hashable | None = looks[group[0]].group
            k = pass_key(g) if g is not None else None
            return place.get(k) if k is not None else None

        return rotate(members, [key_of(m) for m in members], start, size)

    return arrange


def rotate(
    members: list[list[int]], places: list[int | None], start: int | None, size: int
) -> list[list[int]]:
    """``members`` (groups) with the placed ones (``places``; None: not placed, kept where it
    is) in the corpus order from ``start`` around (None: from the beginning)."""
    placed = [i for i, x in enumerate(places) if x is not None]
    at = 0 if start is None else start

    def turn(i: int) -> int:
        x = places[i]
        assert x is not None
        return (x - at) % size if size else x

    out = list(members)
    for slot, i in zip(placed, sorted(placed, key=turn), strict=True):
        out[slot] = members[i]
    return out


def join_point(places: list[int], size: int) -> int | None:
    """Where a burst starts: of ``places`` (the places, in a corpus order of ``size``, of the
    burst's groups that a pass holds now), the one after the largest circular gap; None when
    there are none."""
    if not places:
        return None
    xs = sorted(set(places))
    best, start = -1, xs[0]
    for i, x in enumerate(xs):
        nxt = xs[i + 1] if i + 1 < len(xs) else xs[0] + max(size, xs[-1] + 1)
        if nxt - x > best:
            best, start = nxt - x, xs[(i + 1) % len(xs)]
    return start


async def _marks(r: Any, keys: Keys, shards: int) -> set[int]:
    """The pass keys the shards' workers published (worker/shared_pass.py)."""
    pipe = r.pipeline(transaction=False)
    for k in range(shards):
        pipe.get(keys.pass_marks(k))
    out: set[int] = set()
    for raw in await pipe.execute(raise_on_error=False):
        if not raw or not isinstance(raw, bytes):  # a key of another type: no pass
            continue
        try:
            got = wire.unpack(raw)
        except Exception:  # a hint only: a value we cannot read is no pass
            continue
        if isinstance(got, list):
            out.update(x for x in got if isinstance(x, int) and not isinstance(x, bool))
    return out
