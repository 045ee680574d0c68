"""Where a burst's entries go: the shards' intake streams and the burst's lanes
(prefixq.core.sharing); `Layout.add` per chunk, `Layout.seal` once the burst is sent.

The head goes to each shard's intake of the burst's priority, which idle workers block on. Each
later chunk's entries for a shard go to the burst's lane there (made, with its group and lane
index entry, by the first chunk that needs it), except the chunk's last one, which goes to the
intake as the lane's doorbell (`LANE`), added after every lane entry it announces. Every entry
carries its place (`POS`: the lane and intake entries sent to its shard before it), so that a
worker admits in enqueue order whichever of the two streams it reads first (worker/scheduler.py,
"gated"). A chunk's entries for a shard go in one call of lua/enqueue.lua, which adds each at most
once: the pipeline sent again after a failover adds none twice (docs/delivery.md). docs/
architecture.md, "Sharing a shard" ("Layout", "Costs"), has the design and what it costs.
"""

from __future__ import annotations

import time
from typing import Any

from prefixq.core.keys import FIELD, GROUP, LANE, POS, Keys
from prefixq.core.sharing import LaneInfo
from prefixq.store.connection import lua
from prefixq.store.liveness import add_load

#: seconds a shard's guard of one submission lives after its last chunk (Keys.enqueued): a resend
#: comes within the producer's ride-through (enqueue.RIDE_THROUGH_S); a chunk refreshes the guards
#: of the shards it sends nothing to every `_REFRESH_S`, so that every guard lasts until the
#: submit's fence reads it back (store/fence.py) and the next chunk's check (lua/enqueue.lua)
GUARD_TTL_S = 600
_REFRESH_S = GUARD_TTL_S / 4


class Layout:
    """The streams of one burst: ``add`` a chunk's entries to a pipeline, ``seal`` at the end."""

    def __init__(self, keys: Keys, burst: str, priority: str, tenant: str) -> None:
        self.keys, self.burst = keys, burst
        self.info = LaneInfo(priority, tenant)
        self._script = lua("enqueue")
        #: per shard: the entries sent to its lane (only shards where the burst has one) and to
        #: its intake
        self.laned: dict[int, int] = {}
        self.intaken: dict[int, int] = {}
        #: per shard: when its guard's TTL was last set (`add`)
        self._touched: dict[int, float] = {}

    @property
    def lanes(self) -> set[int]:
        """Shards where this burst has a lane."""
        return set(self.laned)

    def counts(self, token: str) -> dict[str, int]:
        """Each shard's guard of submission ``token`` and the entries sent to that shard: what
        the submit's fence reads back."""
        return {
            self.keys.enqueued(k, self.burst, token): self.laned.get(k, 0) + n
            for k, n in self.intaken.items()
        }

    def mark(self) -> tuple[dict[int, int], dict[int, int]]:
        """What the layout has sent, for `rewind` (a pipeline sent again sends the same)."""
        return dict(self.laned), dict(self.intaken)

    def rewind(self, mark: tuple[dict[int, int], dict[int, int]]) -> None:
        self.laned, self.intaken = dict(mark[0]), dict(mark[1])

    def add(
        self, pipe: Any, by_shard: dict[int, list[tuple[bytes, int]]], *, first: bool, token: str
    ) -> None:
        """The entries of one chunk (shard -> [(entry, estimated work)]) and the shards' load
        counters: per shard, in shard order, one lua/enqueue.lua call (its reply: the entries
        skipped as sent before by submission ``token``, or minus those missing) and one load
        increment (lua/add_load.lua); then the guards of the other shards that are due,
        refreshed (EXPIRE); ``first``: the burst's head."""
        keys, burst, info = self.keys, self.burst, self.info
        for shard, rows in sorted(by_shard.items()):
            laned, intaken = self.laned.get(shard), self.intaken.get(shard, 0)
            start, to_lane, make = (laned or 0) + intaken, 0, ""
            args: list[Any] = []
            if first or len(rows) == 1:
                for data, _ in rows:
                    args += (data, b"%d:%d" % (laned or 0, intaken))
                    intaken += 1
            else:
                if laned is None:
                    laned, make = 0, info.encode()
                for data, _ in rows[:-1]:
                    args += (data, b"%d:%d" % (laned, intaken))
                    laned += 1
                self.laned[shard], to_lane = laned, len(rows) - 1
                # the chunk's last entry rings; whenever it is read, it is admitted after them
                args += (rows[-1][0], b"%d:%d" % (laned, intaken))
                intaken += 1
            self.intaken[shard] = intaken
            call: list[Any] = [
                keys.enqueued(shard, burst, token),
                keys.intake(shard, info.priority),
            ]
            call += [keys.lane(shard, burst), keys.lanes(shard), GUARD_TTL_S, start, to_lane]
            call += [make, burst, GROUP, FIELD, POS, LANE]
            pipe.execute_command("EVAL", self._script, 4, *call, *args)
            add_load(pipe, keys, shard, sum(w for _, w in rows))
            self._touched[shard] = time.monotonic()
        stale = time.monotonic() - _REFRESH_S
        for shard, at in self._touched.items():
            if at < stale:
                pipe.expire(keys.enqueued(shard, burst, token), GUARD_TTL_S)
                self._touched[shard] = time.monotonic()

    def seal(self, pipe: Any) -> None:
        """Mark the burst's lanes sealed: nothing more comes, a worker may close them once empty."""
        sealed = LaneInfo(self.info.priority, self.info.tenant, sealed=True).encode()
        for shard in sorted(self.laned):
            pipe.hset(self.keys.lanes(shard), self.burst, sealed)
