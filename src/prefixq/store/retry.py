"""Retrying Redis work in long-lived loops: one `Backoff` policy and the two shapes of loop every
worker task uses, `retry` (one operation, until Redis takes it) and `repeat` (a step run over and
over, each failure retried).

Retried: what `TRANSIENT` holds (unreachable, timeouts) and error replies (out of memory,
loading, a lost group, a read-only replica); with ``settings``, errors retrying cannot fix
(wrong credentials, an ACL that denies a command: `refused`) raise ConfigError at once. Each
failure is logged with what failed and the wait before the next try.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import ResponseError

from prefixq.core.settings import Settings
from prefixq.store.connection import raise_if_cancelled
from prefixq.store.redis_errors import TRANSIENT, describe, error_text, refused

__all__ = ["RETRIED", "Backoff", "repeat", "retry"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: the errors `retry` and `repeat` retry
RETRIED: tuple[type[BaseException], ...] = (*TRANSIENT, ResponseError)


class Backoff:
    """The waits between retries of one Redis operation in a worker loop: ``first`` seconds,
    doubling up to ``cap``; `reset()` after a success.

    One outage (a failover, a restart) is one log line at ``level``, not one per retry: later
    failures are logged at DEBUG, again at ``level`` every `LOUD_EVERY_S` while it lasts, and the
    success that ends it at INFO."""

    #: seconds between two logged failures of one outage
    LOUD_EVERY_S = 30.0

    def __init__(self, first: float = 0.1, cap: float = 5.0) -> None:
        self.first, self.cap, self.delay = first, cap, first
        self.failures = 0
        self._since = self._loud = 0.0
        self._what = ""

    async def wait(self, what: str, err: BaseException, level: int = logging.WARNING) -> None:
        """Log that ``what`` failed with ``err``, sleep the current delay, double it."""
        now = time.monotonic()
        if self.failures == 0:
            self._since = now
        self.failures += 1
        loud = self.failures == 1 or now - self._loud >= self.LOUD_EVERY_S
        if loud:
            self._loud = now
        self._what = what
        log.log(
            level if loud else logging.DEBUG,
            "%s failed (%s); retrying in %.2fs",
            what,
            error_text(err),
            self.delay,
        )
        await asyncio.sleep(self.delay)
        self.delay = min(self.delay * 2, self.cap)

    def reset(self) -> None:
        if self.failures:
            log.info(
                "%s: succeeded again after %d failed tries (%.1fs)",
                self._what,
                self.failures,
                time.monotonic() - self._since,
            )
        self.delay = self.first
        self.failures = 0


async def retry(
    what: str,
    call: Callable[[], Awaitable[T]],
    *,
    settings: Settings | None = None,
    errors: tuple[type[BaseException], ...] = RETRIED,
    backoff: Backoff | None = None,
    level: int = logging.WARNING,
) -> T:
    """``await call()`` until it does not fail with one of ``errors``; its result. With
    ``settings``, a refused connection (credentials, ACL, certificate) raises ConfigError."""
    backoff = backoff or Backoff()
    while True:
        try:
            out = await call()
            backoff.reset()
            return out
        except errors as e:
            if settings is not None and refused(e):
                raise describe(settings, e) from e
            raise_if_cancelled()  # the task stops (a cancel redis-py's connect swallowed)
            await backoff.wait(what, e, level)


async def repeat(
    what: str, step: Callable[[], Awaitable[object]], until: Callable[[], bool]
) -> None:
    """Run ``step`` until ``until()`` says stop; a step that fails with a Redis error is logged
    and run again after a backoff, which each success resets."""
    backoff = Backoff()
    while not until():
        try:
            await step()
            backoff.reset()
        except RETRIED as e:
            raise_if_cancelled()
            await backoff.wait(what, e)
