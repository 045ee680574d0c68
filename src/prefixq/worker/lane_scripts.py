"""`LaneScripts`: the two Lua scripts a worker runs on its shard's lanes, each call pipelined.

`close` deletes drained lanes with their lane index entries (lua/close_lane.lua: only a lane that
holds no entry at all and is sealed, or whose burst ended and nothing was added for
`ENDED_IDLE_MS`); `release` gives back entries read and never started, re-added to the tail of
their intake with the deliveries they had before (lua/reclaim_entry.lua). A Redis Cluster
pipeline sends a script as a bare EVALSHA (it loads nothing), so on a cluster both are loaded on
every master first, and again after a NOSCRIPT (a promoted replica starts with an empty script
cache). `ShardStream` (shard.py) sends its lane commands through this object.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import NoScriptError

from prefixq.core.keys import CARRIED, GROUP
from prefixq.store.connection import is_cluster, lua
from prefixq.worker.deliveries import Delivery

__all__ = ["ENDED_IDLE_MS", "LaneScripts"]

#: a lane of an ended burst (cancelled, expired) that nobody sealed is closed once nothing has been
#: added to it for this long (its producer may still be streaming entries that are then skipped)
ENDED_IDLE_MS = 60_000


class LaneScripts:
    """The lane scripts of the shard whose lane index is ``index``, for consumer ``consumer``."""

    def __init__(self, r: aredis.Redis, *, index: str, consumer: str) -> None:
        self.r = r
        self.index = index
        self.consumer = consumer
        self._close = r.register_script(lua("close_lane"))
        self._move = r.register_script(lua("reclaim_entry"))
        #: on a cluster: `_scripted` loads the scripts on every master first, and again after a
        #: NOSCRIPT
        self._cluster = is_cluster(r)
        self._loaded = False

    async def close(self, lanes: Sequence[tuple[str, str, bool]]) -> list[int]:
        """`ShardStream.close_lanes`: per lane ``(key, burst, ended)``, 1 closed, 0 left, -1 it
        holds undelivered entries."""
        if not lanes:
            return []
        pipe = self.r.pipeline(transaction=False)
        now_ms = int(time.time() * 1000)
        for key, burst, ended in lanes:
            args = [burst, "ended" if ended else "sealed", ENDED_IDLE_MS, GROUP, now_ms]
            await self._scripted(pipe, self._close, [key, self.index], args)
        replies = await pipe.execute(raise_on_error=False)
        self._loaded = self._loaded and not any(isinstance(x, NoScriptError) for x in replies)
        return [x if isinstance(x, int) else 0 for x in replies]

    async def release(self, items: Sequence[tuple[Delivery, str]]) -> None:
        """`ShardStream.release`: each ``(delivery, intake)`` re-added to its intake, acked here."""
        if not items:
            return
        pipe = self.r.pipeline(transaction=False)
        for d, intake in items:
            args = [GROUP, d.entry_id, self.consumer, 0, "requeue", CARRIED, d.deliveries - 1, ""]
            await self._scripted(pipe, self._move, [d.key, intake], args)
        replies = await pipe.execute(raise_on_error=False)
        self._loaded = self._loaded and not any(isinstance(x, NoScriptError) for x in replies)

    async def _scripted(self, pipe: Any, script: Any, keys: list[str], args: list[Any]) -> None:
        """Add a call of ``script`` to ``pipe`` (on a cluster: EVALSHA, routed by its first key,
        the scripts loaded on every master first)."""
        if not self._cluster:
            await script(keys=keys, args=args, client=pipe)
            return
        if not self._loaded:
            for one in (self._close, self._move):
                await self.r.script_load(one.script)
            self._loaded = True
        pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
