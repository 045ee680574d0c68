"""The shared pass: several bursts over one corpus walk it together, once.

A shard's engine holds the documents (prefix groups) it served last, as many as its KV cache
takes. A second burst over the same documents that starts at its own first document loads again
what the first burst's pass evicted long ago, and drives the first burst's documents out in turn.
As in a database's shared (circular) scan, a burst that arrives mid-pass instead starts where the
pass is and wraps around:

- **one order**: each prefix group gets a place in the corpus order the first time a burst submits
  it (the pass-order hash, lua/pass_order.lua), keyed by its pass key (the 64-bit content hash of
  the prefix, the same in every process: `prefixq.client.encoding.pass_key`), so every later
  burst walks the documents it shares with earlier ones in the order they did. A burst's new
  groups are placed in their content order (`content_order`), which bursts of prefixes used
  once walk too (below).
- **where the pass is**: each worker publishes the pass keys of the groups whose requests its
  engine finished most recently, as many as fill `pass_window` of its KV cache
  (worker/shared_pass.py): the completion front, where a joining burst's requests enter the
  engine's queue (worker/engine_order.py). A burst starts at the first of these in the corpus
  order, read circularly (after the largest gap between them, so that a pass that wrapped
  around is read as one run), and wraps around to the groups before it: it shares the documents
  the engine runs now and those queued after them, and costs the groups before its start once
  more at its end (docs/BENCHMARKS.md, 2026-12-04).

- **prefixes used once**: a burst that asks one question per document (fewer than two shared
  groups) keeps no place in the corpus order (one per request of every such burst would grow
  Redis for bursts that share nothing): its documents follow their content order instead
  (`content_order`: by their first block's hash, then their pass key), which every burst over
  the same documents shares with no state, and it starts where the workers' windows are
  in that order (they hold lone requests' prefixes too).

- **both at once**: a burst with shared groups and long prefixes used once beside them (an
  analysis that asks a few documents twice and most once) walks all of them in the content
  order, as the first burst over a corpus walks it (its new groups are placed in that order),
  so such analyses follow each other's passes, not only in their groups. Its groups are placed
  in the corpus order and their shards kept, as any burst's; its lone prefixes are not.

Only the groups' order changes (each group's requests stay together, in the order `ORDERS` gives
them); requests without a long prefix, and the long answers ``decode-first`` puts first, keep
their places. ``grouped``
and ``decode-first`` (the default) bursts take part; the setting ``shared_pass`` turns it off.
docs/architecture.md, "The shared pass", has the measurements.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Hashable, Mapping, Sequence
from typing import Any

from redis.exceptions import ResponseError

from prefixq.affinity.placement import Placed
from prefixq.client.encoding import pass_key
from prefixq.client.order import Peek
from prefixq.client.pass_places import content_order, join_point, rotate_each
from prefixq.core import wire
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.store.lua_script import LuaScript
from prefixq.store.redis_errors import TRANSIENT

__all__ = [
    "PASS_ORDERS",
    "Arrangement",
    "arrangement",
]

log = logging.getLogger(__name__)

#: the enqueue orders whose groups follow the shared pass
PASS_ORDERS = ("grouped", "decode-first")
#: the corpus order is kept this long after its last use
ORDER_TTL_S = 7 * 24 * 3600
#: places kept in the corpus order; beyond it the order starts over
ORDER_MAX = 2_000_000
#: pass keys per call of the script
_CHUNK = 10_000
#: workers' windows read at most, over all shards (a workers set grown by garbage stays cheap)
_MAX_WINDOWS = 1024
#: places pass keys in the corpus order (lua/pass_order.lua)
_PASS_ORDER = LuaScript("pass_order")


class Arrangement:
    """How one burst's groups follow the shared pass (`arrangement` builds it): called with the
    burst's groups it reorders them; `placed` and `remember` keep, for the next burst, the shard
    each group went to."""

    def __init__(
        self,
        looks: Sequence[Peek],
        place: dict[int, int],
        size: int,
        starts: dict[int, int],
        start: int | None,
        shard_of: dict[int, int],
        *,
        kept: Collection[int] = (),
    ) -> None:
        self.looks, self.place, self.size = looks, place, size
        self.starts, self.start, self.shard_of = starts, start, shard_of
        #: the pass keys of the groups whose shard is kept for the next burst (`placed`): not
        #: those of prefixes used once, nor any of a content arrangement (nothing grows Redis)
        self.kept = frozenset(kept)
        #: pass key -> the shard this burst placed the group on (`placed`)
        self.went: dict[int, int] = {}

    def _pkey(self, i: int) -> int | None:
        g: Hashable | None = self.looks[i].group
        k = pass_key(g) if g is not None else None
        return k if k is not None and k in self.place else None

    def __call__(self, members: list[list[int]]) -> list[list[int]]:
        places: list[int | None] = []
        starts: list[int | None] = []
        for m in members:
            k = self._pkey(m[0])
            places.append(None if k is None else self.place[k])
            shard = self.shard_of.get(k) if k is not None else None
            starts.append(self.starts.get(shard, self.start) if shard is not None else self.start)
        return rotate_each(members, places, starts, self.size)

    def placed(self, idx: Sequence[int], placed: Sequence[Placed]) -> None:
        """Requests ``idx`` were ``placed``: the first one of each group says where it is."""
        if not self.kept:
            return
        for i, p in zip(idx, placed, strict=True):
            k = self._pkey(i)
            if k is not None and k in self.kept and k not in self.went:
                self.went[k] = p.shard

    async def remember(self, r: Any, keys: Keys) -> None:
        """Keep where this burst's groups went (keys.pass_shards), for the bursts after it: a
        hint, so a failure is only logged."""
        if not self.went:  # (a content arrangement keeps none: `placed`)
            return
        items = list(self.went.items())
        try:
            for i in range(0, len(items), _CHUNK):
                mapping = dict(items[i : i + _CHUNK])
                pipe = r.pipeline(transaction=False)
                pipe.hset(keys.pass_shards, mapping=mapping)
                pipe.expire(keys.pass_shards, ORDER_TTL_S)
                got = await pipe.execute(raise_on_error=False)
                if isinstance(got[0], ResponseError):  # another type: the hint starts over
                    await r.delete(keys.pass_shards)
                    await r.hset(keys.pass_shards, mapping=mapping)
                    await r.expire(keys.pass_shards, ORDER_TTL_S)
        except (*TRANSIENT, ResponseError) as e:
            log.debug("shared pass: where the groups went not kept: %s", e)


async def arrangement(
    r: Any,
    s: Settings,
    keys: Keys,
    looks: Sequence[Peek],
    uses: Mapping[Hashable, int],
    shards: int,
) -> Arrangement | None:
    """How the groups of a burst (``looks``: its `Peek`s; ``uses``: each long prefix's uses,
    first appearance first, `EntryEncoder.uses`) follow the shared pass: their places in the
    corpus order (placing its new groups), where each shard's pass is, and the shard each group
    went to last. A burst with fewer than two shared groups (one question per document, say)
    follows the prefixes' content order instead: `_content_arrangement`; so does one with
    prefixes used once beside its groups, whose groups are placed all the same. None when there
    is nothing to arrange."""
    if not s.shared_pass:
        return None
    ranked = content_order(looks, uses)  # every long prefix's pass key, ranked once
    # pass keys of the groups used twice or more, in their content order: the order the new
    # ones are placed in, so that a burst of lone requests over the same documents (which walks
    # that order, `_content_arrangement`) finds them in its own
    shared = {pass_key(g) for g, n in uses.items() if n > 1}
    pkeys = [k for k in ranked if k in shared]
    if len(pkeys) < 2:
        return await _content_arrangement(r, keys, looks, ranked, shards)
    places: list[int] = []
    size = 0
    for i in range(0, len(pkeys), _CHUNK):  # only the first call may start the order over
        args = [ORDER_TTL_S, ORDER_MAX if i == 0 else 0, *pkeys[i : i + _CHUNK]]
        got = await _PASS_ORDER.acall(r, keys=[keys.pass_order], args=args)
        places += [int(x) for x in got[:-1]]
        size = int(got[-1])
    if len(ranked) > len(pkeys):  # prefixes used once beside the groups: the content order
        place, size = {k: i for i, k in enumerate(ranked)}, len(ranked)
    else:
        place = dict(zip(pkeys, places, strict=True))
    windows, shard_of = await _marks(r, keys, shards, pkeys)
    union = set().union(*windows) if windows else set()
    start = join_point([place[k] for k in place if k in union], size)
    starts: dict[int, int] = {}
    for shard, window in enumerate(windows):
        at = join_point([place[k] for k in place if k in window], size)
        if at is not None:
            starts[shard] = at
    return Arrangement(looks, place, size, starts, start, shard_of, kept=pkeys)


async def _content_arrangement(
    r: Any, keys: Keys, looks: Sequence[Peek], ranked: list[int], shards: int
) -> Arrangement | None:
    """A burst (``ranked``: its long prefixes' pass keys, `content_order`) whose long prefixes
    are (nearly) all used once, as when each of several analyses asks one question per
    document: the corpus order would hold a place per request of every such burst ever
    submitted (megabytes of Redis for bursts that share nothing), so its order
    is the prefixes' content order instead, the same for every burst over the same documents
    with no state at all: by the hash of each prefix's first block (`Peek.lead`: prefixes that
    share a leading block, a chat's turns, stay together, as depth-first keeps them), then by
    its pass key. It starts where the shards' passes are in that order (the workers' windows
    hold lone requests' prefixes too, `prefixq.core.entries.Entry.lone_key`), so a later
    analysis walks the documents beside the earlier one instead of behind it. None for fewer
    than two long prefixes."""
    if len(ranked) < 2:
        return None
    place = {k: i for i, k in enumerate(ranked)}
    windows, _ = await _marks(r, keys, shards, [])
    union = set().union(*windows) if windows else set()
    # one start for all shards: where a lone request goes is not known before it is placed
    start = join_point([place[k] for k in union if k in place], len(place))
    return Arrangement(looks, place, len(place), {}, start, {})


async def _marks(
    r: Any, keys: Keys, shards: int, pkeys: list[int]
) -> tuple[list[set[int]], dict[int, int]]:
    """Per shard, the pass keys its registered workers published (worker/shared_pass.py: one
    window per worker, several of them on a shard read together); and of ``pkeys``, the shard
    each went to last (keys.pass_shards): two round trips (the workers, then their windows)."""
    pipe = r.pipeline(transaction=False)
    for k in range(shards):
        pipe.zrange(keys.workers(k), 0, -1)
    for i in range(0, len(pkeys), _CHUNK):
        pipe.hmget(keys.pass_shards, pkeys[i : i + _CHUNK])
    got = await pipe.execute(raise_on_error=False)
    named = [
        (k, name)
        for k, names in enumerate(got[:shards])
        if isinstance(names, list)  # else a key of another type: no pass
        for name in names
        if isinstance(name, bytes)
    ][:_MAX_WINDOWS]
    windows: list[set[int]] = [set() for _ in range(shards)]
    if named:
        pipe = r.pipeline(transaction=False)
        for k, name in named:
            pipe.get(keys.pass_marks(k, name.decode(errors="replace")))
        for (k, _), raw in zip(named, await pipe.execute(raise_on_error=False), strict=True):
            windows[k].update(_window(raw))
    shard_of: dict[int, int] = {}
    held = [x for part in got[shards:] if isinstance(part, list) for x in part]
    if len(held) == len(pkeys):  # else a key of another type: no hints
        for k, v in zip(pkeys, held, strict=True):
            if isinstance(v, bytes) and v.isdigit() and int(v) < shards:
                shard_of[k] = int(v)
    return windows, shard_of


def _window(raw: object) -> list[int]:
    """One worker's published window (a msgpack array of pass keys); nothing for a value that
    is not one (a hint only: a key of another type, garbage)."""
    if not raw or not isinstance(raw, bytes):
        return []
    try:
        marks = wire.unpack(raw)
    except Exception:
        return []
    if not isinstance(marks, list):
        return []
    return [x for x in marks if isinstance(x, int) and not isinstance(x, bool)]
