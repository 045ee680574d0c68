"""Wait for, stream and collect a burst's results: blocking (`wait`, `iterate`, `collect`,
`status`: CLI, RQ jobs, scripts) and on an event loop (`await_`, `aiterate`, `acollect`,
`astatus`). A `Burst` handle (client/burst.py) calls these with its own settings and clients;
they take a burst id for code that only has the id as a string. A blocking function and its
event-loop twin share what their loops decide (client/read_loops.py, no I/O); what Redis keeps is
decoded by client/stored.py.

Results live in one hash per burst (input index -> encoded `Result`); every recorded result also
adds an entry to the burst's events stream, which waiters block on (XREAD) instead of polling.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import IO, Any

import redis
import redis.asyncio as aredis
from redis.exceptions import RedisError

from prefixq.client.out_file import writing
from prefixq.client.read_loops import Waits, chunk, chunks, leading
from prefixq.client.stored import BurstStatus, decoded, read_stored, status_of, unreadable
from prefixq.core import wire
from prefixq.core.records import Result
from prefixq.core.settings import Settings
from prefixq.store.connection import async_client, sync_client
from prefixq.store.redis_errors import adescribe, describe

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
        return status_of(self.burst, self.settings, h)

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
        out = decoded(indexes, raw, self.limits)
        for res in unreadable(out):
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


class _AsyncSession:
    """`_Session` on an event loop: the caller's client, or one of its own for the call (closed
    when ``async with`` ends)."""

    def __init__(self, burst: str, settings: Settings | None, client: aredis.Redis | None) -> None:
        self.settings = settings or Settings.from_env()
        self.own = client is None
        self.r = client if client is not None else async_client(self.settings)
        self.keys = self.settings.keys
        self.burst = burst
        self.limits = wire.Limits.from_settings(self.settings)

    async def __aenter__(self) -> _AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.own:
            await self.r.aclose()

    async def status(self) -> BurstStatus:
        h = await self._call(self.r.hgetall(self.keys.burst(self.burst)))
        return status_of(self.burst, self.settings, h)

    async def block(self, last: str, ms: int) -> str:
        events = {self.keys.events(self.burst): last}
        resp = await self._call(self.r.xread(events, count=1000, block=ms))
        return str(resp[0][1][-1][0].decode()) if resp else last

    async def fetch(self, indexes: range) -> list[Result | None]:
        raw = await self._call(self.r.hmget(self.keys.results(self.burst), list(indexes)))
        out = decoded(indexes, raw, self.limits)
        for res in unreadable(out):
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
    waits = Waits(burst, timeout)
    while True:
        st = ses.status()
        ms = waits.until_finished(st, progress)
        if ms is None:
            return st
        waits.last = ses.block(waits.last, ms)


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
    waits = Waits(burst, timeout)
    nxt = 0
    while nxt < total:
        got = ses.fetch(chunk(nxt, total))
        ready = leading(got)
        yield from ready
        nxt += len(ready)
        if len(ready) < len(got):
            waits.last = ses.block(waits.last, waits.until_next(nxt, total))
            if waits.check_due():
                ses.status()  # BurstNotFound once Redis lost the record


def collect(
    burst: str, settings: Settings | None = None, *, client: redis.Redis | None = None
) -> list[Result]:
    """Every recorded result, in input order (missing ones are skipped)."""
    ses = _Session(burst, settings, client)
    total = ses.status().total
    return [r for indexes in chunks(total) for r in ses.fetch(indexes) if r]


async def astatus(
    burst: str, settings: Settings | None = None, *, client: aredis.Redis | None = None
) -> BurstStatus:
    """`status` on an event loop."""
    async with _AsyncSession(burst, settings, client) as ses:
        return await ses.status()


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
    async with _AsyncSession(burst, settings, client) as ses:
        waits = Waits(burst, timeout)
        while True:
            st = await ses.status()
            ms = waits.until_finished(st, progress)
            if ms is None:
                return st
            waits.last = await ses.block(waits.last, ms)


async def aiterate(
    burst: str,
    settings: Settings | None = None,
    *,
    timeout: float | None = None,  # noqa: ASYNC109 -- BurstTimeout says how far it got, as the sync twin
    client: aredis.Redis | None = None,
) -> AsyncIterator[Result]:
    """`iterate` on an event loop: ``async for result in aiterate(...)``."""
    async with _AsyncSession(burst, settings, client) as ses:
        total = (await ses.status()).total
        waits = Waits(burst, timeout)
        nxt = 0
        while nxt < total:
            got = await ses.fetch(chunk(nxt, total))
            ready = leading(got)
            for res in ready:
                yield res
            nxt += len(ready)
            if len(ready) < len(got):
                waits.last = await ses.block(waits.last, waits.until_next(nxt, total))
                if waits.check_due():
                    await ses.status()  # BurstNotFound once Redis lost the record


async def acollect(
    burst: str, settings: Settings | None = None, *, client: aredis.Redis | None = None
) -> list[Result]:
    """`collect` on an event loop."""
    async with _AsyncSession(burst, settings, client) as ses:
        total = (await ses.status()).total
        return [r for indexes in chunks(total) for r in await ses.fetch(indexes) if r]


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
        with writing(out) as f:  # whole or not at all (client/out_file.py)
            return dump(f)
    return dump(out)
