"""Lua scripts called directly survive a script cache emptied again and again (store/lua_script.py).

A thread sends ``SCRIPT FLUSH`` in a tight loop to the real redis-server (to every master of the
real Redis Cluster), as a failover to replicas with empty caches, a restart or an operator would,
while the real call sites run: bursts submitted (their prefixes claimed: lua/claim_prefixes.lua)
and cancelled (lua/finish_missing.lua) from blocking and asyncio clients, prefix claims, joiners
taking, renewing and releasing shards (lua/join_shard.lua, renew_join, release_join). None may
raise, each has its effect, and the calls did meet NOSCRIPT (logged at DEBUG when sent again).
(redis-py's `register_script` objects loaded the script once after a NOSCRIPT and let a second
one through: 11 of 30 cancels failed so on a cluster whose caches were flushed every 30-40 ms;
every test here failed so, run after run, before store/lua_script.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import redis

import prefixq
from prefixq.cli.redis_server import RedisServer
from prefixq.client import Producer
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.store import burst_end
from prefixq.store.connection import async_client, lua, sync_client
from prefixq.store.deployment import Joined, ajoin, arelease_join, renew_join
from prefixq.store.lua_script import LuaScript
from prefixq.store.prefix_claims import claim
from redis_cluster import RedisCluster

#: bursts submitted and cancelled per test, half from a blocking client, half from an asyncio one
BURSTS = 16
#: requests per burst
PER_BURST = 3


@contextlib.contextmanager
def script_flushes(
    nodes: Sequence[redis.Redis], caplog: pytest.LogCaptureFixture
) -> Iterator[list[int]]:
    """SCRIPT FLUSH on every one of ``nodes``, round after round, while inside (a script loaded
    is gone a round trip later); yields a list whose one item counts the rounds. On exit: the
    thread flushed, and some script call met a NOSCRIPT and was sent again (the test is real)."""
    rounds = [0]
    done = threading.Event()

    def flush() -> None:
        while not done.is_set():
            for n in nodes:
                n.script_flush()
            rounds[0] += 1

    t = threading.Thread(target=flush, name="script-flush", daemon=True)
    t.start()
    try:
        with caplog.at_level(logging.DEBUG, logger="prefixq.store.lua_script"):
            yield rounds
    finally:
        done.set()
        t.join(5)
        for n in nodes:
            n.close()
    assert rounds[0] >= 20, f"only {rounds[0]} rounds of SCRIPT FLUSH"
    again = [x for x in caplog.records if "NOSCRIPT" in x.getMessage()]
    assert again, "no script call met a NOSCRIPT: the flushes missed them"


def _submit_and_cancel(s: Settings, check: redis.Redis) -> None:
    """`BURSTS` bursts submitted (their prefixes claimed) and cancelled, half of them by
    `burst_end.cancel` on a blocking client, half by `burst_end.acancel` on an asyncio one: each
    cancel fails every request as cancelled, ends its burst and queues its webhook once
    (lua/hook_add.lua)."""
    keys = Keys(s.namespace)
    producer = Producer(s)
    bursts = [
        str(
            producer.submit(
                [
                    {"id": f"q{i}", "prefix": f"document {b} " * 40, "prompt": f"q{i}"}
                    for i in range(PER_BURST)
                ],
                placement="affinity",
                on_complete_url="http://127.0.0.1:9/hook",
            )
        )
        for b in range(BURSTS)
    ]
    half = BURSTS // 2
    blocking = sync_client(s)
    try:
        reports = [burst_end.cancel(b, s, client=blocking) for b in bursts[:half]]
    finally:
        blocking.close()

    async def acancel_rest() -> list[burst_end.CancelReport]:
        r = async_client(s)
        try:
            return [await burst_end.acancel(b, s, r) for b in bursts[half:]]
        finally:
            await r.aclose()

    reports += asyncio.run(acancel_rest())
    for b, rep in zip(bursts, reports, strict=True):
        assert (rep.cancelled, rep.status, rep.ended) == (PER_BURST, "cancelled", True), rep
        assert check.hlen(keys.results(b)) == PER_BURST
        assert check.hget(keys.burst(b), "status") == b"cancelled"
    assert check.hlen(keys.prefix_map) > 0  # the submits claimed their prefixes
    assert check.zcard(keys.hooks_due) == BURSTS  # one batch.cancelled delivery per burst


def _claims(s: Settings, calls: int = 60) -> None:
    """``calls`` claims of fresh checkpoints, each claimed again for another shard: the first
    claim wins (HSETNX), a move ("m") takes it over."""
    keys = Keys(s.namespace)

    async def go() -> None:
        r = async_client(s)
        try:
            for i in range(calls):
                cps = {b"t" + (8 * i + j).to_bytes(7, "big"): j for j in range(3)}  # 8 bytes
                assert await claim(r, keys, 10_000, cps, {}) == cps
                again = dict.fromkeys(cps, 7)
                assert await claim(r, keys, 10_000, again, {}) == cps
                moved = await claim(r, keys, 10_000, again, dict.fromkeys(cps, "m"))
                assert moved == again
        finally:
            await r.aclose()

    asyncio.run(go())


def _joins(s: Settings, joiners: int = 12) -> None:
    """``joiners`` joiners (no worker beats) take shards 0, 1, ... in turn, renew their holds
    (blocking client) and release them."""

    async def join_all() -> list[Joined]:
        r = async_client(s)
        try:
            return [await ajoin(r, s) for _ in range(joiners)]
        finally:
            await r.aclose()

    joined = asyncio.run(join_all())
    assert [j.shard for j in joined] == list(range(joiners))
    blocking = sync_client(s)
    try:
        renewed = [renew_join(blocking, s, j) for j in joined]
    finally:
        blocking.close()
    assert all(j is not None for j in renewed)

    async def release_all() -> list[bool]:
        r = async_client(s)
        try:
            return [await arelease_join(r, s, j) for j in renewed if j is not None]
        finally:
            await r.aclose()

    assert asyncio.run(release_all()) == [True] * joiners


def test_bursts_are_claimed_and_cancelled_while_the_script_cache_is_flushed(
    make_settings: Callable[..., Settings],
    r: redis.Redis,
    redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Given SCRIPT FLUSH in a tight loop, bursts submitted and cancelled (blocking and asyncio
    clients) all end cancelled, and no call raises NOSCRIPT."""
    s = make_settings(shards=4)
    with script_flushes([redis.Redis.from_url(redis_server.url)], caplog):
        _submit_and_cancel(s, r)


def test_prefix_claims_and_joins_hold_while_the_script_cache_is_flushed(
    make_settings: Callable[..., Settings],
    redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Given SCRIPT FLUSH in a tight loop, prefix claims keep their first-claim-wins contract
    and joiners take, renew and release distinct shards."""
    s = make_settings(shards=64)
    with script_flushes([redis.Redis.from_url(redis_server.url)], caplog):
        _claims(s)
        _joins(s)


def test_a_cluster_whose_masters_flush_their_script_caches_serves_every_script_call(
    cluster: RedisCluster,
    cluster_settings: Callable[..., Settings],
    cr: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Given SCRIPT FLUSH in a tight loop on every master of a Redis Cluster, the cluster
    clients (blocking and asyncio) submit, claim, cancel and join without an error: a call
    sent again as EVAL is routed by its first key, as EVALSHA is."""
    s = cluster_settings(shards=4)
    with script_flushes([m.client() for m in cluster.live_masters()], caplog):
        _submit_and_cancel(s, cr)
        _claims(s, calls=30)
        _joins(cluster_settings(shards=64), joiners=6)


def test_each_scripts_sha_is_the_one_redis_names_it_by(r: redis.Redis) -> None:
    """Every script of prefixq/store/lua/ has the SHA that SCRIPT LOAD answers: an EVALSHA
    finds a loaded script, and only a cache emptied since sends a call again as EVAL."""
    names = sorted(p.stem for p in (Path(prefixq.__file__).parent / "store" / "lua").glob("*.lua"))
    assert len(names) > 20
    for name in names:
        assert LuaScript(name).sha == r.script_load(lua(name)), name


def test_no_module_calls_a_script_through_redis_pys_script_objects() -> None:
    """Scripts are called directly through `LuaScript` only: a `register_script` object (one
    load after a NOSCRIPT, then the error) or a bare EVALSHA elsewhere would bring the defect
    back."""
    package = Path(prefixq.__file__).parent
    found = [
        f"{path.relative_to(package)}:{n}"
        for path in sorted(package.rglob("*.py"))
        if path.name != "lua_script.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "register_script(" in line or ".evalsha(" in line
    ]
    assert found == []
