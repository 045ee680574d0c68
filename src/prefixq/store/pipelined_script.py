"""`PipelinedScript`: a Lua script called by EVALSHA inside pipelines, loaded again after NOSCRIPT.

A pipeline cannot fall back to EVAL the way redis-py's `Script` does for a single call, and a
Redis Cluster pipeline sends a script as a bare EVALSHA (it loads nothing), so the script is loaded
first (`SCRIPT LOAD`: on a cluster, on every master) and called by its SHA, routed by its first
key. A restarted Redis, or a replica promoted by a failover, starts with an empty script cache: the
calls it refuses with NOSCRIPT ran nothing, so they are sent again once the script is loaded
again. That is routine after a failover, nothing for an operator to act on: it is logged at DEBUG.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import NoScriptError

__all__ = ["Call", "PipelinedScript"]

log = logging.getLogger(__name__)

#: one call of a script: its KEYS (the first routes it on a cluster) and its ARGV
Call = tuple[Sequence[Any], Sequence[Any]]


class PipelinedScript:
    """The Lua script ``text`` (named ``name`` in log lines) on client ``r``."""

    #: times the calls a NOSCRIPT refused are sent again, the script loaded before each (a second
    #: NOSCRIPT in a row needs a second failover between the load and the call)
    RELOADS = 5

    def __init__(self, r: aredis.Redis, text: str, name: str) -> None:
        self.r = r
        self.text = text
        self.name = name
        self.sha = ""

    async def load(self) -> None:
        """Load the script (every master of a cluster), whether or not it was loaded before."""
        self.sha = await self.r.script_load(self.text)

    async def ready(self) -> None:
        """Load the script unless this object loaded it already."""
        if not self.sha:
            await self.load()

    def add(self, pipe: Any, keys: Sequence[Any], args: Sequence[Any]) -> None:
        """Add one call to ``pipe`` (call `ready` first)."""
        pipe.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)

    async def run(self, calls: Sequence[Call]) -> list[Any]:
        """Each call, in one pipeline; per call its reply or the error that refused it (see
        `settle`). Connection errors raise."""
        await self.ready()
        return await self.settle(calls, await self._send(calls))

    async def settle(self, calls: Sequence[Call], replies: Sequence[Any]) -> list[Any]:
        """``replies`` (one per call, as a pipeline returned them) with each NOSCRIPT replaced by
        the reply of its call sent again once the script is loaded again (DEBUG: routine after a
        failover or a restart). A NOSCRIPT that outlasts `RELOADS` loads stays in the replies."""
        out = list(replies)
        for _ in range(self.RELOADS):
            again = [i for i, x in enumerate(out) if isinstance(x, NoScriptError)]
            if not again:
                break
            log.debug(
                "script %s: NOSCRIPT (a restarted or promoted Redis has no script cache); "
                "loaded again, %d calls sent again",
                self.name,
                len(again),
            )
            await self.load()
            for i, reply in zip(again, await self._send([calls[i] for i in again]), strict=True):
                out[i] = reply
        return out

    async def _send(self, calls: Sequence[Call]) -> list[Any]:
        pipe = self.r.pipeline(transaction=False)
        for keys, args in calls:
            self.add(pipe, keys, args)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        return replies
