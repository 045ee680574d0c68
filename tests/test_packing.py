"""The asyncio client's commands packed by hiredis (store/packing.py): the same bytes as redis-py
packs, redis-py's own rules for what hiredis does not take, and real round trips."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aredis
from redis.exceptions import DataError

from prefixq.core.settings import Settings
from prefixq.store import packing
from prefixq.store.connection import async_client

COMMANDS: list[tuple[Any, ...]] = [
    ("XADD", "ns:q:0:normal", "*", b"d", b"\x00" + bytes(range(256))),
    ("EVALSHA", "a" * 40, 4, "k1", "k2", "k3", "k4", 12, b"\x01zz", "", 604800, "1.5", 7, 0, 0),
    ("SET", "k", 1764604200.123),
    ("SET", "k", 1e-7),
    ("SET", "k", -(2**70)),
    ("SET", "ключ", "значение ü"),
    ("CONFIG GET", "maxmemory"),
    (b"CONFIG SET", b"maxmemory", 0),
    ("SET", "big", b"x" * 100_000),
]


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: str(c[0]))
def test_packs_the_bytes_redis_py_packs(cmd: tuple[Any, ...]) -> None:
    fast = packing.connection_class(aredis.Connection)()
    assert b"".join(fast.pack_command(*cmd)) == b"".join(aredis.Connection().pack_command(*cmd))


def test_what_hiredis_does_not_take_follows_redis_py() -> None:
    """A bool is refused with redis-py's DataError; a memoryview is packed by redis-py."""
    fast = packing.connection_class(aredis.Connection)()
    with pytest.raises(DataError):
        fast.pack_command("SET", "k", True)
    view = memoryview(b"abc")
    assert b"".join(fast.pack_command("SET", "k", view)) == b"".join(
        aredis.Connection().pack_command("SET", "k", view)
    )


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("redis://127.0.0.1:6379/0", aredis.Connection),
        ("rediss://127.0.0.1:6380/0", aredis.SSLConnection),
        ("unix:///tmp/redis.sock", aredis.UnixDomainSocketConnection),
    ],
)
def test_each_scheme_keeps_its_connection_kind(url: str, base: type) -> None:
    client = async_client(Settings(redis_url=url))
    kind = client.connection_pool.connection_class
    assert issubclass(kind, base) and issubclass(kind, packing._Packing)


def test_round_trips_through_a_real_server(settings: Settings) -> None:
    async def main() -> list[Any]:
        r = async_client(settings)
        try:
            pipe = r.pipeline(transaction=False)
            pipe.set("pk:f", 0.25)
            pipe.get("pk:f")
            pipe.xadd("pk:s", {b"d": b"\x00payload"})
            pipe.xlen("pk:s")
            pipe.config_get("maxmemory-policy")
            return list(await pipe.execute())
        finally:
            await r.delete("pk:f", "pk:s")
            await r.aclose()

    ok, value, _, length, config = asyncio.run(main())
    assert ok and value == b"0.25" and length == 1 and "maxmemory-policy" in config
