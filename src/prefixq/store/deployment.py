"""The deployment's shape as Redis records it: the shard count (and the engine's block size).

The first worker (or producer given ``PREFIXQ_SHARDS``) writes the shard count into the namespace's
config hash; every later producer, tool and worker reads it from there.
"""

from __future__ import annotations

import redis
import redis.asyncio as aredis

from prefixq.core.errors import ConfigError
from prefixq.core.settings import Settings

__all__ = ["aresolve_shards", "resolve_shards"]


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
        if settings.shards and settings.shards != n:
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
