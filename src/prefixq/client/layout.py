"""Where a burst's entries go: the shards' intake streams and the burst's lanes
(prefixq.core.sharing); `Layout.add` per chunk, `Layout.seal` once the burst is sent.

The head goes to each shard's intake of the burst's priority, which idle workers block on. Each
later chunk's entries for a shard go to the burst's lane there (made, with its group and lane
index entry, by the first chunk that needs it), except the chunk's first one, which goes to the
intake as the lane's doorbell (`LANE`). The doorbells are added after every lane entry they
announce: a worker that reads a doorbell must find its entries in the lane; read first, the
doorbell is also first in the chunk's enqueue order. docs/architecture.md,
"Sharing a shard" ("Layout", "Costs"), has the design and what it costs.
"""

from __future__ import annotations

from typing import Any

from prefixq.core.keys import FIELD, GROUP, LANE, Keys
from prefixq.core.sharing import LaneInfo


class Layout:
    """The streams of one burst: ``add`` a chunk's entries to a pipeline, ``seal`` at the end."""

    def __init__(self, keys: Keys, burst: str, priority: str, tenant: str) -> None:
        self.keys, self.burst = keys, burst
        self.info = LaneInfo(priority, tenant)
        #: shards where this burst has a lane
        self.lanes: set[int] = set()

    def add(self, pipe: Any, by_shard: dict[int, list[tuple[bytes, int]]], *, first: bool) -> None:
        """The entries of one chunk (shard -> [(entry, estimated work)]) and the shards' load
        counters; ``first``: the burst's head."""
        keys, burst = self.keys, self.burst
        doorbells: list[tuple[str, dict[bytes, bytes]]] = []
        for shard, rows in sorted(by_shard.items()):
            intake = keys.intake(shard, self.info.priority)
            if first or len(rows) == 1:
                for data, _ in rows:
                    pipe.xadd(intake, {FIELD: data})
            else:
                lane = keys.lane(shard, burst)
                if shard not in self.lanes:
                    self.lanes.add(shard)
                    pipe.xgroup_create(lane, GROUP, id="0", mkstream=True)
                    pipe.hset(keys.lanes(shard), burst, self.info.encode())
                for data, _ in rows[1:]:
                    pipe.xadd(lane, {FIELD: data})
                # the chunk's first entry rings: read before (or with) the lane's, it keeps its
                # place (the last one rang before: admitted ahead of its chunk, it split its group)
                doorbells.append((intake, {FIELD: rows[0][0], LANE: b"1"}))
            pipe.hincrby(keys.load, str(shard), sum(w for _, w in rows))
        for intake, fields in doorbells:  # after every lane entry they announce
            pipe.xadd(intake, fields)

    def seal(self, pipe: Any) -> None:
        """Mark the burst's lanes sealed: nothing more comes, a worker may close them once empty."""
        sealed = LaneInfo(self.info.priority, self.info.tenant, sealed=True).encode()
        for shard in sorted(self.lanes):
            pipe.hset(self.keys.lanes(shard), self.burst, sealed)
