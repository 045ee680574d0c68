"""The workers' control loop (worker/control.py) against a real redis-server: a command posted at
any moment after a worker started is answered, even one that lands between two of its reads."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio as aredis

from helpers import wait_until
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.worker import control


class _Gap:
    """An async Redis client whose first XREAD that finds nothing calls ``post`` after it
    returned and before the loop sends the next one: a command posted in that gap."""

    def __init__(self, inner: aredis.Redis, post: Callable[[], None]) -> None:
        self.inner, self.post, self.posted = inner, post, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def xread(self, streams: Any, **kw: Any) -> Any:
        got = await self.inner.xread(streams, **kw)
        if not got and not self.posted:
            self.posted = True
            self.post()
        return got


def test_a_command_posted_between_two_reads_of_the_control_loop_is_answered(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Given a worker's control loop whose read timed out (nothing posted for a second), when a
    command is posted before its next read is sent, the worker answers it (the loop read from
    ``$`` each time, which waits for entries added after the read: that command was missed and
    its sender, `prefixq bench` resetting the prefix caches, waited 60 s and failed). A command
    posted before the worker started is not its own."""
    s = make_settings()
    keys = Keys(s.namespace)
    r.xadd(keys.control, {"cmd": "stats", "id": "before"})

    def post() -> None:
        r.xadd(keys.control, {"cmd": "stats", "id": "gap"})

    async def run() -> None:
        ar = aredis.Redis.from_url(s.redis_url)
        loop = asyncio.create_task(
            control.control_loop(_Gap(ar, post), keys, "w", {}, lambda: {})  # type: ignore[arg-type]
        )
        try:
            for _ in range(100):
                if await ar.hget(keys.control_acks, "gap:w") is not None:
                    break
                await asyncio.sleep(0.05)
        finally:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop
            await ar.aclose()

    asyncio.run(run())
    got = r.hget(keys.control_acks, "gap:w")
    assert got is not None, "the command posted between two reads was never answered"
    assert json.loads(got)["ok"] is True
    assert r.hget(keys.control_acks, "before:w") is None


def test_a_command_sent_the_moment_a_worker_says_it_serves_is_answered(
    make_settings: Callable[..., Settings],
    r: redis.Redis,
    fake_worker: Callable[..., Any],
    monkeypatch: Any,
) -> None:
    """Given a worker whose control loop is slow to take its starting point (half a second for
    the control stream's newest id: a busy event loop), a command posted as soon as its beat
    says it serves is answered (`prefixq bench` sends ``stats`` and ``reset_prefix_cache`` at
    that moment: the loop took its start after the command and missed it, and the sender waited
    60 s and failed, as a suite run's admission test did)."""
    s = make_settings()
    keys = Keys(s.namespace)
    real = aredis.Redis.xrevrange

    async def slow(self: aredis.Redis, name: Any, *a: Any, **kw: Any) -> Any:
        if name in (keys.control, keys.control.encode()):
            await asyncio.sleep(0.5)
        return await real(self, name, *a, **kw)

    monkeypatch.setattr(aredis.Redis, "xrevrange", slow)
    fw = fake_worker(s, name="w0")  # returns once its beat says engine_up
    r.xadd(keys.control, {"cmd": "stats", "id": "first"})
    ack = lambda: r.hget(keys.control_acks, f"first:{fw.name}")  # noqa: E731
    got = wait_until(ack, 5, "an answer to the command posted as the worker came up")
    assert json.loads(got)["ok"] is True
