"""Wait for, stream and collect a burst's results: blocking (`wait`, `iterate`, `collect`,
`status`: CLI, RQ jobs, scripts) and on an event loop (`await_`, `aiterate`, `acollect`,
`astatus`). A `Burst` handle (client/burst.py) calls these with its own settings and clients;
they take a burst id for code that only has the id as a string.

Results live in one hash per burst (input index -> encoded `Result`); every recorded result also
adds an entry to the burst's events stream, which waiters block on (XREAD) instead of polling.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import redis
import redis.asyncio as aredis
from redis.exceptions import RedisError

from prefixq.core import wire
from prefixq.core.errors import (
    BurstNotFound,
    BurstRecordLost,
    BurstTimeout,
    ValidationError,
    WireError,
)
from prefixq.core.records import Result
from prefixq.core.settings import Settings
from prefixq.store.connection import adescribe, async_client, describe, sync_client

__all__ = [
    "BurstStatus",
    "acollect",
    "aiterate",
    "astatus",
    "await_",
    "collect",
    "iterate",
    "read_stored",
    "status",
    "unrecorded_ids",
    "wait",
    "write_jsonl",
    "write_lines",
]

_FETCH = 512


def out_path_problem(path: str | os.PathLike[str]) -> str | None:
    """Why a burst's results could not be written to ``path`` (checked before the burst is
    submitted, not after it ran), as a phrase whose subject is the path; None when they can."""
    if os.path.isdir(path):
        return "is a folder, not a file path"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"is in a folder that does not exist ({folder!r})"
    return None


def read_stored(raw: bytes, index: int, rid: str, limits: wire.Limits) -> Result:
    """A recorded result; one that does not decode (a value written over in Redis) becomes a
    failed result that says so, with code ``internal_error``: one unreadable value costs its own
    line, never the burst's other results."""
    try:
        return Result.from_wire(wire.decode(raw, limits))
    except (WireError, KeyError, TypeError, ValueError, IndexError) as e:
        return Result(
            id=rid,
            index=index,
            error=f"its recorded result does not decode: {e}",
            error_code="internal_error",
        )


@dataclass(slots=True)
class BurstStatus:
    """A burst's record and progress."""

    burst: str
    total: int
    done: int
    failed: int
    status: str
    created: float
    finished_at: float
    meta: dict[str, str]

    @property
    def finished(self) -> bool:
        return self.total > 0 and self.done + self.failed >= self.total

    @classmethod
    def from_hash(cls, burst: str, h: dict[bytes, bytes]) -> BurstStatus:
        """The status in a burst record; BurstRecordLost if the record has no valid ``total``
        (a partial record: what is left of one that expired or was evicted)."""
        m = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in h.items()}
        try:
            total = int(m["total"])
            if total <= 0:
                raise ValueError(total)
            return cls(
                burst=burst,
                total=total,
                done=int(m.get("done", 0)),
                failed=int(m.get("failed", 0)),
                status=m.get("status", "?"),
                created=float(m.get("created", 0)),
                finished_at=float(m.get("finished_at", 0)),
                meta=m,
            )
        except (KeyError, ValueError):
            raise BurstRecordLost(
                f"burst {burst!r}: its record is incomplete (fields: {', '.join(sorted(m))}): it "
                "expired or was evicted, and was partly written again; its results cannot be "
                "read as complete or finished. Submit the burst again"
            ) from None


class _Session:
    """One client and key set for the calls below."""

    def __init__(self, burst: str, settings: Settings | None, client: redis.Redis | None) -> None:
        self.settings = settings or Settings.from_env()
        self.r = client or sync_client(self.settings)
        self.keys = self.settings.keys
        self.burst = burst
        self.limits = wire.Limits.from_settings(self.settings)

    def status(self) -> BurstStatus:
        with self.redis_errors():
            h = self.r.hgetall(self.keys.burst(self.burst))
        return _status(self.burst, self.settings, h)

    def block(self, last: str, ms: int) -> str:
        """Wait until a result is recorded after event ``last`` (or ``ms`` pass)."""
        with self.redis_errors():
            resp = self.r.xread({self.keys.events(self.burst): last}, count=1000, block=ms)
        if resp:
            return str(resp[0][1][-1][0].decode())
        return last

    def fetch(self, indexes: range) -> list[Result | None]:
        with self.redis_errors():
            raw = self.r.hmget(self.keys.results(self.burst), list(indexes))
        out = _decoded(indexes, raw, self.limits)
        for res in _unreadable(out):
            with self.redis_errors():  # the unreadable result's request id, if still kept
                rid = self.r.lindex(self.keys.ids(self.burst), res.index)
            res.id = (rid or b"").decode("utf-8", "replace")
        return out

    @contextlib.contextmanager
    def redis_errors(self) -> Iterator[None]:
        """Redis errors as ours: unreachable, refused (ConfigError), out of memory."""
        try:
            yield
        except (RedisError, OSError) as e:
            raise describe(self.settings, e) from e


def _status(burst: str, settings: Settings, h: dict[bytes, bytes]) -> BurstStatus:
    if not h:
        raise BurstNotFound(
            f"no burst {burst!r} in namespace {settings.namespace!r}: it was never "
            "submitted, or its record expired (result_ttl_s) or was evicted"
        )
    return BurstStatus.from_hash(burst, h)


def _decoded(indexes: range, raw: list[bytes | None], limits: wire.Limits) -> list[Result | None]:
    return [
        None if v is None else read_stored(v, i, "", limits)
        for i, v in zip(indexes, raw, strict=True)
    ]


def _unreadable(results: list[Result | None]) -> list[Result]:
    """Results stored unreadably (read as internal_error without their request id)."""
    return [r for r in results if r is not None and r.error_code == "internal_error" and not r.id]


class _AsyncSession:
    """`_Session` on an event loop: the caller's client, or one of its own for the call."""

    def __init__(self, burst: str, settings: Settings | None, client: aredis.Redis | None) -> None:
        self.settings = settings or Settings.from_env()
        self.own = client is None
        self.r = client if client is not None else async_client(self.settings)
        self.keys = self.settings.keys
        self.burst = burst
        self.limits = wire.Limits.from_settings(self.settings)

    async def close(self) -> None:
        if self.own:
            await self.r.aclose()

    async def status(self) -> BurstStatus:
        h = await self._call(self.r.hgetall(self.keys.burst(self.burst)))
        return _status(self.burst, self.settings, h)

    async def block(self, last: str, ms: int) -> str:
        events = {self.keys.events(self.burst): last}
        resp = await self._call(self.r.xread(events, count=1000, block=ms))
        return str(resp[0][1][-1][0].decode()) if resp else last

    async def fetch(self, indexes: range) -> list[Result | None]:
        raw = await self._call(self.r.hmget(self.keys.results(self.burst), list(indexes)))
        out = _decoded(indexes, raw, self.limits)
        for res in _unreadable(out):
            rid = await self._call(self.r.lindex(self.keys.ids(self.burst), res.index))
            res.id = (rid or b"").decode("utf-8", "replace")
        return out

    async def _call(self, aw: Any) -> Any:
        """Await a Redis call; its errors as ours (see `_Session.redis_errors`)."""
        try:
            return await aw
        except (RedisError, OSError) as e:
            raise await adescribe(self.settings, e, self.r) from e


def status(
    burst: str, settings: Settings | None = None, *, client: redis.Redis | None = None
) -> BurstStatus:
    """The burst's record and counters right now."""
    return _Session(burst, settings, client).status()


def unrecorded_ids(
    burst: str, settings: Settings | None = None, *, client: redis.Redis | None = None
) -> int:
    """How many of the burst's requests have no recorded id (0 for every burst a producer of
    this version wrote: it writes the ids with the record). Their results, if a cancel or an
    expiry made them, carry no id (null in the result lines) rather than one made up."""
    ses = _Session(burst, settings, client)
    total = ses.status().total
    with ses.redis_errors():
        return max(0, total - int(ses.r.llen(ses.keys.ids(burst))))


def _deadline(timeout: float | None) -> float | None:
    """The monotonic time ``timeout`` s from now; None (no limit) for None or infinity."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or math.isnan(timeout):
        raise ValidationError(f"timeout must be a number of seconds or None, not {timeout!r}")
    if timeout == math.inf:
        return None
    return time.monotonic() + timeout


def _wait_ms(deadline: float | None) -> int:
    """How long one blocking read may wait: a second, or what is left before ``deadline``
    (monotonic, None: no limit); 0 once it has passed."""
    if deadline is None:
        return 1000
    left = deadline - time.monotonic()
    return 0 if left <= 0 else max(1, min(1000, int(left * 1000)))


def wait(
    burst: str,
    settings: Settings | None = None,
    *,
    timeout: float | None = None,
    progress: Callable[[BurstStatus], None] | None = None,
    client: redis.Redis | None = None,
) -> BurstStatus:
    """Block until every request of the burst has a result; BurstTimeout past ``timeout`` s."""
    ses = _Session(burst, settings, client)
    deadline = _deadline(timeout)
    last = "0-0"
    while True:
        st = ses.status()
        if progress:
            progress(st)
        if st.finished:
            return st
        ms = _wait_ms(deadline)
        if not ms:
            raise BurstTimeout(
                f"burst {burst}: {st.done + st.failed}/{st.total} results after {timeout:.0f}s"
            )
        last = ses.block(last, ms)


def iterate(
    burst: str,
    settings: Settings | None = None,
    *,
    timeout: float | None = None,
    client: redis.Redis | None = None,
) -> Iterator[Result]:
    """Yield results in input order, each as soon as it and all before it are recorded."""
    ses = _Session(burst, settings, client)
    total = ses.status().total
    deadline = _deadline(timeout)
    nxt, last = 0, "0-0"
    while nxt < total:
        got = ses.fetch(range(nxt, min(total, nxt + _FETCH)))
        for res in got:
            if res is None:
                break
            yield res
            nxt += 1
        else:
            continue
        ms = _wait_ms(deadline)
        if not ms:
            raise BurstTimeout(f"burst {burst}: {nxt}/{total} results in order after {timeout}s")
        last = ses.block(last, ms)


def collect(
    burst: str, settings: Settings | None = None, *, client: redis.Redis | None = None
) -> list[Result]:
    """Every recorded result, in input order (missing ones are skipped)."""
    ses = _Session(burst, settings, client)
    total = ses.status().total
    out: list[Result] = []
    for start in range(0, total, _FETCH):
        out.extend(r for r in ses.fetch(range(start, min(total, start + _FETCH))) if r)
    return out


async def astatus(
    burst: str, settings: Settings | None = None, *, client: aredis.Redis | None = None
) -> BurstStatus:
    """`status` on an event loop."""
    ses = _AsyncSession(burst, settings, client)
    try:
        return await ses.status()
    finally:
        await ses.close()


async def await_(
    burst: str,
    settings: Settings | None = None,
    *,
    timeout: float | None = None,  # noqa: ASYNC109 -- BurstTimeout says how far it got, as the sync twin
    progress: Callable[[BurstStatus], None] | None = None,
    client: aredis.Redis | None = None,
) -> BurstStatus:
    """`wait` on an event loop (``await`` is Python's, so the a-prefixed name takes PEP 8's
    trailing underscore)."""
    ses = _AsyncSession(burst, settings, client)
    deadline = _deadline(timeout)
    last = "0-0"
    try:
        while True:
            st = await ses.status()
            if progress:
                progress(st)
            if st.finished:
                return st
            ms = _wait_ms(deadline)
            if not ms:
                raise BurstTimeout(
                    f"burst {burst}: {st.done + st.failed}/{st.total} results after {timeout:.0f}s"
                )
            last = await ses.block(last, ms)
    finally:
        await ses.close()


async def aiterate(
    burst: str,
    settings: Settings | None = None,
    *,
    timeout: float | None = None,  # noqa: ASYNC109 -- BurstTimeout says how far it got, as the sync twin
    client: aredis.Redis | None = None,
) -> AsyncIterator[Result]:
    """`iterate` on an event loop: ``async for result in aiterate(...)``."""
    ses = _AsyncSession(burst, settings, client)
    try:
        total = (await ses.status()).total
        deadline = _deadline(timeout)
        nxt, last = 0, "0-0"
        while nxt < total:
            got = await ses.fetch(range(nxt, min(total, nxt + _FETCH)))
            for res in got:
                if res is None:
                    break
                yield res
                nxt += 1
            else:
                continue
            ms = _wait_ms(deadline)
            if not ms:
                raise BurstTimeout(
                    f"burst {burst}: {nxt}/{total} results in order after {timeout}s"
                )
            last = await ses.block(last, ms)
    finally:
        await ses.close()


async def acollect(
    burst: str, settings: Settings | None = None, *, client: aredis.Redis | None = None
) -> list[Result]:
    """`collect` on an event loop."""
    ses = _AsyncSession(burst, settings, client)
    try:
        total = (await ses.status()).total
        out: list[Result] = []
        for start in range(0, total, _FETCH):
            got = await ses.fetch(range(start, min(total, start + _FETCH)))
            out.extend(r for r in got if r)
        return out
    finally:
        await ses.close()


def write_jsonl(
    burst: str,
    out: str | Path | IO[str],
    settings: Settings | None = None,
    *,
    timeout: float | None = None,
    token_ids: bool = False,
    client: redis.Redis | None = None,
) -> int:
    """Write the burst's results as JSON lines in input order (waiting for them); returns count."""

    def line(res: Result) -> str:
        return json.dumps(res.to_json(token_ids=token_ids), ensure_ascii=False) + "\n"

    return write_lines(burst, out, line, settings, timeout=timeout, client=client)


def write_lines(
    burst: str,
    out: str | Path | IO[str],
    line: Callable[[Result], str],
    settings: Settings | None = None,
    *,
    timeout: float | None = None,
    client: redis.Redis | None = None,
) -> int:
    """Write ``line(result)`` for each of the burst's results in input order (waiting for them)
    to a file path or an open text stream; returns how many (`write_jsonl`, the OpenAI format)."""

    def dump(f: IO[str]) -> int:
        n = 0
        for res in iterate(burst, settings, timeout=timeout, client=client):
            f.write(line(res))
            n += 1
        return n

    if isinstance(out, str | Path):
        with open(out, "w", encoding="utf-8") as f:
            return dump(f)
    return dump(out)
