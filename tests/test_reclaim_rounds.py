"""The reclaimer's look for gone workers (worker/reclaim.py `reclaim_gone`) costs one round trip
for its holders' heartbeats, however many workers hold entries (store/liveness.py
`consumers_gone`), on a private real redis-server whose command counts show the same commands:
one EXISTS per holder. It used to ask for each holder's heartbeat in a round trip of its own,
every ``heartbeat_s``, from every worker of the shard."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from conftest import IN_CI
from prefixq.cli.redis_server import RedisServer
from prefixq.core.keys import GROUP
from prefixq.core.settings import Settings
from prefixq.store.connection import async_client
from prefixq.worker.deliveries import Delivery, Ref
from prefixq.worker.reclaim import Reclaimer
from prefixq.worker.shard import ShardStream
from prefixq.worker.solo import SoloGate

#: workers of the shard holding one entry each; the first `GONE` of them without a heartbeat
HOLDERS, GONE = 40, 10


class _Reclaiming:
    """The worker a `Reclaimer` serves (worker/view.py), holding nothing, taking over what it is
    given."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.stopping = False
        self.gate = SoloGate()
        self.taken: list[Delivery] = []

    def queue_keys(self) -> list[str]:
        return self.keys

    def holds(self, ref: Ref) -> bool:
        return False

    async def take_over(self, deliveries: list[Delivery]) -> None:
        self.taken += deliveries


@pytest.fixture
def private_server() -> Iterator[RedisServer]:
    """A redis-server of this test alone: its command counts are the test's."""
    if not shutil.which("redis-server"):
        if IN_CI:
            pytest.fail("redis-server is not installed (CI must have it)")
        pytest.skip("redis-server not on PATH")
    with RedisServer() as srv:
        yield srv


def _counting(client: Any, sent: list[bytes]) -> None:
    """Record what each round trip of ``client`` writes (one send per command or pipeline)."""
    pool = client.connection_pool
    base = pool.connection_class

    async def send_packed_command(self: Any, command: Any, *args: Any, **kw: Any) -> None:
        parts = [command] if isinstance(command, bytes | str) else command
        sent.append(b"".join(p.encode() if isinstance(p, str) else bytes(p) for p in parts))
        await base.send_packed_command(self, command, *args, **kw)

    pool.connection_class = type(
        base.__name__, (base,), {"send_packed_command": send_packed_command}
    )


def test_reclaim_gone_asks_for_every_holders_heartbeat_in_one_round_trip(
    private_server: RedisServer,
) -> None:
    """Given 40 workers of a shard each holding an entry, 30 of them beating and 10 gone, when a
    live worker looks for gone workers' entries, it sends the 40 EXISTS of their heartbeats in one
    round trip (before: 40), and takes exactly the 10 gone workers' entries over."""
    s = Settings(redis_url=private_server.url, namespace="rounds", shards=1, heartbeat_s=0.05)
    r = redis.Redis.from_url(private_server.url)
    keys = s.keys
    intake = keys.stream(0)
    r.xgroup_create(intake, GROUP, id="0", mkstream=True)
    names = [f"w{i}" for i in range(HOLDERS)]
    for name in names:
        r.xadd(intake, {"n": name})
        r.xreadgroup(GROUP, name, {intake: ">"}, count=1)
    for name in names[GONE:]:
        r.hset(keys.heartbeat(0, name), "pid", 1)
    r.config_resetstat()
    sent: list[bytes] = []

    async def look() -> tuple[int, list[Delivery]]:
        client = async_client(s)
        _counting(client, sent)
        await asyncio.sleep(0.1)  # past ``heartbeat_s``: the gone workers' entries are idle
        work = _Reclaiming([intake])
        try:
            return await Reclaimer(
                ShardStream(client, s, 0, "me"), work, s
            ).reclaim_gone(), work.taken
        finally:
            await client.aclose()

    got, taken = asyncio.run(look())
    exists_rounds = [m for m in sent if b"\r\nEXISTS\r\n" in m.upper()]
    calls = r.info("commandstats").get("cmdstat_exists", {}).get("calls", 0)
    print(f"  {len(exists_rounds)} round trip(s) carried {calls} EXISTS; {got} entries taken over")
    assert calls == HOLDERS  # one per holder, as before
    assert len(exists_rounds) == 1, f"{len(exists_rounds)} round trips asked for heartbeats"
    assert got == GONE
    assert sorted(d.fields[b"n"].decode() for d in taken) == sorted(names[:GONE])
    r.close()


def test_reclaim_gone_with_no_other_holder_asks_for_no_heartbeat(
    private_server: RedisServer,
) -> None:
    """Given a shard whose only pending entries are the looking worker's own (a restart's
    backlog), its look sends no EXISTS at all and takes nothing."""
    s = Settings(redis_url=private_server.url, namespace="own", shards=1, heartbeat_s=0.05)
    r = redis.Redis.from_url(private_server.url)
    intake = s.keys.stream(0)
    r.xgroup_create(intake, GROUP, id="0", mkstream=True)
    r.xadd(intake, {"n": "mine"})
    r.xreadgroup(GROUP, "me", {intake: ">"}, count=1)
    r.config_resetstat()

    async def look() -> int:
        client = async_client(s)
        try:
            return await Reclaimer(
                ShardStream(client, s, 0, "me"), _Reclaiming([intake]), s
            ).reclaim_gone()
        finally:
            await client.aclose()

    assert asyncio.run(look()) == 0
    assert "cmdstat_exists" not in r.info("commandstats")
    r.close()
