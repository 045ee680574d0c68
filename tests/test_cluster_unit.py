"""prefixq's store layer on a real Redis Cluster (tests/redis_cluster.py): cluster mode is detected
from any node's URL, several seed nodes may be named, and the single-Redis path is unchanged;
cluster errors are transient; min_replicas_acked's fence; reads and scripts over several slots;
the layout report and the per-master policy check."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
import redis.asyncio.cluster as acluster
import redis.cluster as scluster
from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    MasterDownError,
    MovedError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from prefixq.cli.redis_server import RedisServer, free_port
from prefixq.core import wire
from prefixq.core.errors import ConfigError, ReplicasBehind, WritesLost
from prefixq.core.keys import GROUP
from prefixq.core.settings import Settings
from prefixq.core.sharing import LaneInfo
from prefixq.store import connection
from prefixq.store.connection import async_client, cluster_mode, sync_client
from prefixq.store.fence import afence, fence, fence_key
from prefixq.store.policy import acheck_policy
from prefixq.store.redis_url import seed_url, seeds
from prefixq.store.topology import layout_lines
from prefixq.worker.prefixes import PrefixCache
from prefixq.worker.shard import ShardStream
from redis_cluster import RedisCluster


def test_seeds_parse_every_node_and_keep_credentials_and_options() -> None:
    url = "rediss://user:pw@h1:7000,h2:7001,h3/0?ssl_cert_reqs=none"
    assert seeds(url) == [("h1", 7000), ("h2", 7001), ("h3", 6379)]
    assert seed_url(url, 1) == "rediss://user:pw@h2:7001/0?ssl_cert_reqs=none"
    assert seed_url("redis://h:1/0") == "redis://h:1/0"
    assert seeds("unix:///tmp/redis.sock") == []


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis://127.0.0.1:1,127.0.0.1:2/3", "a cluster has database 0 only"),
        ("redis://127.0.0.1:1,127.0.0.1:x/0", "bad port"),
    ],
)
def test_a_multi_seed_url_that_cannot_work_is_a_config_error(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        sync_client(Settings(redis_url=url))


def test_any_node_of_a_cluster_gives_the_cluster_clients(cluster: RedisCluster) -> None:
    for node in cluster.nodes:
        url = f"redis://127.0.0.1:{node.port}/0"
        assert cluster_mode(url), f"node {node} not detected as a cluster node"
        r = sync_client(Settings(redis_url=url))
        assert isinstance(r, scluster.RedisCluster), type(r)
        assert connection.is_cluster(r)
        r.set("prefixq-unit:{s1}:x", "1")
        assert r.get("prefixq-unit:{s1}:x") == b"1"
        r.close()


def test_a_dead_first_seed_is_skipped(cluster: RedisCluster) -> None:
    dead = free_port()
    url = f"redis://127.0.0.1:{dead},127.0.0.1:{cluster.nodes[1].port}/0"

    async def go() -> bytes | None:
        r = async_client(Settings(redis_url=url))
        assert isinstance(r, acluster.RedisCluster), type(r)
        try:
            await r.set("prefixq-unit:{s2}:y", "2")
            got: bytes | None = await r.get("prefixq-unit:{s2}:y")
            return got
        finally:
            await r.aclose()

    assert asyncio.run(go()) == b"2"


def test_a_cluster_url_naming_another_database_is_a_config_error(cluster: RedisCluster) -> None:
    url = f"redis://127.0.0.1:{cluster.nodes[0].port}/2"
    with pytest.raises(ConfigError, match="database 0 only"):
        sync_client(Settings(redis_url=url))


def test_a_plain_redis_keeps_the_plain_clients(make_settings: Callable[..., Settings]) -> None:
    s = make_settings()
    assert not cluster_mode(s.redis_url)
    r = sync_client(s)
    assert type(r) is redis.Redis and not connection.is_cluster(r)
    r.close()


def test_an_unreachable_single_node_is_not_remembered(redis_server: RedisServer) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert not cluster_mode(url)
    assert url not in connection._MODES  # asked again once it answers


# ---- transient errors --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "err",
    [
        ClusterDownError("CLUSTERDOWN The cluster is down"),
        TryAgainError("TRYAGAIN Multiple keys request during rehashing of slot"),
        MasterDownError("MASTERDOWN Link with MASTER is down"),
        MovedError("1234 127.0.0.1:7000"),
        SlotNotCoveredError('Slot "1" is not covered by the cluster.'),
        ClusterError("TTL exhausted."),
        ResponseError("CLUSTERDOWN Hash slot not served"),
        RedisConnectionError("Error 111 connecting to 127.0.0.1:7000. Connection refused."),
    ],
)
def test_what_a_failover_looks_like_is_transient(err: Exception) -> None:
    assert connection.transient(err), err


@pytest.mark.parametrize(
    "err",
    [
        ResponseError("CROSSSLOT Keys in request don't hash to the same slot"),
        ResponseError("NOPERM this user has no permissions to access one of the keys"),
        ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
    ],
)
def test_a_bad_command_or_a_refusal_is_not_transient(err: Exception) -> None:
    assert not connection.transient(err), err


# ---- min_replicas_acked's fence ----------------------------------------------------------------
def test_a_fence_reaches_every_master_or_only_those_of_the_keys_written(
    cluster: RedisCluster, cluster_settings: Callable[..., Settings], cr: Any
) -> None:
    s = cluster_settings(min_replicas_acked=1)
    keys = s.keys
    masters = {cluster.master_of(keys.stream(k)).addr for k in (1, 2, 3)}
    assert len(masters) == 3, masters  # the fixture's promise: shards 1-3 on three masters
    assert fence(cr, s) == 3
    assert fence(cr, s, [keys.stream(1), keys.results("b1")]) == len(
        {cluster.master_of(keys.stream(1)).addr, cluster.master_of(keys.results("b1")).addr}
    )
    for node in cr.get_primaries():  # each master's fence key is on that master
        key = fence_key(cr, keys, node)
        assert cluster.master_of(key).addr == node.name
        assert cr.get(key) == b"1", f"fence on {node.name} not written"

    async def go() -> int:
        r = async_client(s)
        try:
            return await afence(r, s, [keys.stream(2)])
        finally:
            await r.aclose()

    assert asyncio.run(go()) == 1


def test_more_replicas_than_exist_is_replicas_behind_within_the_timeout(
    cluster: RedisCluster, cluster_settings: Callable[..., Settings], cr: Any
) -> None:
    s = cluster_settings(min_replicas_acked=2, min_replicas_acked_timeout_ms=200)
    t0 = time.monotonic()
    with pytest.raises(ReplicasBehind, match="only 1 of the 2 replicas"):
        fence(cr, s, [s.keys.stream(1)])
    took = time.monotonic() - t0
    assert took >= 0.2, f"WAIT returned after {took:.3f}s, before its 200 ms timeout"


def test_a_fence_on_a_single_redis_without_replicas_is_replicas_behind(
    make_settings: Callable[..., Settings],
) -> None:
    s = make_settings(min_replicas_acked=1, min_replicas_acked_timeout_ms=50)
    r = sync_client(s)
    try:
        with pytest.raises(ReplicasBehind, match="only 0 of the 1"):
            fence(r, s)
        assert fence(r, s.replace(min_replicas_acked=0)) == 0  # off: nothing sent
    finally:
        r.close()


def test_a_fence_reads_back_what_it_confirms_on_the_master_serving_it_now(
    cluster: RedisCluster, cluster_settings: Callable[..., Settings], cr: Any
) -> None:
    """A fence given fields to find confirms when the master serving them holds them all, and is
    WritesLost, naming what is missing, when one is not there (a failover between the write and
    the fence lost it): it never confirms a write that is gone."""
    s = cluster_settings(min_replicas_acked=1)
    keys = s.keys
    cr.hset(keys.results("b1"), mapping={"0": "x", "1": "y"})
    cr.hset(keys.results("b2"), "0", "z")

    async def go(present: dict[str, list[int]]) -> int:
        r = async_client(s)
        try:
            return await afence(r, s, [keys.stream(1)], present=present)
        finally:
            await r.aclose()

    held = {keys.results("b1"): [0, 1], keys.results("b2"): [0]}
    masters = {cluster.master_of(k).addr for k in [keys.stream(1), *held]}
    assert asyncio.run(go(held)) == len(masters)
    with pytest.raises(WritesLost, match=rf"1 writes .* {re.escape(keys.results('b1'))} 2\b"):
        asyncio.run(go({keys.results("b1"): [0, 2], keys.results("b2"): [0]}))


# ---- per-slot reads, scripts in cluster pipelines, the layout report --------------------------
def test_stored_prefixes_on_several_masters_are_read_per_slot(
    cluster: RedisCluster, cluster_settings: Callable[..., Settings], cr: Any
) -> None:
    s = cluster_settings()
    keys = s.keys
    refs = [f"{i:032x}" for i in range(12)]
    where = {cluster.master_of(keys.prefix(ref)).addr for ref in refs}
    assert len(where) > 1, "the prefixes should spread over several masters"
    for ref in refs:
        cr.set(keys.prefix(ref), wire.encode({"p": f"prefix {ref}"}, s.codec))

    async def go() -> dict[str, Any]:
        r = async_client(s)
        try:
            cache = PrefixCache(r, keys, wire.Limits.from_settings(s), 64)
            batch = [_Ref(ref) for ref in [*refs, "f" * 32]]
            return await cache.resolve(batch)  # type: ignore[arg-type]
        finally:
            await r.aclose()

    got = asyncio.run(go())
    assert {ref: got[ref] for ref in refs} == {ref: {"p": f"prefix {ref}"} for ref in refs}
    assert "not found" in str(got["f" * 32])


class _Ref:
    """The one field of an Entry that PrefixCache.resolve reads."""

    def __init__(self, ref: str) -> None:
        self.prefix_ref = ref


def test_a_lane_closes_in_a_cluster_pipeline_and_again_after_the_scripts_are_flushed(
    cluster: RedisCluster,
    cluster_settings: Callable[..., Settings],
    cr: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """close_lane.lua runs inside a cluster pipeline; after SCRIPT FLUSH on every master (what a
    promoted replica looks like: no script cache) the very next call loads it again and closes
    the lane, with a DEBUG line and no WARNING or ERROR."""
    caplog.set_level(logging.DEBUG, logger="prefixq")
    s = cluster_settings()
    keys = s.keys

    def lane(burst: str) -> str:
        key = keys.lane(2, burst)
        cr.xgroup_create(key, GROUP, id="0", mkstream=True)
        cr.hset(keys.lanes(2), burst, LaneInfo(sealed=True).encode())
        return key

    async def close(bursts: list[str]) -> list[int]:
        r = async_client(s)
        try:
            stream = ShardStream(r, s, 2, "unit")
            out = await stream.close_lanes([(lane(b), b, False) for b in bursts])
            for m in cluster.live_masters():
                with m.client() as one:
                    one.script_flush()
            again = await stream.close_lanes([(lane("c"), "c", False)])
            return [*out, *again]
        finally:
            await r.aclose()

    got = asyncio.run(close(["a", "b"]))
    assert got == [1, 1, 1], f"after SCRIPT FLUSH the first call closes the lane: {got}"
    assert not cr.exists(keys.lane(2, "a"), keys.lane(2, "b"), keys.lane(2, "c"))
    assert cr.hlen(keys.lanes(2)) == 0
    noscript = [x for x in caplog.records if "NOSCRIPT" in x.getMessage()]
    assert noscript, "the flush made the call fail once"
    assert all(x.levelno == logging.DEBUG for x in noscript), [x.getMessage() for x in noscript]


def test_the_layout_names_every_node_and_each_shards_master(
    cluster: RedisCluster, cluster_settings: Callable[..., Settings], cr: Any
) -> None:
    s = cluster_settings()
    lines = layout_lines(cr, s.keys, 4)
    assert lines[0] == "cluster mode: yes (3 masters, 3 replicas)", lines
    text = "\n".join(lines)
    for n in cluster.nodes:
        assert n.addr in text, f"{n.addr} not listed: {text}"
    for k in range(4):
        addr = cluster.master_of(s.keys.stream(k)).addr
        assert f"  shard {k}: slot {cluster.slot(s.keys.stream(k))} on master {addr}" in lines


def test_an_evicting_master_is_named_by_the_async_check(
    cluster: RedisCluster, cluster_settings: Callable[..., Settings]
) -> None:
    s = cluster_settings()
    bad = cluster.live_masters()[1]
    c = bad.client()
    c.config_set("maxmemory-policy", "volatile-lru")

    async def go() -> None:
        r = async_client(s)
        try:
            await acheck_policy(r, s)
        finally:
            await r.aclose()

    try:
        with pytest.raises(ConfigError, match=f"cluster master {bad.addr}.*volatile-lru"):
            asyncio.run(go())
    finally:
        c.config_set("maxmemory-policy", "noeviction")
        c.close()
    asyncio.run(go())  # all noeviction again: no refusal


def test_a_closed_connection_written_to_inside_redis_py_is_transient_and_a_bug_of_ours_is_not() -> (
    None
):
    """What a worker loop saw in a failover: a cluster client's slot-map refresh closed every
    connection, and another task's command wrote to the closed stream (AttributeError inside
    redis-py before 8.2, a ConnectionError from 8.2 on). That is retried; an AttributeError of
    prefixq's own code is not."""
    from redis.asyncio.connection import Connection

    async def write_on_closed() -> BaseException:
        try:
            await Connection()._send_packed_command([b"PING\r\n"])
        except (AttributeError, redis.ConnectionError) as e:
            return e
        raise AssertionError("redis-py wrote on a connection it never opened")

    err = asyncio.run(write_on_closed())
    assert connection.transient(err)
    assert isinstance(err, redis.ConnectionError) or connection.inside_redis_py(err)
    # the AttributeError of redis-py < 8.2, raised by code that lives in redis-py's files
    import redis.asyncio.connection as aconn

    with pytest.raises(AttributeError) as theirs:
        exec(compile("None.writelines", aconn.__file__, "exec"))
    assert connection.inside_redis_py(theirs.value) and connection.transient(theirs.value)
    with pytest.raises(AttributeError) as ours:
        None.writelines  # type: ignore[attr-defined]  # noqa: B018
    assert not connection.inside_redis_py(ours.value) and not connection.transient(ours.value)


@pytest.mark.parametrize("url", ["notaurl", "http://h:1/0", "localhost:6379", "redis:/h:1/0"])
def test_a_redis_url_that_is_not_one_says_what_one_looks_like(url: str) -> None:
    """Given a REDIS_URL without a Redis scheme, the error names the URL and the forms it may
    take (before: "seed '' names no host" for ``notaurl``)."""
    with pytest.raises(ConfigError, match=r"is not a Redis URL: redis://host:port/db"):
        seeds(url)


def test_a_redis_url_scheme_is_read_as_redis_py_reads_it() -> None:
    """Upper-case schemes are accepted, as redis-py accepts them; a URL with a password and no
    host says so without printing the password."""
    assert seeds("REDIS://h1:7000/0") == [("h1", 7000)]
    with pytest.raises(ConfigError, match=r"names no host") as e:
        seeds("redis://:secret@/0")
    assert "secret" not in str(e.value)
