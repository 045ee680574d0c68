"""`LaneScripts`: the two Lua scripts a worker runs on its shard's lanes, each call pipelined.

`close` deletes drained lanes with their lane index entries (lua/close_lane.lua: only a lane that
holds no entry at all and is sealed, or whose burst ended and nothing was added for
`ENDED_IDLE_MS`); `release` gives back entries read and never started, re-added to the tail of
their intake with the deliveries they had before (lua/reclaim_entry.lua). Both are called by
EVALSHA in a pipeline (`PipelinedScript`, store/pipelined_script.py: a Redis Cluster pipeline
loads nothing), sent again, quietly, after a NOSCRIPT (a promoted replica starts with an empty
script cache). `ShardStream` (shard.py) sends its lane commands through this object.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import redis.asyncio as aredis

from prefixq.core.keys import CARRIED, GROUP
from prefixq.store.connection import lua
from prefixq.store.pipelined_script import PipelinedScript
from prefixq.worker.deliveries import Delivery

__all__ = ["ENDED_IDLE_MS", "LaneScripts"]

#: a lane of an ended burst (cancelled, expired) that nobody sealed is closed once nothing has been
#: added to it for this long (its producer may still be streaming entries that are then skipped)
ENDED_IDLE_MS = 60_000


class LaneScripts:
    """The lane scripts of the shard whose lane index is ``index``, for consumer ``consumer``."""

    def __init__(self, r: aredis.Redis, *, index: str, consumer: str) -> None:
        self.index = index
        self.consumer = consumer
        self._close = PipelinedScript(r, lua("close_lane"), "close_lane")
        self._move = PipelinedScript(r, lua("reclaim_entry"), "reclaim_entry")

    async def close(self, lanes: Sequence[tuple[str, str, bool]]) -> list[int]:
        """`ShardStream.close_lanes`: per lane ``(key, burst, ended)``, 1 closed, 0 left, -1 it
        holds undelivered entries."""
        if not lanes:
            return []
        now_ms = int(time.time() * 1000)
        replies = await self._close.run(
            [
                (
                    [key, self.index],
                    [burst, "ended" if ended else "sealed", ENDED_IDLE_MS, GROUP, now_ms],
                )
                for key, burst, ended in lanes
            ]
        )
        return [x if isinstance(x, int) else 0 for x in replies]

    async def release(self, items: Sequence[tuple[Delivery, str]]) -> None:
        """`ShardStream.release`: each ``(delivery, intake)`` re-added to its intake, acked here."""
        if not items:
            return
        await self._move.run(
            [
                (
                    [d.key, intake],
                    [GROUP, d.entry_id, self.consumer, 0, "requeue", CARRIED, d.deliveries - 1, ""],
                )
                for d, intake in items
            ]
        )
