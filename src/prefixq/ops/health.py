"""`prefixq check`: does a live worker with its engine up serve each shard? (compose healthchecks)

Every worker renews its heartbeat hash (`Keys.heartbeat`) each ``heartbeat_s`` with a TTL of
``heartbeat_ttl_s`` and lists its name in the shard's workers set. A worker counts as healthy
while its heartbeat exists (so it beat within the TTL), says ``engine_up`` 1 and is not stopping.
The check first reads Redis's eviction policy (store/policy.py; every master of a cluster): an
evicting Redis is a configuration error. On a Redis Cluster the verdict comes with the cluster's
layout (store/topology.py). Read-only: the check never writes to Redis.

Probes of a pod or container whose shard is not fixed (``prefixq worker --join``) check this
machine's workers only (``local``: the heartbeat's ``host`` is this host name, a pod's name), on
whichever shard they serve; ``alive`` counts a worker whose heartbeat is fresh even while its
engine loads or it stops (a liveness probe: restarting it would not help).
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field

import redis
from redis.exceptions import RedisError

from prefixq.core.errors import ConfigError
from prefixq.core.settings import Settings
from prefixq.store.connection import is_cluster, sync_client
from prefixq.store.policy import check_policy
from prefixq.store.redis_errors import describe, error_text, refused
from prefixq.store.redis_url import redact
from prefixq.store.topology import layout_lines

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Health:
    """The verdict: ``ok``, one line saying why, and the healthy workers of each shard checked."""

    ok: bool
    reason: str
    healthy: dict[int, list[str]] = field(default_factory=dict)
    #: on a Redis Cluster: cluster mode, its nodes and each shard's master (store/topology.py)
    layout: list[str] = field(default_factory=list)


def check(
    settings: Settings,
    *,
    shard: int | None = None,
    client: redis.Redis | None = None,
    local: bool = False,
    alive: bool = False,
    host: str | None = None,
) -> Health:
    """Healthy if every shard checked (``shard``, else all of the deployment's) has at least one
    healthy worker; with ``local``, if at least one worker of this host (``host``, default
    this machine's name) is healthy on any shard checked; with ``alive``, a fresh heartbeat is
    enough (engine loading or stopping). Redis errors make it unhealthy; ConfigError (exit 2)
    when Redis refuses the credentials or a command, or its maxmemory-policy evicts keys (unless
    allowed)."""
    if shard is not None and shard < 0:
        raise ConfigError(f"--shard must be >= 0, not {shard}")
    r = client or sync_client(settings)
    try:
        check_policy(r, settings)
        mine = (host or socket.gethostname()) if local else None
        health = _check(r, settings, shard, mine, alive)
        if is_cluster(r):
            stored = r.hget(settings.keys.config, "shards")
            n = int(stored) if stored is not None else settings.shards
            lines = layout_lines(r, settings.keys, n)
            return Health(health.ok, health.reason, health.healthy, lines)
        return health
    except (RedisError, OSError) as e:
        if refused(e):  # no retry or restart fixes it: a configuration error
            raise describe(settings, e) from e
        return Health(False, f"redis at {redact(settings.redis_url)}: {error_text(e)}")
    finally:
        if client is None:
            r.close()


def _check(
    r: redis.Redis, settings: Settings, shard: int | None, host: str | None, alive: bool
) -> Health:
    keys = settings.keys
    if shard is None:
        stored = r.hget(keys.config, "shards")
        n = int(stored) if stored is not None else settings.shards
        if not n:
            return Health(
                False,
                f"namespace {settings.namespace!r} has no shard count in Redis (no worker has "
                "started there); pass --shard or --shards",
            )
        shards = list(range(n))
    else:
        stored = r.hget(keys.config, "shards")
        if stored is not None and shard >= int(stored):  # no worker could ever serve it
            raise ConfigError(
                f"shard {shard} does not exist (namespace {settings.namespace!r} has shards "
                f"0..{int(stored) - 1})"
            )
        shards = [shard]
    healthy: dict[int, list[str]] = {}
    problems: list[str] = []
    for k in shards:
        names = [x.decode() for x in r.zrange(keys.workers(k), 0, -1)]
        pipe = r.pipeline(transaction=False)
        for name in names:
            pipe.hmget(keys.heartbeat(k, name), ["engine_up", "stopping", "host"])
        beats = pipe.execute() if names else []
        healthy[k] = []
        down: list[str] = []
        expired = 0
        for name, (engine_up, stopping, on) in zip(names, beats, strict=True):
            if host is not None and (on is None or on.decode() != host):
                continue  # another machine's worker, or expired (its host unknown)
            if engine_up is None:
                expired += 1
            elif alive:
                healthy[k].append(name)
            elif stopping == b"1":
                down.append(f"{name} stopping")
            elif engine_up != b"1":
                down.append(f"{name} engine not up")
            else:
                healthy[k].append(name)
        log.debug("shard %d: healthy %s, down %s, expired %d", k, healthy[k], down, expired)
        if not healthy[k]:
            why = ", ".join(down) if down else "no worker registered"
            if expired:
                why = (f"{why}; " if down else "") + f"{expired} heartbeat(s) expired"
            problems.append(f"shard {k}: no healthy worker ({why})")
    if host is not None:
        return _local(host, healthy)
    if problems:
        return Health(False, "; ".join(problems), healthy)
    listing = "; ".join(f"shard {k}: {', '.join(v)}" for k, v in healthy.items())
    return Health(True, f"ok: {listing}", healthy)


def _local(host: str, healthy: dict[int, list[str]]) -> Health:
    """The verdict over this host's workers: one healthy on any shard is enough."""
    found = {k: v for k, v in healthy.items() if v}
    if not found:
        return Health(False, f"no healthy worker on host {host!r}", healthy)
    listing = "; ".join(f"shard {k}: {', '.join(v)}" for k, v in found.items())
    return Health(True, f"ok: {listing}", healthy)
