"""Forced disconnects of the asyncio client abort their socket.

redis-py disconnects a connection with ``nowait=True`` when a command on it fails or is
cancelled (a worker's blocking reads when it stops): it closes the stream without waiting for
the close to finish. Over TLS a close is an exchange (close_notify, then the peer's answer), so an
event loop that ends right after (the worker's ``asyncio.run`` at its exit, `Producer.submit`'s)
leaves the socket open until the garbage collector finds it ("ResourceWarning: unclosed
transport"; a file descriptor held meanwhile by an embedding process). A forced disconnect has
no use for an orderly TLS close, the connection being in an unknown state: `install` makes it
abort the transport, which closes the socket at the loop's next step, over TCP and TLS alike.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import redis.asyncio as aredis


class _Aborting:
    """``disconnect(nowait=True)`` aborts the transport first (mixed into a connection class)."""

    async def disconnect(self, nowait: bool = False, **kwargs: Any) -> None:
        if nowait:
            writer = getattr(self, "_writer", None)  # redis-py's stream writer, None if closed
            if writer is not None:
                writer.transport.abort()
        await super().disconnect(nowait=nowait, **kwargs)  # type: ignore[misc]


@cache
def connection_class(base: type[aredis.Connection]) -> type[aredis.Connection]:
    """``base`` (a redis-py connection class) whose forced disconnects abort."""
    return type(base.__name__, (_Aborting, base), {"__module__": __name__})


def install(client: aredis.Redis) -> aredis.Redis:
    """``client`` (built by ``from_url``), its connections aborting on forced disconnects."""
    pool = client.connection_pool
    pool.connection_class = connection_class(pool.connection_class)
    return client
