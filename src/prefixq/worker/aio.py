"""Five asyncio helpers the worker's lifecycle needs."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

log = logging.getLogger(__name__)


async def cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait until they are done, cancelling again while any runs on: on
    Python 3.11 a cancel can be lost (asyncio.wait_for returns the result when the awaited
    operation completes in the same loop step as the cancel, gh-86296), and redis-py sends every
    command through wait_for, so one cancel may leave a task blocked in Redis calls for ever."""
    while pending := [t for t in tasks if not t.done()]:
        for t in pending:
            t.cancel()
        await asyncio.wait(pending, timeout=1.0)
    for t in tasks:  # retrieve their exceptions: nothing is logged as "never retrieved"
        if not t.cancelled():
            t.exception()


async def first_of(*aws: Any) -> None:
    """Until the first of ``aws`` is done; the others are cancelled."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


async def unless_stopped(step: Awaitable[None], stopping: asyncio.Event) -> bool:
    """Run ``step`` (a start-up step that may wait for Redis without end) unless ``stopping``
    is set first: then the step is cancelled and this returns False. The step's own errors
    propagate."""
    task = asyncio.ensure_future(step)
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
    if task.done():
        task.result()
        return True
    await cancel_all([task])
    return False


async def drain(tasks: list[asyncio.Task[Any]], grace_s: float) -> None:
    """Let ``tasks`` (requests in flight) finish within ``grace_s``; cancel the late ones."""
    if not tasks:
        return
    log.info("draining %d in-flight requests", len(tasks))
    _, late = await asyncio.wait(tasks, timeout=grace_s)
    for t in late:
        t.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    if late:
        log.warning("%d requests did not finish in the grace period; left pending", len(late))


async def within(aw: Awaitable[Any], seconds: float) -> bool:
    """Let ``aw`` (a coroutine or a task) run for at most ``seconds`` more; cancel it (until it
    is done: `cancel_all`) if it is still running then. Whether it finished; its own errors
    propagate."""
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait([task], timeout=max(0.0, seconds))
    if not done:
        await cancel_all([task])
        return False
    task.result()
    return True
