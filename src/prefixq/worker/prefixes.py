"""A worker's bounded cache of stored prefixes (content-addressed, so entries never go stale).

Entries that reference a prefix (``xr``) are resolved from a local LRU first and with one MGET
for the rest of a read batch. A missing or undecodable prefix resolves to the reason (a string),
which fails only the requests that need it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import redis.asyncio as aredis

from prefixq.core import wire
from prefixq.core.entries import Entry
from prefixq.core.errors import PrefixqError
from prefixq.core.keys import Keys
from prefixq.store.connection import is_cluster

#: a resolved prefix object, or why it could not be resolved
Resolved = dict[str, Any] | str


class PrefixCache:
    """LRU of decoded prefix objects, at most ``entries`` of them."""

    def __init__(self, r: aredis.Redis, keys: Keys, limits: wire.Limits, entries: int) -> None:
        self.r, self.keys, self.limits, self.entries = r, keys, limits, entries
        self._lru: OrderedDict[str, dict[str, Any]] = OrderedDict()
        #: each cached prefix's token ids (`_token_ids`, counted once, as it is decoded), and
        #: their sum (`held_ids`)
        self._counts: dict[str, int] = {}
        self._ids = 0

    def __len__(self) -> int:
        return len(self._lru)

    def held_ids(self) -> int:
        """Token ids the cached prefixes hold: about as many memory blocks of int objects, live
        and never part of a reference cycle (worker/gc_policy.py discounts them from the heap's
        growth: a corpus filling this cache is not garbage to collect)."""
        return self._ids

    async def resolve(self, batch: list[Entry]) -> dict[str, Resolved]:
        """digest -> prefix object (or the reason it is unavailable) for every reference."""
        found: dict[str, Resolved] = {}
        missing = []
        for e in batch:
            ref = e.prefix_ref
            if ref is None or ref in found:
                continue
            if ref in self._lru:
                self._lru.move_to_end(ref)
                found[ref] = self._lru[ref]
            else:
                missing.append(ref)
                found[ref] = "missing"
        if missing:
            names = [self.keys.prefix(ref) for ref in missing]
            # prefix keys carry no hash tag: on a cluster they spread over the slots, and
            # mget_nonatomic asks each slot's master for its own (in the order given)
            cluster = is_cluster(self.r)
            values = await (self.r.mget_nonatomic(names) if cluster else self.r.mget(names))
            for ref, raw in zip(missing, values, strict=True):
                found[ref] = self._decode(ref, raw)
        return found

    def _decode(self, ref: str, raw: bytes | None) -> Resolved:
        if raw is None:
            return f"stored prefix {ref} not found (expired or never stored)"
        try:
            obj = wire.decode(raw, self.limits)
        except PrefixqError as err:
            return f"stored prefix {ref} undecodable: {err}"
        if not isinstance(obj, dict):
            return f"stored prefix {ref} is not a map"
        self._drop(ref)  # decoded meanwhile by a resolve beside this one
        self._lru[ref] = obj
        self._counts[ref] = n = _token_ids(obj)
        self._ids += n
        while len(self._lru) > self.entries:
            self._drop(next(iter(self._lru)))
        return obj

    def _drop(self, ref: str) -> None:
        if self._lru.pop(ref, None) is not None:
            self._ids -= self._counts.pop(ref)


def _token_ids(obj: dict[str, Any]) -> int:
    """How many objects of their own ``obj``'s lists of ints hold (a prefix's token ids): ids
    from -5 to 256, None and the booleans are CPython's shared objects and hold no memory block
    of their own (one pass over each list at C speed, on each prefix the worker decodes)."""
    n = 0
    for v in obj.values():
        if isinstance(v, list) and v and type(v[0]) is int:
            n += len(v) - sum(map(_SHARED.__contains__, v))
    return n


#: values CPython keeps one object of (True and False hash as 1 and 0: found too)
_SHARED = frozenset([*range(-5, 257), None])
