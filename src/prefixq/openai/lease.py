"""Leases: which server validates or finalizes a batch right now.

A lease is a Redis string ``<token>`` with a TTL (`TTL_MS`), taken with ``SET NX`` and renewed every
`RENEW_S` while the work runs. A server that dies loses its leases within `TTL_MS`; any server's
sweeper then takes the batch over. Every status change a lease holder makes checks the lease in
the same Lua script (lua/batch_transition.lua), so a server that lost its lease writes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator

import redis.asyncio as aredis

from prefixq.store.connection import raise_if_cancelled
from prefixq.store.lua_script import LuaScript
from prefixq.store.redis_errors import TRANSIENT

__all__ = ["RENEW_S", "TTL_MS", "acquire", "held", "release"]

log = logging.getLogger(__name__)

TTL_MS = 30_000
RENEW_S = 10.0
#: releases or renews a lease if it is still the caller's token (lua/batch_lease.lua)
_LEASE = LuaScript("batch_lease")


async def acquire(r: aredis.Redis, key: str) -> str | None:
    """Take the lease at ``key``; returns the token, or None when another server holds it."""
    token = secrets.token_hex(8)
    return token if await r.set(key, token, nx=True, px=TTL_MS) else None


async def release(r: aredis.Redis, key: str, token: str) -> None:
    """Give the lease back if it is still ours."""
    await _LEASE.acall(r, keys=[key], args=[token, "release", 0])


@contextlib.asynccontextmanager
async def held(r: aredis.Redis, key: str, token: str) -> AsyncIterator[None]:
    """Keep renewing the lease while the block runs; release it at the end."""

    async def renew() -> None:
        while True:
            await asyncio.sleep(RENEW_S)
            try:
                if not await _LEASE.acall(r, keys=[key], args=[token, "renew", TTL_MS]):
                    log.warning("lease %s was lost; the batch's next status change is refused", key)
                    return
            except TRANSIENT as e:
                log.warning("renewing lease %s failed: %s", key, e)
            raise_if_cancelled()  # a cancel the Redis call swallowed

    task = asyncio.create_task(renew())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        with contextlib.suppress(*TRANSIENT):
            await release(r, key, token)
