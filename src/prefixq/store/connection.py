"""Redis clients built from `Settings`: asyncio for the data plane, sync for tools and waiters.

Both retry transient connection errors with exponential backoff; refused credentials or
permissions and an untrusted server certificate are not retried (`refused`): retrying cannot fix
them (`prefixq.store.redis_errors` says which is which). TLS (``rediss://``) and ACL credentials
come from the URL (``rediss://user:password@host:port/db?ssl_ca_certs=/path/ca.crt``); redis-py
reads the ``ssl_*`` options from the query string, and an unknown option or a missing certificate
file is a `ConfigError` at once (`prefixq.store.redis_url`).

Redis Cluster is detected, not configured: the first time a process uses a URL, `cluster_mode`
asks the first reachable node it names for ``INFO cluster``; ``cluster_enabled:1`` gives
redis-py's cluster clients (``redis.cluster.RedisCluster``, ``redis.asyncio.cluster.RedisCluster``)
with the URL's credentials and TLS options, anything else the plain clients. The answer is kept
per URL, and every client prefixq makes comes from `sync_client` / `async_client`, so one place
decides. A URL may list several seed nodes, for when one is down:
``redis://user:pw@h1:7000,h2:7001,h3:7002/0`` (database 0 only: a cluster has no other).
"""

from __future__ import annotations

import asyncio
import importlib.resources
import logging
from functools import cache
from typing import Any
from urllib.parse import urlsplit

import redis
import redis.asyncio as aredis
import redis.asyncio.cluster as acluster
import redis.cluster as scluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError, ResponseError
from redis.retry import Retry

from prefixq.core.errors import ConfigError
from prefixq.core.settings import Settings
from prefixq.store import aio_connections, packing
from prefixq.store.redis_errors import error_text, refused

# (re-exported: tests/test_cluster_unit.py reads these two here, where they were first defined)
from prefixq.store.redis_errors import inside_redis_py as inside_redis_py
from prefixq.store.redis_errors import transient as transient
from prefixq.store.redis_url import check_url, redact, seed_url, seeds

log = logging.getLogger(__name__)


def raise_if_cancelled() -> None:
    """Raise CancelledError if the current task was asked to stop. redis-py's asyncio client can
    swallow a cancel that arrives while it opens a connection (the command then returns as if
    nothing happened), so a loop that runs until cancelled calls this after its Redis calls."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _not_refused(is_retryable: Any) -> Any:
    def check(err: Exception) -> bool:
        return not refused(err) and (is_retryable is None or bool(is_retryable(err)))

    return check


class _Retry(Retry):  # type: ignore[misc]
    """redis-py's blocking Retry, failing at once on `refused` errors."""

    def call_with_retry(self, do: Any, fail: Any, is_retryable: Any = None, **kw: Any) -> Any:
        return super().call_with_retry(do, fail, _not_refused(is_retryable), **kw)


class _AsyncRetry(AsyncRetry):  # type: ignore[misc]
    """redis-py's asyncio Retry, failing at once on `refused` errors."""

    async def call_with_retry(self, do: Any, fail: Any, is_retryable: Any = None, **kw: Any) -> Any:
        return await super().call_with_retry(do, fail, _not_refused(is_retryable), **kw)


def _options(settings: Settings) -> dict[str, Any]:
    # a reply may take as long as the longest blocking call prefixq makes (WAIT, for the fence)
    # and a little more; a server that accepts connections and never answers (stopped, hung)
    # is then a TimeoutError, not a wait for ever
    wait_s = settings.min_replicas_acked_timeout_ms / 1000
    options: dict[str, Any] = {
        "socket_timeout": max(SOCKET_TIMEOUT_S, wait_s + 5.0),
        "socket_connect_timeout": 5.0,
        "health_check_interval": 30,
        "retry_on_error": list(_RETRIED),  # not a timeout (see _RETRIED)
        "client_name": f"prefixq-{settings.namespace}",
    }
    if urlsplit(settings.redis_url).scheme != "unix":  # TCP only: a unix socket has no keepalive
        options["socket_keepalive"] = True
    return options


#: seconds a command's reply may take before the server counts as not answering (every blocking
#: read prefixq makes blocks for 1 s at most)
SOCKET_TIMEOUT_S = 10.0

#: what redis-py's retries try again: a lost or refused connection (a failover, a restart); not a
#: timeout (redis-py's default), which a server that never answers would repeat for each retry
_RETRIED = (RedisConnectionError,)

#: `cluster_mode`'s answers, per REDIS_URL (a process asks each URL once)
_MODES: dict[str, bool] = {}


def cluster_mode(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster: ``INFO cluster`` of the first seed node that
    answers says ``cluster_enabled:1``. Kept per URL. When no seed answers, a URL of several seeds
    is taken for a cluster and one of a single node for a plain Redis (not kept: asked again next
    time), so a client is still made and its commands retry as before."""
    known = _MODES.get(url)
    if known is not None:
        return known
    check_url(url)
    nodes = seeds(url)
    if not nodes:  # a unix socket: never a cluster
        _MODES[url] = False
        return False
    for i in range(len(nodes)):
        try:
            one = (
                urlsplit(seed_url(url, i))._replace(path="/0").geturl()
            )  # a cluster refuses SELECT
            with redis.Redis.from_url(one, socket_connect_timeout=2.0, socket_timeout=5.0) as r:
                info = r.info("cluster")
        except ResponseError as e:  # an ACL without INFO, a server without the section
            log.debug("INFO cluster refused by seed %d of %s: %s", i, redact(url), error_text(e))
            info = {}
        except (RedisError, OSError) as e:
            log.debug("seed %d of %s did not answer: %s", i, redact(url), error_text(e))
            continue
        except ValueError as e:
            raise ConfigError(f"bad REDIS_URL {redact(url)}: {e}") from None
        mode = str(info.get("cluster_enabled", "0")) == "1"
        _MODES[url] = mode
        if mode:
            log.info("Redis at %s is a Redis Cluster: using the cluster clients", redact(url))
        return mode
    return len(nodes) > 1


def is_cluster(r: Any) -> bool:
    """Whether client ``r`` (sync or asyncio) is one of redis-py's cluster clients."""
    return isinstance(r, scluster.RedisCluster | acluster.RedisCluster)


def _cluster_options(settings: Settings) -> dict[str, Any]:
    """Keyword arguments of a cluster client: the URL's credentials and TLS options, the seeds
    as startup nodes, our connection options (each node's connections retry nothing: the cluster
    client retries, refreshing its slot map, under its own ``retry``)."""
    url = settings.redis_url
    try:
        kw = redis.connection.parse_url(seed_url(url))
    except ValueError as e:
        raise ConfigError(f"bad REDIS_URL {redact(url)}: {e}") from None
    if kw.pop("db", 0):
        raise ConfigError(
            f"REDIS_URL {redact(url)} names database {settings.redis_url.rsplit('/', 1)[-1]} but "
            "it is a Redis Cluster, which has database 0 only (end the URL with /0)"
        )
    if kw.pop("connection_class", None) is not None:  # rediss://: an SSL connection
        kw["ssl"] = True
    kw.pop("host", None)
    kw.pop("port", None)
    options = _options(settings)
    options.pop("retry_on_error")
    options.pop("health_check_interval")
    return {**options, **kw}


def async_client(settings: Settings) -> aredis.Redis:
    """An asyncio client (hiredis parser and command packing) with retries: a cluster client
    when REDIS_URL names a Redis Cluster (`cluster_mode`)."""
    check_url(settings.redis_url)
    retry = _AsyncRetry(ExponentialBackoff(cap=2.0, base=0.05), 8, supported_errors=_RETRIED)
    if cluster_mode(settings.redis_url):
        nodes = [acluster.ClusterNode(h, p) for h, p in seeds(settings.redis_url)]
        try:
            cluster = acluster.RedisCluster(
                startup_nodes=nodes, retry=retry, **_cluster_options(settings)
            )
        except (TypeError, RedisClusterException) as e:
            raise ConfigError(f"bad REDIS_URL {redact(settings.redis_url)}: {e}") from None
        return aio_connections.install_cluster(cluster)
    try:
        client = aredis.Redis.from_url(_plain_url(settings), retry=retry, **_options(settings))
    except ValueError as e:
        raise ConfigError(f"bad REDIS_URL {redact(settings.redis_url)}: {e}") from None
    packing.install(client)  # commands packed by hiredis, as the blocking client does
    return aio_connections.install(client)  # forced closes abort; a torn write is a lost connection


def sync_client(settings: Settings) -> redis.Redis:
    """A blocking client with retries, for the CLI, waiters and RQ jobs: a cluster client when
    REDIS_URL names a Redis Cluster (`cluster_mode`)."""
    check_url(settings.redis_url)
    retry = _Retry(ExponentialBackoff(cap=2.0, base=0.05), 8, supported_errors=_RETRIED)
    if cluster_mode(settings.redis_url):
        nodes = [scluster.ClusterNode(h, p) for h, p in seeds(settings.redis_url)]
        try:
            return scluster.RedisCluster(
                startup_nodes=nodes, retry=retry, **_cluster_options(settings)
            )
        except (TypeError, RedisClusterException) as e:
            raise ConfigError(f"bad REDIS_URL {redact(settings.redis_url)}: {e}") from None
    try:
        return redis.Redis.from_url(_plain_url(settings), retry=retry, **_options(settings))
    except ValueError as e:
        raise ConfigError(f"bad REDIS_URL {redact(settings.redis_url)}: {e}") from None


def _plain_url(settings: Settings) -> str:
    """REDIS_URL for a client of one server: a URL of several seeds whose first answering one is
    not a cluster node is a ConfigError saying so (redis-py read the seed list as a port)."""
    url = settings.redis_url
    if len(seeds(url)) > 1:
        raise ConfigError(
            f"REDIS_URL {redact(url)} names {len(seeds(url))} seeds, but the Redis there is not a "
            "Redis Cluster (INFO cluster: cluster_enabled:0): give one host:port"
        )
    return url


@cache
def lua(name: str) -> str:
    """The text of a Lua script shipped in prefixq/store/lua/."""
    return (importlib.resources.files("prefixq") / "store" / "lua" / f"{name}.lua").read_text()
