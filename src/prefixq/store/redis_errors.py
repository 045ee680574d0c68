"""What a redis-py error means, and how prefixq says it.

`transient` errors (`TRANSIENT`: a lost connection, a cluster failing over) are worth retrying;
`refused` ones (credentials, an ACL, an untrusted server certificate) are not, and the clients of
`prefixq.store.connection` fail on them at once. `describe` / `adescribe` turn a redis-py error
into ours (`ConfigError`, `RedisUnavailable`, `RedisOutOfMemory`) with a hint, and `error_text`
is one printable line of it, without the command arguments and with the reply code redis-py drops.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
from typing import Any

import redis
import redis.asyncio as aredis
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

from prefixq.core.errors import ConfigError, RedisOutOfMemory, RedisUnavailable
from prefixq.core.settings import Settings
from prefixq.store.redis_url import redact

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


def refused(err: BaseException) -> bool:
    """True for errors that retrying cannot fix: wrong or missing credentials, an ACL that denies
    a command or key, a server certificate that does not verify, a database the server lacks."""
    if isinstance(err, AuthenticationError | NoPermissionError):
        return True
    if isinstance(err, ResponseError) and str(err).startswith(("NOPERM", "WRONGPASS", "NOAUTH")):
        return True
    if isinstance(err, RedisConnectionError) and "CERTIFICATE_VERIFY_FAILED" in str(err):
        return True
    return no_such_db(err)


def no_such_db(err: BaseException) -> bool:
    """REDIS_URL names a database the server does not have (its ``databases`` setting)."""
    return isinstance(err, ResponseError) and "DB index is out of range" in str(err)


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
    if no_such_db(err):
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
