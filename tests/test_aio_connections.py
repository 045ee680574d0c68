"""The asyncio clients' connections (store/aio_connections.py), on a real redis-server and a real
Redis Cluster: a write that the stream was closed under (the race of a disconnect or a peer reset
during a failover, injected here by a stream writer that fails as a torn-down one does) is a lost
connection the client retries, not an AttributeError that ends a worker's reader; and the cluster
client's node connections get the same class. (Forced disconnects aborting their socket:
tests/test_faults_security.py, over TLS.)"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from prefixq.core.settings import Settings
from prefixq.store import aio_connections
from prefixq.store.connection import async_client


class TornWriter:
    """A stream writer whose first write fails as a writer whose stream was torn down does
    (the write after it goes to the real one)."""

    def __init__(self, real: Any) -> None:
        self.real, self.failed = real, 0
        self.transport = real.transport

    def writelines(self, data: Any) -> None:
        if not self.failed:
            self.failed += 1
            raise AttributeError("'NoneType' object has no attribute 'writelines'")
        self.real.writelines(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def tear(conn: Any) -> TornWriter:
    torn = TornWriter(conn._writer)
    conn._writer = torn
    return torn


def test_a_torn_write_is_a_lost_connection_the_client_retries(
    make_settings: Callable[..., Settings],
) -> None:
    """Given a pooled connection whose next write fails inside asyncio, a command on the client
    still succeeds: the failure reached redis-py's retry as a ConnectionError."""

    async def run() -> tuple[Any, int]:
        r = async_client(make_settings())
        try:
            await r.set("k", "v")
            conn = r.connection_pool._available_connections[0]
            assert isinstance(conn, aio_connections._Guarded)
            torn = tear(conn)
            got = await r.get("k")
            return got, torn.failed
        finally:
            await r.aclose()

    got, failed = asyncio.run(run())
    assert (got, failed) == (b"v", 1)


def test_the_cluster_clients_node_connections_ride_through_a_torn_write(
    cluster_settings: Callable[..., Settings],
) -> None:
    """Given prefixq's asyncio cluster client, every node connection it opens (the start-up
    nodes' and the nodes it learns from the slot map) has the guarded class, and a torn write on
    one is retried by the cluster client."""
    s = cluster_settings()

    async def run() -> tuple[list[bool], Any, int]:
        c = async_client(s)
        try:
            keys = [f"{s.namespace}:{i}" for i in range(12)]  # keys of several masters
            for k in keys:
                await c.set(k, k)
            conns = [x for node in c.get_nodes() for x in node._connections]
            guarded = [isinstance(x, aio_connections._Guarded) for x in conns]
            node = c.get_node_from_key(keys[0])
            torn = tear(node._free[0])
            got = await c.get(keys[0])
            return guarded, got, torn.failed
        finally:
            await c.aclose()

    guarded, got, failed = asyncio.run(run())
    assert guarded and all(guarded)
    assert (got, failed) == (f"{s.namespace}:0".encode(), 1)
