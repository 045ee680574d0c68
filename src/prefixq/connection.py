"""Redis clients built from `Settings`: asyncio for the data plane, sync for tools and waiters.

Both retry transient connection errors with exponential backoff; refused credentials or
permissions and an untrusted server certificate are not retried (`refused`): retrying cannot fix
them. TLS (``rediss://``) and ACL credentials come from the URL
(``rediss://user:password@host:port/db?ssl_ca_certs=/path/ca.crt``); redis-py reads the ``ssl_*``
options from the query string, and an unknown option or a missing certificate file is a
`ConfigError` at once.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import logging
import os
from functools import cache
from typing import Any
from urllib.parse import parse_qs, urlsplit

import redis
import redis.asyncio as aredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.connection import URL_QUERY_ARGUMENT_PARSERS
from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from prefixq.errors import ConfigError, RedisUnavailable
from prefixq.settings import Settings

#: errors that mean "try again later", never "this request is bad" (but see `refused`: redis-py's
#: AuthenticationError is a ConnectionError too)
TRANSIENT = (RedisConnectionError, RedisTimeoutError, OSError)

log = logging.getLogger(__name__)


class Backoff:
    """The waits between retries of one Redis operation in a worker loop: ``first`` seconds,
    doubling up to ``cap``; `reset()` after a success."""

    def __init__(self, first: float = 0.1, cap: float = 5.0) -> None:
        self.first, self.cap, self.delay = first, cap, first

    async def wait(self, what: str, err: BaseException, level: int = logging.WARNING) -> None:
        """Log that ``what`` failed with ``err``, sleep the current delay, double it."""
        log.log(level, "%s failed (%s); retrying in %.2fs", what, err, self.delay)
        await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, self.cap)

    def reset(self) -> None:
        self.delay = self.first


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


def check_url(url: str) -> None:
    """ConfigError for a REDIS_URL option redis-py would reject late (at the first command) or
    a certificate file that does not exist."""
    parts = urlsplit(url)
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
    return {
        "socket_connect_timeout": 5.0,
        "socket_keepalive": True,
        "health_check_interval": 30,
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
        "client_name": f"prefixq-{settings.namespace}",
    }


def async_client(settings: Settings) -> aredis.Redis:
    """An asyncio client (hiredis parser when installed) with retries."""
    check_url(settings.redis_url)
    try:
        return aredis.Redis.from_url(
            settings.redis_url,
            retry=_AsyncRetry(ExponentialBackoff(cap=2.0, base=0.05), 8),
            **_options(settings),
        )
    except ValueError as e:
        raise ConfigError(f"bad REDIS_URL {settings.redis_url!r}: {e}") from None


def sync_client(settings: Settings) -> redis.Redis:
    """A blocking client with retries, for the CLI, waiters and RQ jobs."""
    check_url(settings.redis_url)
    try:
        return redis.Redis.from_url(
            settings.redis_url,
            retry=_Retry(ExponentialBackoff(cap=2.0, base=0.05), 8),
            **_options(settings),
        )
    except ValueError as e:
        raise ConfigError(f"bad REDIS_URL {settings.redis_url!r}: {e}") from None


def describe(settings: Settings, err: BaseException) -> PrefixqErrorLike:
    """Turn a redis-py error into our error with a hint, hiding the password."""
    url = redact(settings.redis_url)
    if isinstance(err, RedisConnectionError) and "CERTIFICATE_VERIFY_FAILED" in str(err):
        return ConfigError(
            f"the TLS certificate of Redis at {url} does not verify: {err} (give the CA that "
            "signed it as ?ssl_ca_certs=/path/ca.crt in REDIS_URL)"
        )
    if refused(err):
        return ConfigError(
            f"Redis at {url} refused the credentials or command: {err} (check the user and "
            f"password in REDIS_URL, and that the user's ACL allows the keys "
            f"{settings.namespace}:* and the stream, hash and script commands)"
        )
    return RedisUnavailable(f"cannot reach Redis at {url}: {err} (is redis-server running?)")


PrefixqErrorLike = ConfigError | RedisUnavailable


def redact(url: str) -> str:
    """The URL with any password replaced by ***."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    cred, _, host = rest.rpartition("@")
    user = cred.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}" if ":" in cred else f"{scheme}://{user}@{host}"


@cache
def lua(name: str) -> str:
    """The text of a Lua script shipped in prefixq/lua/."""
    return (importlib.resources.files("prefixq") / "lua" / f"{name}.lua").read_text()
