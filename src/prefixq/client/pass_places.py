"""The places of the shared pass (client/shared_pass.py), as pure functions: the content order
of a burst's long prefixes, where a burst starts (the join point) and its groups rotated to
start there."""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence

from prefixq.client.encoding import pass_key
from prefixq.client.order import Peek

__all__ = ["content_order", "join_point", "rotate", "rotate_each"]


def content_order(looks: Sequence[Peek], groups: Collection[Hashable]) -> list[int]:
    """The pass keys of ``groups`` (fingerprints of long prefixes, each once) in their content
    order: by the hash of the prefix's first block (`Peek.lead` of a request of the group:
    prefixes that share a leading block stay together, as a depth-first walk keeps them), then
    by the pass key. The same for every burst over the same documents, whatever their order."""
    lead = {p.group: p.lead for p in looks if p.group is not None and p.group in groups}
    ranked = []
    for g in groups:
        k = pass_key(g)
        if k is not None:
            ranked.append((lead.get(g, 0), k))
    return [k for _, k in sorted(ranked)]


def rotate(
    members: list[list[int]], places: list[int | None], start: int | None, size: int
) -> list[list[int]]:
    """``members`` (groups) with the placed ones (``places``; None: not placed, kept where it
    is) in the corpus order from ``start`` around (None: from the beginning)."""
    return rotate_each(members, places, [start] * len(members), size)


def rotate_each(
    members: list[list[int]], places: list[int | None], starts: list[int | None], size: int
) -> list[list[int]]:
    """``members`` (groups) with the placed ones (``places``; None: not placed, kept where it
    is) in the order of their distance, in the corpus order read circularly, from their own
    ``starts`` (a group's shard's pass; None: the order's beginning): each shard's groups from
    where its pass is around, the shards' turns interleaved."""
    placed = [i for i, x in enumerate(places) if x is not None]

    def turn(i: int) -> int:
        x, at = places[i], starts[i] or 0
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
