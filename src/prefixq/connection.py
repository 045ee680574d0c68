"""Redis clients built from `Settings`: asyncio for the data plane, sync for tools and waiters.

Both retry transient connection errors with exponential backoff; TLS (``rediss://``) and ACL
credentials come from the URL (``rediss://user:password@host:port/db``).
"""

from __future__ import annotations

import importlib.resources
from functools import cache
from typing import Any

import redis
import redis.asyncio as aredis
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from prefixq.errors import ConfigError, RedisUnavailable
from prefixq.settings import Settings

#: errors that mean "try again later", never "this request is bad"
TRANSIENT = (RedisConnectionError, RedisTimeoutError, OSError)


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
    from redis.asyncio.retry import Retry as AsyncRetry

    try:
        return aredis.Redis.from_url(
            settings.redis_url,
            retry=AsyncRetry(ExponentialBackoff(cap=2.0, base=0.05), 8),
            **_options(settings),
        )
    except ValueError as e:
        raise ConfigError(f"bad REDIS_URL {settings.redis_url!r}: {e}") from None


def sync_client(settings: Settings) -> redis.Redis:
    """A blocking client with retries, for the CLI, waiters and RQ jobs."""
    from redis.retry import Retry

    try:
        return redis.Redis.from_url(
            settings.redis_url,
            retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), 8),
            **_options(settings),
        )
    except ValueError as e:
        raise ConfigError(f"bad REDIS_URL {settings.redis_url!r}: {e}") from None


def describe(settings: Settings, err: BaseException) -> PrefixqErrorLike:
    """Turn a redis-py error into our error with a hint, hiding the password."""
    url = redact(settings.redis_url)
    if isinstance(err, AuthenticationError) or (
        isinstance(err, ResponseError) and "NOPERM" in str(err)
    ):
        return ConfigError(f"Redis at {url} refused the credentials or command: {err}")
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
