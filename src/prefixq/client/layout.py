"""Where a burst's entries go: the shards' intake streams and the burst's lanes
(prefixq.core.sharing); `Layout.add` per chunk, `Layout.seal` once the burst is sent.

The head goes to each shard's intake of the burst's priority, which idle workers block on. Each
later chunk's entries for a shard go to the burst's lane there (made, with its group and lane
index entry, by the first chunk that needs it), except the chunk's last one, which goes to the
intake as the lane's doorbell (`LANE`), added after every lane entry it announces. Each lane entry
carries its place in the lane (`SEQ`), and each intake entry after the lane's first the count of
lane entries before it (`AFTER`): a worker admits in enqueue order whichever of the two streams it
reads first (worker/scheduler.py, "gated"). docs/architecture.md, "Sharing a shard" ("Layout",
"Costs"), has the design and what it costs.
"""

from __future__ import annotations

from typing import Any

from prefixq.core.keys import AFTER, FIELD, GROUP, LANE, SEQ, Keys
from prefixq.core.sharing import LaneInfo


class Layout:
    """The streams of one burst: ``add`` a chunk's entries to a pipeline, ``seal`` at the end."""

    def __init__(self, keys: Keys, burst: str, priority: str, tenant: str) -> None:
        self.keys, self.burst = keys, burst
        self.info = LaneInfo(priority, tenant)
        #: shards where this burst has a lane, and the entries sent to each lane so far
        self.sent: dict[int, int] = {}

    @property
    def lanes(self) -> set[int]:
        """Shards where this burst has a lane."""
        return set(self.sent)

    def mark(self) -> dict[int, int]:
        """What the layout has sent, for `rewind` (a pipeline sent again sends the same)."""
        return dict(self.sent)

    def rewind(self, mark: dict[int, int]) -> None:
        self.sent = dict(mark)

    def add(self, pipe: Any, by_shard: dict[int, list[tuple[bytes, int]]], *, first: bool) -> None:
        """The entries of one chunk (shard -> [(entry, estimated work)]) and the shards' load
        counters; ``first``: the burst's head."""
        keys, burst = self.keys, self.burst
        doorbells: list[tuple[str, dict[bytes, bytes]]] = []
        for shard, rows in sorted(by_shard.items()):
            intake = keys.intake(shard, self.info.priority)
            if first:
                for data, _ in rows:
                    pipe.xadd(intake, {FIELD: data})
            elif len(rows) == 1:  # after the lane's entries so far, if it has a lane
                fields = {FIELD: rows[0][0]}
                if shard in self.sent:
                    fields[AFTER] = b"%d" % self.sent[shard]
                pipe.xadd(intake, fields)
            else:
                lane = keys.lane(shard, burst)
                seq = self.sent.get(shard)
                if seq is None:
                    seq = 0
                    pipe.xgroup_create(lane, GROUP, id="0", mkstream=True)
                    pipe.hset(keys.lanes(shard), burst, self.info.encode())
                for data, _ in rows[:-1]:
                    seq += 1
                    pipe.xadd(lane, {FIELD: data, SEQ: b"%d" % seq})
                self.sent[shard] = seq
                # the chunk's last entry rings; whenever it is read, it is admitted after them
                doorbells.append((intake, {FIELD: rows[-1][0], LANE: b"1", AFTER: b"%d" % seq}))
            pipe.hincrby(keys.load, str(shard), sum(w for _, w in rows))
        for intake, fields in doorbells:  # after every lane entry they announce
            pipe.xadd(intake, fields)

    def seal(self, pipe: Any) -> None:
        """Mark the burst's lanes sealed: nothing more comes, a worker may close them once empty."""
        sealed = LaneInfo(self.info.priority, self.info.tenant, sealed=True).encode()
        for shard in sorted(self.sent):
            pipe.hset(self.keys.lanes(shard), self.burst, sealed)
