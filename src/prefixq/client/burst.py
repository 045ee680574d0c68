"""`Burst`: the handle `Producer.submit` returns, the one way to ask about what was submitted (as
arq's ``enqueue_job`` returns a ``Job`` and RQ's ``enqueue`` a ``Job``).

A `Burst` is its id (a ``str`` subclass: ``str(burst)``, ``repr``, ``burst == "..."``, JSON,
f-strings and Redis arguments see the id, so code that passed the id on keeps working) plus the
settings it was submitted with and a client of its own. Blocking methods (`status`, `wait`,
`iterate`, `collect`, `cancel`) share one connection, opened on first use (`close` or ``with``
closes it); their event-loop twins (`astatus`, `await_`, `aiterate`, `acollect`, `acancel`) take
one per call. For an id you only have as a string: ``Burst(burst_id, settings)``, or the module
functions of prefixq.client.results and prefixq.store.burst_end.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import redis
from redis.exceptions import RedisError

from prefixq.client import results
from prefixq.client.results import BurstStatus
from prefixq.core.records import Result
from prefixq.core.settings import Settings
from prefixq.store import burst_end
from prefixq.store.burst_end import CancelReport, OnBurstDone
from prefixq.store.connection import async_client, sync_client
from prefixq.store.redis_errors import TRANSIENT, adescribe

__all__ = ["Burst"]


class Burst(str):
    """A submitted burst: ``burst.id``, its results and its end."""

    settings: Settings
    on_burst_done: OnBurstDone | None
    _client: redis.Redis | None

    def __new__(
        cls, burst_id: str, settings: Settings, *, on_burst_done: OnBurstDone | None = None
    ) -> Burst:
        self = super().__new__(cls, burst_id)
        self.settings = settings
        #: what a cancel that ends the burst runs (its on_complete; from the `Producer`)
        self.on_burst_done = on_burst_done
        self._client = None
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (str(self), self.settings))

    @property
    def id(self) -> str:
        """The burst id, a plain ``str``."""
        return str(self)

    # ---- blocking --------------------------------------------------------------------------
    @property
    def client(self) -> redis.Redis:
        """The handle's blocking Redis client (opened on first use)."""
        if self._client is None:
            self._client = sync_client(self.settings)
        return self._client

    def status(self) -> BurstStatus:
        """The burst's record and counters right now (BurstNotFound once it expired)."""
        return results.status(self.id, self.settings, client=self.client)

    def wait(
        self,
        timeout: float | None = None,
        *,
        progress: Callable[[BurstStatus], None] | None = None,
    ) -> BurstStatus:
        """Block until every request has a result; BurstTimeout past ``timeout`` s."""
        return results.wait(
            self.id, self.settings, timeout=timeout, progress=progress, client=self.client
        )

    def iterate(self, timeout: float | None = None) -> Iterator[Result]:
        """Results in input order, each as soon as it and all before it are recorded."""
        return results.iterate(self.id, self.settings, timeout=timeout, client=self.client)

    def collect(self) -> list[Result]:
        """Every result recorded so far, in input order."""
        return results.collect(self.id, self.settings, client=self.client)

    def cancel(self) -> CancelReport:
        """Cancel what has not finished (`prefixq.store.burst_end.cancel`); idempotent."""
        done = self.on_burst_done.done if self.on_burst_done else None
        return burst_end.cancel(self.id, self.settings, client=self.client, on_burst_done=done)

    def close(self) -> None:
        """Close the blocking client (the handle opens a new one if used again)."""
        if self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self) -> Burst:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- on an event loop ------------------------------------------------------------------
    async def astatus(self) -> BurstStatus:
        """`status` on an event loop."""
        return await results.astatus(self.id, self.settings)

    async def await_(
        self,
        timeout: float | None = None,  # noqa: ASYNC109 -- BurstTimeout says how far it got, as the sync twin
        *,
        progress: Callable[[BurstStatus], None] | None = None,
    ) -> BurstStatus:
        """`wait` on an event loop (PEP 8's trailing underscore: ``await`` is Python's)."""
        return await results.await_(self.id, self.settings, timeout=timeout, progress=progress)

    def aiterate(self, timeout: float | None = None) -> AsyncIterator[Result]:
        """`iterate` on an event loop: ``async for result in burst.aiterate():``."""
        return results.aiterate(self.id, self.settings, timeout=timeout)

    async def acollect(self) -> list[Result]:
        """`collect` on an event loop."""
        return await results.acollect(self.id, self.settings)

    async def acancel(self) -> CancelReport:
        """`cancel` on an event loop."""
        r = async_client(self.settings)
        try:
            adone = self.on_burst_done.adone if self.on_burst_done else None
            return await burst_end.acancel(self.id, self.settings, r, on_burst_done=adone)
        except (*TRANSIENT, RedisError) as e:  # ours, with a hint (one exception root)
            raise await adescribe(self.settings, e, r) from e
        finally:
            await r.aclose()


def _rebuild(burst_id: str, settings: Settings) -> Burst:
    return Burst(burst_id, settings)
