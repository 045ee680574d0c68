"""Redis's eviction policy: prefixq needs ``maxmemory-policy noeviction``.

Under an evicting policy (``allkeys-lru``, ``volatile-ttl``, ...) Redis deletes keys without a
word when it reaches ``maxmemory``: queued entries, burst records, results, heartbeats. Under
``noeviction`` it refuses writes instead (OOM), which prefixq reports and retries. So a Redis that
evicts is refused with a `ConfigError`, unless the ``allow_eviction`` setting accepts the risk, in
which case every check logs a warning.

The policy is read with ``CONFIG GET maxmemory-policy``; when an ACL (or a managed service)
refuses CONFIG, from ``INFO memory``; when both are refused, a warning says it could not be
checked and the caller goes on. Workers check at start, `prefixq check` at every run. On a Redis
Cluster every master is read (``target_nodes``) and judged on its own: one evicting master is
refused, naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import redis
import redis.asyncio as aredis
from redis.exceptions import ResponseError

from prefixq.core.errors import ConfigError
from prefixq.core.settings import Settings
from prefixq.store.connection import is_cluster
from prefixq.store.redis_errors import error_text, no_such_db
from prefixq.store.redis_url import redact

__all__ = ["REQUIRED", "acheck_policy", "check_policy", "verdict"]

log = logging.getLogger(__name__)

#: the one policy under which Redis never drops a key on its own
REQUIRED = "noeviction"


def verdict(policy: str | None, settings: Settings, node: str = "") -> str | None:
    """What to say about ``policy`` (None: it could not be read): None when it is `REQUIRED`, a
    warning to log when it cannot be checked or eviction is allowed; ConfigError otherwise.
    ``node``: the cluster master it was read from (named instead of the URL)."""
    url = (
        f"{redact(settings.redis_url)} (cluster master {node})"
        if node
        else redact(settings.redis_url)
    )
    if policy is None:
        return (
            f"could not check the maxmemory-policy of Redis at {url} (CONFIG GET and INFO were "
            f"refused); prefixq needs {REQUIRED}: under an evicting policy Redis may drop "
            "queued requests and results"
        )
    if policy == REQUIRED:
        return None
    if not settings.allow_eviction:
        raise ConfigError(
            f"Redis at {url} has maxmemory-policy {policy}: at maxmemory it evicts keys, losing "
            f"queued requests, burst records and results. prefixq needs {REQUIRED}: run "
            f"`redis-cli CONFIG SET maxmemory-policy {REQUIRED}` (and `CONFIG REWRITE` to keep "
            f"it), or put `maxmemory-policy {REQUIRED}` in redis.conf; or accept the risk with "
            "PREFIXQ_ALLOW_EVICTION=1 (--allow-eviction)"
        )
    return (
        f"Redis at {url} has maxmemory-policy {policy} (allowed by allow_eviction): keys it "
        "evicts at maxmemory are lost work (queued requests, burst records, results)"
    )


def check_policy(r: redis.Redis, settings: Settings) -> None:
    """Read the policy with a blocking client and apply `verdict` (log its warning); on a
    cluster, each master's."""
    if not is_cluster(r):
        _apply(_read(r, {}), settings)
        return
    for node in r.get_primaries():
        _apply(_read(r, {"target_nodes": node}), settings, node.name)


def _read(r: redis.Redis, where: dict[str, Any]) -> str | None:
    try:
        return _from_config(r.config_get("maxmemory-policy", **where))
    except ResponseError as e:
        if no_such_db(e):  # not a refused command: the caller says what it is
            raise
        log.debug("CONFIG GET refused (%s); reading INFO memory", error_text(e))
        try:
            return _from_info(r.info("memory", **where))
        except ResponseError as e2:
            if no_such_db(e2):
                raise
            log.debug("INFO memory refused too (%s)", error_text(e2))
            return None


async def acheck_policy(r: aredis.Redis, settings: Settings) -> None:
    """Read the policy with an asyncio client and apply `verdict` (log its warning); on a
    cluster, each master's."""
    if not is_cluster(r):
        _apply(await _aread(r, {}), settings)
        return
    await r.initialize()  # the node list (a no-op once the client has it)
    for node in r.get_primaries():
        _apply(await _aread(r, {"target_nodes": node}), settings, node.name)


async def _aread(r: aredis.Redis, where: dict[str, Any]) -> str | None:
    try:
        return _from_config(await r.config_get("maxmemory-policy", **where))
    except ResponseError as e:
        if no_such_db(e):  # not a refused command: the caller says what it is
            raise
        log.debug("CONFIG GET refused (%s); reading INFO memory", error_text(e))
        try:
            return _from_info(await r.info("memory", **where))
        except ResponseError as e2:
            if no_such_db(e2):
                raise
            log.debug("INFO memory refused too (%s)", error_text(e2))
            return None


def _apply(policy: str | None, settings: Settings, node: str = "") -> None:
    warning = verdict(policy, settings, node)
    if warning:
        log.warning("%s", warning)


def _text(v: Any) -> str | None:
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    return None if v is None else str(v)


def _from_config(reply: Mapping[Any, Any]) -> str | None:
    for k, v in reply.items():
        if _text(k) == "maxmemory-policy":
            return _text(v)
    return None


def _from_info(info: Mapping[str, Any]) -> str | None:
    return _text(info.get("maxmemory_policy"))
