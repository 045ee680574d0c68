"""Each prefix group's shared ancestor: the deepest checkpoint of its prefix that another group of
the same burst shares, as documents under one system prompt share it.

A worker's KV budget (worker/kv_budget.py) counts the distinct prefixes inside its engine. A group
is known to the worker by its whole prefix only, so documents under one system prompt each
counted that prompt again, and the budget let in fewer of them than the cache holds (simulated,
`system-prompt` 10% slower with 32,768 tokens kept; docs/BENCHMARKS.md, 2026-12-06). With the
ancestor on each entry (``sa``: its key and tokens) the worker counts it once while any group
under it is inside. Checkpoints come every ``checkpoint_every`` blocks, so the ancestor found is
the shared part rounded down to one (at most 128 tokens short by default): the budget still errs
on the safe side. A group placed before a second group under its ancestor came (the burst's first
chunk, or an earlier burst) carries none: counted whole, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixq.affinity.placement import Item

__all__ = ["Ancestry"]


class Ancestry:
    """The checkpoints seen above each group's own prefix over a placer's calls (a burst is
    placed in chunks: a group's ancestor is found once a second group under it comes), and
    which of them two groups or more share. One per 128 tokens of distinct prefix (~120 bytes
    each: a burst of 10,000 documents of 4,000 tokens, ~40 MB beside its ~160 MB of text);
    bounded: past `MAX` checkpoints it starts over (later groups then find fewer ancestors)."""

    MAX = 500_000

    def __init__(self) -> None:
        #: checkpoint -> the first group's anchor seen under it
        self.first: dict[bytes, bytes] = {}
        #: checkpoints under which two groups or more were seen
        self.shared: set[bytes] = set()

    def mark(
        self,
        items: Sequence[Item],
        cps: Sequence[Sequence[tuple[int, bytes]]],
        anchors: Sequence[bytes | None],
    ) -> list[tuple[int | None, int]]:
        """(ancestor key, its depth in blocks) for each item, ``(None, 0)`` where it has none;
        ``cps``: each item's checkpoints, (block index, hash) shallow to deep, and ``anchors``
        the one that ends its shared prefix (`AffinityPlacer.checkpoints`, `_anchor`)."""
        if len(self.first) > self.MAX:
            self.first.clear()
            self.shared.clear()
        first, shared = self.first, self.shared
        heads: list[list[tuple[int, bytes]]] = []
        for it, marks, anchor in zip(items, cps, anchors, strict=True):
            if anchor is None:
                heads.append([])
                continue
            end = min(it.prefix_blocks, len(it.blocks)) - 1
            head = [(i, cp) for i, cp in marks if i < end]  # strictly above its own prefix
            heads.append(head)
            for _, cp in head:
                if first.setdefault(cp, anchor) != anchor:
                    shared.add(cp)
        out: list[tuple[int | None, int]] = []
        for head in heads:
            i, cp = next(((i, cp) for i, cp in reversed(head) if cp in shared), (-1, b""))
            out.append((int.from_bytes(cp, "little"), i + 1) if i >= 0 else (None, 0))
        return out
