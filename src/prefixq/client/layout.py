"""Where a burst's entries go: the shards' intake streams and the burst's lanes
(prefixq.core.sharing).

The head (`Producer` sends it first) goes to each shard's intake stream of the burst's priority,
which idle workers block on: it reaches an engine within one round trip. Each later chunk's
entries for a shard go to the burst's lane there — a stream of its own, made with its consumer
group and its lane index entry by the first chunk that needs it — except the chunk's last one,
which goes to the intake, marked as the lane's doorbell (`LANE`) and added after the others: a
worker that reads the doorbell then reads the lane, and a worker idle on the intakes wakes. A
chunk with a single entry for a shard sends it to the intake alone. Once the burst is sent, its
lanes are sealed: a worker deletes a sealed lane once it is empty (lua/close_lane.lua).

Costs: per shard a burst reaches beyond its head, one stream (the lane) and one lane index
field, made by two commands in a pipeline the chunk sends anyway; one doorbell per chunk and
shard; and one seal per lane in the last round trip. A burst of at most `HEAD` requests makes no
lane at all.
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
                for data, _ in rows[:-1]:
                    pipe.xadd(lane, {FIELD: data})
                doorbells.append((intake, {FIELD: rows[-1][0], LANE: b"1"}))
            pipe.hincrby(keys.load, str(shard), sum(w for _, w in rows))
        for intake, fields in doorbells:  # after every lane entry they announce
            pipe.xadd(intake, fields)

    def seal(self, pipe: Any) -> None:
        """Mark the burst's lanes sealed: nothing more comes, a worker may close them once empty."""
        sealed = LaneInfo(self.info.priority, self.info.tenant, sealed=True).encode()
        for shard in sorted(self.lanes):
            pipe.hset(self.keys.lanes(shard), self.burst, sealed)
