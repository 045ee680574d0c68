"""`PipelinedScript`: a Lua script called by EVALSHA inside pipelines, sent again after NOSCRIPT.

A Redis Cluster pipeline sends a script as a bare EVALSHA (it loads nothing), so the script is
loaded first (`SCRIPT LOAD`: on a cluster, on every master) and called by its SHA, routed by its
first key. A restarted Redis, or a replica promoted by a failover, starts with an empty script
cache: the calls it refuses with NOSCRIPT ran nothing, so they are sent again once the script is
loaded again, and those refused once more (the cache emptied again between the load and the call:
``SCRIPT FLUSH``, a second failover) are sent as EVAL with the script's text, which never answers
NOSCRIPT (routed by the first key on a cluster, as EVALSHA is). That is routine after a failover,
nothing for an operator to act on: it is logged at DEBUG. Single calls: store/lua_script.py.
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

    def add(
        self, pipe: Any, keys: Sequence[Any], args: Sequence[Any], *, text: bool = False
    ) -> None:
        """Add one call to ``pipe`` (call `ready` first): by its SHA, or with its ``text``."""
        how = ("EVAL", self.text) if text else ("EVALSHA", self.sha)
        pipe.execute_command(*how, len(keys), *keys, *args)

    async def run(self, calls: Sequence[Call]) -> list[Any]:
        """Each call, in one pipeline; per call its reply or the error that refused it (see
        `settle`). Connection errors raise."""
        await self.ready()
        return await self.settle(calls, await self._send(calls))

    async def settle(self, calls: Sequence[Call], replies: Sequence[Any]) -> list[Any]:
        """``replies`` (one per call, as a pipeline returned them) with each NOSCRIPT replaced by
        the reply of its call sent again once the script is loaded again, and then, refused
        again, with its text (DEBUG: routine after a failover or a restart): no NOSCRIPT stays."""
        out = list(replies)
        for text in (False, True):
            again = [i for i, x in enumerate(out) if isinstance(x, NoScriptError)]
            if not again:
                break
            log.debug(
                "script %s: NOSCRIPT (a restarted or promoted Redis has no script cache); "
                "%d calls sent again (%s)",
                self.name,
                len(again),
                "with the script's text" if text else "the script loaded again",
            )
            if not text:
                await self.load()
            sent = await self._send([calls[i] for i in again], text=text)
            for i, reply in zip(again, sent, strict=True):
                out[i] = reply
        return out

    async def _send(self, calls: Sequence[Call], *, text: bool = False) -> list[Any]:
        pipe = self.r.pipeline(transaction=False)
        for keys, args in calls:
            self.add(pipe, keys, args, text=text)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        return replies
