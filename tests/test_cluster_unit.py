"""store/connection.py on a real Redis Cluster (tests/redis_cluster.py): cluster mode is detected
from any node's URL, several seed nodes may be named, and the single-Redis path is unchanged."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import redis
import redis.asyncio.cluster as acluster
import redis.cluster as scluster

from prefixq.cli.redis_server import RedisServer, free_port
from prefixq.core.errors import ConfigError
from prefixq.core.settings import Settings
from prefixq.store import connection
from prefixq.store.connection import async_client, cluster_mode, seed_url, seeds, sync_client
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
