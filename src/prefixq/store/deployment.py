"""The deployment's shape as Redis records it: the shard count (and the engine's block size).

The first worker (or producer given ``PREFIXQ_SHARDS``) writes the shard count into the namespace's
config hash; every later producer, tool and worker reads it from there. A worker started with
``--join`` takes the lowest shard without a live worker, or grows the count by one
(`ajoin`); a count in the settings below Redis's is then a deployment that grew, not an error.
The shard is held for the joiner while its engine starts; a joiner that exits before serving
releases its hold (`arelease_join`), so the next one takes the shard instead of growing the count.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import redis
import redis.asyncio as aredis
from redis.exceptions import ResponseError

from prefixq.core.errors import ConfigError
from prefixq.core.settings import Settings
from prefixq.store.liveness import FUTURE_S, repaired, times_of
from prefixq.store.lua_script import LuaScript

log = logging.getLogger(__name__)

__all__ = [
    "Joined",
    "ahold",
    "ajoin",
    "arelease_join",
    "aresolve_shards",
    "renew_join",
    "resolve_shards",
]

#: a joiner takes a shard (lua/join_shard.lua) or grows the count (lua/grow_shards.lua); its hold
#: is released (lua/release_join.lua) or renewed (lua/renew_join.lua)
_JOIN, _GROW = LuaScript("join_shard"), LuaScript("grow_shards")
_RELEASE, _RENEW = LuaScript("release_join"), LuaScript("renew_join")


def _shards(stored: bytes | None, settings: Settings) -> tuple[int, bool]:
    """(shard count, whether to record it): Redis's record wins; settings may agree or seed it."""
    keys = settings.keys
    if stored is not None:
        try:
            n = int(stored)
        except ValueError:
            n = 0
        if n <= 0:
            raise ConfigError(
                f"namespace {settings.namespace!r} has a corrupt shard count {stored!r} in Redis "
                f"({keys.config}, field shards): set it to the number of shards (HSET)"
            )
        if settings.shards and settings.shards > n:
            raise ConfigError(
                f"PREFIXQ_SHARDS={settings.shards} but namespace {settings.namespace!r} has {n} "
                f"shards in Redis ({keys.config}); drop the setting or use another namespace"
            )
        return n, False
    if not settings.shards:
        raise ConfigError(
            "no shard count: set PREFIXQ_SHARDS (or --shards), or start the "
            "workers first (they record it)"
        )
    return settings.shards, True


async def aresolve_shards(r: aredis.Redis, settings: Settings) -> int:
    """The deployment's shard count (asyncio client); records it on first use."""
    n, record = _shards(await r.hget(settings.keys.config, "shards"), settings)
    if record:
        await r.hsetnx(settings.keys.config, "shards", n)
    return n


def resolve_shards(r: redis.Redis, settings: Settings) -> int:
    """The same with a blocking client."""
    n, record = _shards(r.hget(settings.keys.config, "shards"), settings)
    if record:
        r.hsetnx(settings.keys.config, "shards", n)
    return n


#: seconds between two looks of a joiner watching the shards' heartbeats before it grows the
#: count (`_Quiet`)
QUIET_POLL_S = 0.25


@dataclass(frozen=True, slots=True)
class Joined:
    """The shard a joining worker took, and the hold it wrote there (`Keys.joins`)."""

    shard: int
    #: the hold's value (until when, epoch s): only this joiner's own hold is released
    held: str


async def ajoin(r: aredis.Redis, settings: Settings) -> Joined:
    """The shard a joining worker serves: the lowest without a live worker that no other joiner
    holds, else a new one (the recorded count grows by one). Held for ``settings.join_hold_s``,
    renewed by the joiner while its engine starts (`renew_join`), until the worker's first
    heartbeat (which ends the hold: store/liveness.py, `beat_commands`), or until it exits before
    that (`arelease_join`)."""
    keys = settings.keys
    n = await aresolve_shards(r, settings)
    wait = _Quiet(settings)
    while True:
        now = time.time()
        held = repr(now + settings.join_hold_s)
        args = [repr(now), settings.heartbeat_ttl_s, n, held, FUTURE_S]
        try:
            k = int(await _JOIN.acall(r, keys=[keys.live, keys.joins], args=args))
        except ResponseError as err:  # a key of another type: replaced, as heartbeats do
            types = {keys.live: "hash", keys.joins: "hash"}
            if not await repaired(r, err, types, "heartbeats and joiners rebuild it"):
                raise
            continue
        if k >= 0:
            return Joined(k, held)
        if await wait.for_quiet(r, n):  # a worker killed moments ago: its shard, not a new one
            continue
        n = int(await _GROW.acall(r, keys=[keys.config], args=[n]))
        wait = _Quiet(settings)


class _Quiet:
    """A joiner that found every shard served or held: before it grows the count, it watches the
    live hash for up to ``heartbeat_ttl_s`` + 1 s. While some shard that no joiner holds has not
    beaten since the first look (its worker may have been killed moments ago: a replacement
    started at once), it waits for that beat to lapse, and takes that shard; once every such
    shard has beaten again, it grows the count."""

    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self.first: dict[int, float] | None = None
        self.until = time.monotonic() + settings.heartbeat_ttl_s + 1.0

    async def for_quiet(self, r: aredis.Redis, n: int) -> bool:
        """Whether to try the join again (after a pause) rather than grow."""
        if time.monotonic() >= self.until:
            return False
        keys, now, ttl = self.s.keys, time.time(), self.s.heartbeat_ttl_s
        live, joins = await r.hgetall(keys.live), await r.hgetall(keys.joins)
        beats = {k: v for k, v in times_of(live, n, now).items() if now - v <= ttl}
        held = {k for k, v in times_of(joins, n, now).items() if v >= now}
        if self.first is None:
            self.first = beats
            log.info("every shard is served or held: watching their heartbeats before growing")
        quiet = [k for k, v in self.first.items() if k not in held and beats.get(k, v) <= v]
        if not quiet:
            return False
        await asyncio.sleep(QUIET_POLL_S)
        return True


async def ahold(r: aredis.Redis, settings: Settings, shard: int) -> Joined:
    """Hold ``shard`` for a worker started on it (``--shard K``) while its engine starts, as a
    joiner's hold (`ajoin`): joiners skip it; the worker's first heartbeat ends it."""
    held = repr(time.time() + settings.join_hold_s)
    await r.hset(settings.keys.joins, str(shard), held)
    return Joined(shard, held)


async def arelease_join(r: aredis.Redis, settings: Settings, joined: Joined) -> bool:
    """Release ``joined``'s hold if it is still there (its worker never beat: it stops, or failed
    to start); whether it was."""
    args = [str(joined.shard), joined.held]
    return bool(await _RELEASE.acall(r, keys=[settings.keys.joins], args=args))


def renew_join(r: redis.Redis, settings: Settings, joined: Joined) -> Joined | None:
    """Extend ``joined``'s hold to ``join_hold_s`` from now (blocking client), if it is still there;
    the renewed hold, or None when it is gone (the worker's first heartbeat ended it, or another
    joiner holds the shard: nothing more to renew)."""
    held = repr(time.time() + settings.join_hold_s)
    args = [str(joined.shard), joined.held, held]
    renewed = _RENEW.call(r, keys=[settings.keys.joins], args=args)
    return Joined(joined.shard, held) if renewed else None
