"""Redis clients built from `Settings`: asyncio for the data plane, sync for tools and waiters.

Both retry transient connection errors with exponential backoff; refused credentials or
permissions and an untrusted server certificate are not retried (`refused`): retrying cannot fix
them. TLS (``rediss://``) and ACL credentials come from the URL
(``rediss://user:password@host:port/db?ssl_ca_certs=/path/ca.crt``); redis-py reads the ``ssl_*``
options from the query string, and an unknown option or a missing certificate file is a
`ConfigError` at once.

Redis Cluster is detected, not configured: the first time a process uses a URL, `cluster_mode`
asks the first reachable node it names for ``INFO cluster``; ``cluster_enabled:1`` gives
redis-py's cluster clients (``redis.cluster.RedisCluster``, ``redis.asyncio.cluster.RedisCluster``)
with the URL's credentials and TLS options, anything else the plain clients. The answer is kept
per URL, and every client prefixq makes comes from `sync_client` / `async_client`, so one place
decides. A URL may list several seed nodes, for when one is down:
``redis://user:pw@h1:7000,h2:7001,h3:7002/0`` (database 0 only: a cluster has no other).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import importlib.resources
import logging
import os
import re
from functools import cache
from typing import Any
from urllib.parse import parse_qs, urlsplit

import redis
import redis.asyncio as aredis
import redis.asyncio.cluster as acluster
import redis.cluster as scluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.connection import URL_QUERY_ARGUMENT_PARSERS
from redis.exceptions import (
    AskError,
    AuthenticationError,
    BusyLoadingError,
    ClusterDownError,
    ClusterError,
    MasterDownError,
    MovedError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from prefixq.core.errors import ConfigError, RedisOutOfMemory, RedisUnavailable
from prefixq.core.settings import Settings
from prefixq.store import aio_connections, packing

#: errors that mean "try again later", never "this request is bad" (but see `refused`: redis-py's
#: AuthenticationError is a ConnectionError too). The cluster ones are what a failover looks like
#: while a replica is promoted: CLUSTERDOWN, TRYAGAIN, MASTERDOWN, a MOVED/ASK redis-py gave up
#: following, a slot no node covers for a moment, "TTL exhausted" (redirections ran out), no seed
#: node reachable (RedisClusterException)
TRANSIENT = (
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
    ClusterDownError,
    TryAgainError,
    MasterDownError,
    MovedError,
    AskError,
    SlotNotCoveredError,
    ClusterError,
    RedisClusterException,
)
#: reply prefixes of the same errors when they arrive as a plain ResponseError (inside a script's
#: or a pipeline's reply)
_TRANSIENT_REPLIES = ("CLUSTERDOWN", "TRYAGAIN", "MASTERDOWN", "MOVED", "ASK ", "LOADING")


def transient(err: BaseException) -> bool:
    """True for an error that retrying later can fix (`TRANSIENT`, a reply saying the cluster is
    failing over, or `inside_redis_py`), never for a `refused` one."""
    if refused(err):
        return False
    if isinstance(err, TRANSIENT) or inside_redis_py(err):
        return True
    return isinstance(err, ResponseError) and str(err).startswith(_TRANSIENT_REPLIES)


def inside_redis_py(err: BaseException) -> bool:
    """True for an AttributeError or TypeError raised inside redis-py itself rather than by
    prefixq: what a connection torn down under a command looks like when a cluster client
    refreshes its slot map during a failover (it closes every node's connections, and another
    task's command then writes to a closed stream). Retrying on a fresh connection fixes it."""
    if not isinstance(err, AttributeError | TypeError):
        return False
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    path = tb.tb_frame.f_code.co_filename.replace(os.sep, "/")
    return "/site-packages/redis/" in path or "/redis/asyncio/" in path


log = logging.getLogger(__name__)


def raise_if_cancelled() -> None:
    """Raise CancelledError if the current task was asked to stop. redis-py's asyncio client can
    swallow a cancel that arrives while it opens a connection (the command then returns as if
    nothing happened), so a loop that runs until cancelled calls this after its Redis calls."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


#: query options a REDIS_URL may carry besides redis-py's typed ones (all ``ssl_*`` need rediss://)
_SSL_OPTIONS = frozenset(
    {
        "ssl_ca_certs",
        "ssl_ca_path",
        "ssl_ca_data",
        "ssl_cert_reqs",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_password",
        "ssl_ciphers",
        "ssl_check_hostname",
        "ssl_min_version",
        "ssl_include_verify_flags",
        "ssl_exclude_verify_flags",
    }
)
_FILE_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


def refused(err: BaseException) -> bool:
    """True for errors that retrying cannot fix: wrong or missing credentials, an ACL that denies
    a command or key, a server certificate that does not verify."""
    if isinstance(err, AuthenticationError | NoPermissionError):
        return True
    if isinstance(err, ResponseError) and str(err).startswith(("NOPERM", "WRONGPASS", "NOAUTH")):
        return True
    return isinstance(err, RedisConnectionError) and "CERTIFICATE_VERIFY_FAILED" in str(err)


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


def seeds(url: str) -> list[tuple[str, int]]:
    """The (host, port) seed nodes a REDIS_URL names: one, or several separated by commas
    (``redis://user:pw@h1:7000,h2:7001/0``); [] for a unix socket."""
    scheme, _, rest = url.partition("://")
    if scheme == "unix":
        return []
    netloc = rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]
    hosts = netloc.rpartition("@")[2]
    out = []
    for one in hosts.split(","):
        parts = urlsplit(f"{scheme}://{one}")
        try:
            port = parts.port or 6379
        except ValueError:
            raise ConfigError(f"REDIS_URL seed {one!r} has a bad port") from None
        if not parts.hostname:
            raise ConfigError(f"REDIS_URL seed {one!r} names no host")
        out.append((parts.hostname, port))
    return out


def seed_url(url: str, index: int = 0) -> str:
    """``url`` naming only its ``index``-th seed node (credentials, database and options kept)."""
    if "," not in url:
        return url
    scheme, _, rest = url.partition("://")
    netloc, sep, tail = rest.partition("/")
    if not sep:
        netloc, sep, tail = rest.partition("?")
    cred, at, hosts = netloc.rpartition("@")
    host = hosts.split(",")[index]
    return f"{scheme}://{cred}{at}{host}{sep}{tail}"


def check_url(url: str) -> None:
    """ConfigError for a REDIS_URL option redis-py would reject late (at the first command) or
    a certificate file that does not exist."""
    multi = "," in url.partition("://")[2].split("/", 1)[0]
    if multi:
        seeds(url)  # each seed parses
        url = seed_url(url)
    parts = urlsplit(url)
    db = parts.path.strip("/")
    if parts.scheme in ("redis", "rediss") and db and not db.isdigit():
        # redis-py ignores a database it cannot read as a number: db 0, someone else's data
        raise ConfigError(f"REDIS_URL database {db!r} is not a number (redis://host:port/0)")
    if multi and db not in ("", "0"):
        raise ConfigError(
            f"REDIS_URL lists several seed nodes (a Redis Cluster) but names database {db}: a "
            "cluster has database 0 only (end the URL with /0)"
        )
    known = set(URL_QUERY_ARGUMENT_PARSERS) | _SSL_OPTIONS | {"client_name"}
    for name, values in parse_qs(parts.query).items():
        if name not in known:
            raise ConfigError(
                f"REDIS_URL option {name!r} is unknown (known: {', '.join(sorted(known))})"
            )
        if name.startswith("ssl_") and parts.scheme != "rediss":
            raise ConfigError(f"REDIS_URL option {name!r} needs a rediss:// (TLS) URL")
        if name in _FILE_OPTIONS and not os.path.isfile(values[-1]):
            raise ConfigError(f"REDIS_URL option {name}={values[-1]!r}: no such file")


def _options(settings: Settings) -> dict[str, Any]:
    options: dict[str, Any] = {
        "socket_connect_timeout": 5.0,
        "health_check_interval": 30,
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
        "client_name": f"prefixq-{settings.namespace}",
    }
    if urlsplit(settings.redis_url).scheme != "unix":  # TCP only: a unix socket has no keepalive
        options["socket_keepalive"] = True
    return options


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
    retry = _AsyncRetry(ExponentialBackoff(cap=2.0, base=0.05), 8)
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
        client = aredis.Redis.from_url(settings.redis_url, retry=retry, **_options(settings))
    except ValueError as e:
        raise ConfigError(f"bad REDIS_URL {settings.redis_url!r}: {e}") from None
    packing.install(client)  # commands packed by hiredis, as the blocking client does
    return aio_connections.install(client)  # forced closes abort; a torn write is a lost connection


def sync_client(settings: Settings) -> redis.Redis:
    """A blocking client with retries, for the CLI, waiters and RQ jobs: a cluster client when
    REDIS_URL names a Redis Cluster (`cluster_mode`)."""
    check_url(settings.redis_url)
    retry = _Retry(ExponentialBackoff(cap=2.0, base=0.05), 8)
    if cluster_mode(settings.redis_url):
        nodes = [scluster.ClusterNode(h, p) for h, p in seeds(settings.redis_url)]
        try:
            return scluster.RedisCluster(
                startup_nodes=nodes, retry=retry, **_cluster_options(settings)
            )
        except (TypeError, RedisClusterException) as e:
            raise ConfigError(f"bad REDIS_URL {redact(settings.redis_url)}: {e}") from None
    try:
        return redis.Redis.from_url(settings.redis_url, retry=retry, **_options(settings))
    except ValueError as e:
        raise ConfigError(f"bad REDIS_URL {settings.redis_url!r}: {e}") from None


def describe(
    settings: Settings, err: BaseException, client: redis.Redis | None = None
) -> PrefixqErrorLike:
    """Turn a redis-py error into our error with a hint, hiding the password and any command
    arguments. For an OOM refusal, ``client`` (when given) adds Redis's memory figures."""
    return _describe(settings, err, memory_figures(client) if client and is_oom(err) else None)


async def adescribe(
    settings: Settings, err: BaseException, client: aredis.Redis | None = None
) -> PrefixqErrorLike:
    """`describe` with an asyncio client for the memory figures."""
    figures = await amemory_figures(client) if client and is_oom(err) else None
    return _describe(settings, err, figures)


def _describe(settings: Settings, err: BaseException, figures: str | None) -> PrefixqErrorLike:
    url = redact(settings.redis_url)
    text = error_text(err)
    if isinstance(err, RedisConnectionError) and "CERTIFICATE_VERIFY_FAILED" in str(err):
        return ConfigError(
            f"the TLS certificate of Redis at {url} does not verify: {text} (give the CA that "
            "signed it as ?ssl_ca_certs=/path/ca.crt in REDIS_URL)"
        )
    if "DB index is out of range" in text:
        return ConfigError(
            f"REDIS_URL {url}: Redis has no such database ({text}; see its `databases` setting)"
        )
    if refused(err):
        return ConfigError(
            f"Redis at {url} refused the credentials or command: {text} (check the user and "
            f"password in REDIS_URL, and that the user's ACL allows the keys "
            f"{settings.namespace}:* and the commands docs/delivery.md lists)"
        )
    if is_oom(err):
        state = f" ({figures})" if figures else ""
        return RedisOutOfMemory(
            f"Redis at {url} is out of memory{state}: {text} (raise maxmemory, or let the "
            "workers drain the queues and try again; under the noeviction policy prefixq needs, "
            "Redis refuses writes instead of dropping data)"
        )
    if isinstance(err, TRANSIENT):
        return RedisUnavailable(f"cannot reach Redis at {url}: {text} (is redis-server running?)")
    return RedisUnavailable(f"Redis at {url} answered with an error: {text}")


PrefixqErrorLike = ConfigError | RedisUnavailable


def is_oom(err: BaseException) -> bool:
    """True when Redis refused a command because used memory reached ``maxmemory``."""
    return isinstance(err, OutOfMemoryError) or (
        isinstance(err, ResponseError) and str(err).startswith("OOM")
    )


def _figures(info: dict[str, Any]) -> str:
    return (
        f"used {info.get('used_memory_human', '?')} of maxmemory "
        f"{info.get('maxmemory_human', '?')}, policy {info.get('maxmemory_policy', '?')}"
    )


def memory_figures(client: redis.Redis) -> str | None:
    """ "used X of maxmemory Y, policy P" from ``INFO memory``; None if that fails too."""
    try:
        return _figures(client.info("memory"))
    except (RedisError, OSError):
        return None


async def amemory_figures(client: aredis.Redis) -> str | None:
    """`memory_figures` with an asyncio client."""
    try:
        return _figures(await client.info("memory"))
    except (RedisError, OSError):
        return None


#: redis-py's pipeline errors: "Command # N (COMMAND ARGS...) of pipeline caused error: MESSAGE",
#: with the arguments (binary, compressed payloads) in the middle
_PIPELINE_MARK = " of pipeline caused error: "
_PIPELINE_HEAD = re.compile(r"Command # (\d+) \((\S*)")
#: the reply codes redis-py drops from the message when it maps a reply to an exception class
_CODES: tuple[tuple[type[BaseException], str], ...] = (
    (OutOfMemoryError, "OOM"),
    (NoPermissionError, "NOPERM"),
    (NoScriptError, "NOSCRIPT"),
    (ReadOnlyError, "READONLY"),
    (BusyLoadingError, "LOADING"),
)
#: longest `error_text`
_MAX_TEXT = 300


def error_text(err: BaseException) -> str:
    """One printable line for a log message or an error: a redis-py error without the command
    arguments that pipeline errors embed (binary, compressed payloads), with the reply code
    (OOM, NOPERM, ...) that redis-py drops, at most 300 characters."""
    text, where = str(err), ""
    if _PIPELINE_MARK in text:
        head, _, text = text.rpartition(_PIPELINE_MARK)
        m = _PIPELINE_HEAD.match(head)
        if m:
            where = f" (pipeline command {m.group(1)}, {m.group(2)[:32]})"
        if text.startswith("(") and text.endswith(")"):  # the asyncio client's args tuple
            with contextlib.suppress(ValueError, SyntaxError, MemoryError, RecursionError):
                args = ast.literal_eval(text)
                if isinstance(args, tuple) and args and isinstance(args[0], str):
                    text = args[0]
    for kind, code in _CODES:
        if isinstance(err, kind) and not text.startswith(code):
            text = f"{code} {text}"
            break
    text = " ".join(text.split())
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text) + where
    return text if len(text) <= _MAX_TEXT else text[: _MAX_TEXT - 3] + "..."


#: query options of a REDIS_URL whose value is a secret (the TLS key file's password)
_SECRET_OPTION = re.compile(r"([?&](?:ssl_)?password=)[^&#]*", re.IGNORECASE)


def redact(url: str) -> str:
    """The URL with any password (its own, or ``ssl_password=``) replaced by ***."""
    url = _SECRET_OPTION.sub(r"\1***", url)
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    cred, _, host = rest.rpartition("@")
    user = cred.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in cred else f"{scheme}://{user}@{host}"


@cache
def lua(name: str) -> str:
    """The text of a Lua script shipped in prefixq/store/lua/."""
    return (importlib.resources.files("prefixq") / "store" / "lua" / f"{name}.lua").read_text()
