"""What a deployment's Redis looks like, for `prefixq check` and a worker's start-up log: cluster
mode yes/no, and on a Redis Cluster its nodes (masters, replicas and whose) and, for each shard k,
the slot of ``{s<k>}`` and the master that serves it now."""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aredis
from redis.crc import key_slot

from prefixq.core.keys import Keys
from prefixq.store.connection import is_cluster

__all__ = ["alayout_lines", "layout_lines"]


def _lines(nodes: dict[str, Any], owner: Any, keys: Keys, shards: int) -> list[str]:
    ids = {v.get("node_id"): addr for addr, v in nodes.items()}
    masters = sorted(a for a, v in nodes.items() if "master" in str(v.get("flags", "")))
    replicas = sorted(a for a, v in nodes.items() if "slave" in str(v.get("flags", "")))
    out = [f"cluster mode: yes ({len(masters)} masters, {len(replicas)} replicas)"]
    for a in masters:
        out.append(f"  master {a}" + (" (failed)" if "fail" in str(nodes[a].get("flags")) else ""))
    for a in replicas:
        of = ids.get(nodes[a].get("master_id"), "?")
        state = "" if nodes[a].get("connected", True) else ", disconnected"
        out.append(f"  replica {a} (of {of}{state})")
    for k in range(shards):
        key = keys.stream(k)
        out.append(f"  shard {k}: slot {key_slot(key.encode())} on master {owner(key)}")
    return out


def layout_lines(r: redis.Redis, keys: Keys, shards: int) -> list[str]:
    """The report's lines (blocking client); ``["cluster mode: no"]`` on a single Redis."""
    if not is_cluster(r):
        return ["cluster mode: no"]
    return _lines(r.cluster_nodes(), lambda k: r.get_node_from_key(k).name, keys, shards)


async def alayout_lines(r: aredis.Redis, keys: Keys, shards: int) -> list[str]:
    """The same with an asyncio client."""
    if not is_cluster(r):
        return ["cluster mode: no"]
    await r.initialize()
    return _lines(await r.cluster_nodes(), lambda k: r.get_node_from_key(k).name, keys, shards)
