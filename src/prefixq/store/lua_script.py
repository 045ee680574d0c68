"""`LuaScript`: a Lua script of prefixq/store/lua/ called on its own (not in a pipeline) by its
SHA, and sent again with its text after a NOSCRIPT. The one way prefixq calls a script directly.

redis-py's `register_script` objects load the script once after a NOSCRIPT and send EVALSHA again;
a script cache emptied again between the two (``SCRIPT FLUSH``, a failover to a replica whose cache
is empty, a restart) lets the second NOSCRIPT reach the caller as an error. Here a call refused with
NOSCRIPT, which ran nothing, is sent again at once as ``EVAL`` with the script's text: EVAL never
answers NOSCRIPT, so one call makes at most two round trips, and it caches the script on the server
that ran it, so the next EVALSHA there finds it (a ``SCRIPT LOAD`` first would be one more round
trip, and the cache could be emptied again before the EVALSHA). On a Redis Cluster, EVAL is routed
by its first key, as EVALSHA is. That is routine after a failover: logged at DEBUG.

`call` takes a blocking client (``redis.Redis`` or ``redis.cluster.RedisCluster``), `acall` an
asyncio one (``redis.asyncio.Redis`` or ``redis.asyncio.cluster.RedisCluster``); KEYS and ARGV and
the reply are the script's, as with `register_script`. Scripts sent in pipelines are
store/pipelined_script.py's (`PipelinedScript`: a pipeline cannot fall back call by call).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import redis
import redis.asyncio as aredis
from redis.exceptions import NoScriptError

from prefixq.store.connection import lua

__all__ = ["LuaScript"]

log = logging.getLogger(__name__)


class LuaScript:
    """The script prefixq/store/lua/``name``.lua, for any client (its text is read at first use)."""

    def __init__(self, name: str) -> None:
        self.name = name

    @property
    def text(self) -> str:
        """The script's Lua source (`lua`, read once per process)."""
        return lua(self.name)

    @cached_property
    def sha(self) -> str:
        """The SHA1 EVALSHA names the script by (of its UTF-8 text, as redis-py encodes it)."""
        return hashlib.sha1(self.text.encode()).hexdigest()

    def call(self, r: redis.Redis, keys: Sequence[Any], args: Sequence[Any] = ()) -> Any:
        """The script's reply to ``keys`` and ``args``, with blocking client ``r``."""
        try:
            return r.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            self._noscript()
            return r.eval(self.text, len(keys), *keys, *args)

    async def acall(self, r: aredis.Redis, keys: Sequence[Any], args: Sequence[Any] = ()) -> Any:
        """`call` with asyncio client ``r``."""
        try:
            return await r.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            self._noscript()
            return await r.eval(self.text, len(keys), *keys, *args)

    def either(self, r: Any, keys: Sequence[Any], args: Sequence[Any] = ()) -> Any:
        """`call` with a blocking client, an awaitable of `acall` with an asyncio one: for code
        written once for both kinds (store/burst_end.py's steps)."""
        if isinstance(r, aredis.Redis | aredis.RedisCluster):
            return self.acall(r, keys, args)
        return self.call(r, keys, args)

    def _noscript(self) -> None:
        log.debug(
            "script %s: NOSCRIPT (a restarted or promoted Redis, or SCRIPT FLUSH, emptied the "
            "script cache): sent again as EVAL with its text",
            self.name,
        )

    def __repr__(self) -> str:
        return f"LuaScript({self.name!r})"
