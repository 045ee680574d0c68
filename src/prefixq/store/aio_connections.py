"""What prefixq's asyncio clients change in redis-py's connections (`install`, `install_cluster`).

- **A forced disconnect aborts its socket.** redis-py disconnects a connection with
  ``nowait=True`` when a command on it fails or is cancelled (a worker's blocking reads when it
  stops): it closes the stream without waiting for the close to finish. Over TLS a close is an
  exchange (close_notify, then the peer's answer), so an event loop that ends right after (the
  worker's ``asyncio.run`` at its exit, `Producer.submit`'s) leaves the socket open until the
  garbage collector finds it ("ResourceWarning: unclosed transport"; a file descriptor held
  meanwhile by an embedding process). A forced disconnect has no use for an orderly TLS close,
  the connection being in an unknown state: aborting closes the socket at the loop's next step.
- **A write the stream closed under is a ConnectionError.** When a connection is closed while a
  task writes on it (a disconnect by another task, the peer's reset: a master failover), the
  write fails inside asyncio with an AttributeError or TypeError ("'NoneType' object has no
  attribute 'writelines'"), which is no RedisError, so no retry (redis-py's, the cluster client's,
  ours) treats it as the lost connection it is: a worker's reader died of it in a cluster soak.
  redis-py has already disconnected the connection; it becomes redis-py's ConnectionError
  (redis-py issues 3546 and 4287 describe the race).
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

import redis.asyncio as aredis
import redis.asyncio.cluster as acluster
from redis.exceptions import ConnectionError as RedisConnectionError

log = logging.getLogger(__name__)


class _Guarded:
    """The two changes, mixed into a redis-py asyncio connection class."""

    async def disconnect(self, nowait: bool = False, **kwargs: Any) -> None:
        if nowait:
            writer = getattr(self, "_writer", None)  # redis-py's stream writer, None if closed
            if writer is not None:
                writer.transport.abort()
        await super().disconnect(nowait=nowait, **kwargs)  # type: ignore[misc]

    async def send_packed_command(self, command: Any, *args: Any, **kwargs: Any) -> None:
        try:
            await super().send_packed_command(command, *args, **kwargs)  # type: ignore[misc]
        except (AttributeError, TypeError) as e:  # redis-py disconnected it on the way out
            raise RedisConnectionError(f"the connection closed during a write ({e})") from e


@cache
def connection_class(base: type[aredis.Connection]) -> type[aredis.Connection]:
    """``base`` (a redis-py asyncio connection class) with both changes."""
    if issubclass(base, _Guarded):
        return base
    return type(base.__name__, (_Guarded, base), {"__module__": __name__})


def install(client: aredis.Redis) -> aredis.Redis:
    """``client`` (built by ``from_url``), its connections changed from now on."""
    pool = client.connection_pool
    pool.connection_class = connection_class(pool.connection_class)
    return client


def install_cluster(client: acluster.RedisCluster) -> acluster.RedisCluster:
    """A new (not yet initialized) cluster client whose node connections are changed: the
    class every node is built with (its nodes manager's connection arguments, which nodes met
    later are built from too) and that of the start-up nodes built already."""
    manager = getattr(client, "nodes_manager", None)
    kwargs = getattr(manager, "connection_kwargs", None)
    nodes = getattr(manager, "startup_nodes", None)
    if not isinstance(kwargs, dict) or not isinstance(nodes, dict):  # another redis-py layout
        log.debug("redis-py's cluster client has no nodes manager as expected: unchanged")
        return client
    kwargs["connection_class"] = connection_class(kwargs.get("connection_class", aredis.Connection))
    for node in nodes.values():
        node.connection_class = connection_class(node.connection_class)
    return client
