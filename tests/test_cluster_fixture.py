"""The Redis Cluster fixture (tests/redis_cluster.py) is what the cluster tests rely on: 3 masters
each with a replica online, shards of a 4-shard deployment on all three masters, and a kill -9 of a
master that a replica takes over."""

from __future__ import annotations

from prefixq.core.keys import Keys
from redis_cluster import RedisCluster


def test_three_masters_each_replicated_and_shards_spread(cluster: RedisCluster) -> None:
    """Given the fixture, 3 masters serve the slots, each with one replica, and the `{s<k>}`
    keys of shards 1, 2, 3 sit on three different masters."""
    roles = cluster.roles()
    assert sorted(roles.values()) == ["master"] * 3 + ["slave"] * 3, roles
    keys = Keys("t")
    owners = {k: cluster.master_of(keys.intake(k, "normal")) for k in range(4)}
    assert len({owners[1], owners[2], owners[3]}) == 3, owners
    c = cluster.client()
    try:
        c.set(keys.intake(1, "normal") + ":probe", "x")
        assert c.get(keys.intake(1, "normal") + ":probe") == b"x"
    finally:
        c.close()


def test_killed_master_replaced_and_rejoins_as_replica(cluster: RedisCluster) -> None:
    """When the master of a slot is killed -9, its replica serves the slot; restarted, the old
    master rejoins as a replica and the cluster is whole again."""
    key = Keys("t").intake(0, "normal")
    old = cluster.kill_master_of(key)
    new = cluster.wait_failover(key, old)
    assert new is not old and new.alive
    cluster.restart(old)
    cluster.wait_whole()
    assert cluster.roles()[old] == "slave"
    assert cluster.master_of(key) is new
