"""``prefixq handover`` and ``prefixq worker --join``: the operator's side of an elastic fleet
(worker/handover.py moves a shard's queue; store/deployment.py picks a joining worker's shard).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prefixq.core.errors import ConfigError
from prefixq.core.settings import Settings

if TYPE_CHECKING:
    from prefixq.store.deployment import Joined

log = logging.getLogger(__name__)


#: seconds an exiting joiner spends releasing its hold (Redis down: the hold lapses by itself)
RELEASE_S = 2.0


@contextlib.contextmanager
def joined(settings: Settings) -> Iterator[int]:
    """The shard a worker started with ``--join`` serves, held for it while its engine starts
    (store/deployment.py): a thread renews the hold until the first heartbeat ends it. A worker
    that leaves the block before its first heartbeat (a stop during its start, an engine that
    fails to start) releases the hold, so the next joiner takes the shard rather than growing the
    count; one killed (-9, an OOM kill while the model loads) renews it no more, and it lapses
    within ``join_hold_s``."""
    from prefixq.store.connection import async_client
    from prefixq.store.deployment import ajoin

    async def pick() -> Joined:
        r = async_client(settings)
        try:
            return await ajoin(r, settings)
        finally:
            await r.aclose()

    with _held(settings, asyncio.run(pick())) as shard:
        yield shard


@contextlib.contextmanager
def holding(settings: Settings, shard: int) -> Iterator[None]:
    """A worker started on ``shard`` (``--shard K``) holds it as a joiner does while its engine
    starts, so that a ``--join`` meanwhile takes another shard rather than this one (its last
    heartbeat may have expired during a restart). Best effort: with Redis not answering at once
    the worker starts without a hold (its start waits for Redis anyway)."""
    from prefixq.store.connection import async_client
    from prefixq.store.deployment import ahold

    async def hold() -> Joined:
        r = async_client(settings)
        try:
            return await asyncio.wait_for(ahold(r, settings, shard), RELEASE_S)
        finally:
            await r.aclose()

    try:
        j = asyncio.run(hold())
    except Exception as err:  # never a reason not to start
        log.debug("shard %d not held while the worker starts: %r", shard, err)
        yield
        return
    with _held(settings, j):
        yield


@contextlib.contextmanager
def _held(settings: Settings, j: Joined) -> Iterator[int]:
    """``j``'s hold renewed while inside, released at the exit if no heartbeat ended it (one
    that did needs no Redis at the exit: a stop with Redis down keeps its bound). A stop that
    leaves the process at once (inside an import: `start_stop.leave_now`) releases it too,
    within ``2 * RELEASE_S`` (`_early_release`)."""
    from prefixq.cli.start_stop import off_leave, on_leave
    from prefixq.store.connection import async_client
    from prefixq.store.deployment import arelease_join
    from prefixq.worker.aio import within
    from prefixq.worker.heartbeat import BEATEN

    async def release(j: Joined) -> None:
        r = async_client(settings)
        try:
            if await within(arelease_join(r, settings, j), RELEASE_S):
                log.info("released the hold on shard %d", j.shard)
        finally:
            await r.aclose()

    once = threading.Lock()

    def finish() -> None:
        if not once.acquire(blocking=False):  # released already (the exit, or an early stop)
            return
        beaten = BEATEN.is_set()  # the first heartbeat ended the hold: nothing to release
        last = renewal.stop(wait=not beaten)
        try:
            if not beaten:
                asyncio.run(release(last))
        except Exception as err:  # never an error of the exit: the hold lapses by itself
            log.warning("the join's hold on shard %d was not released: %s", last.shard, err)

    early = functools.partial(_early_release, finish)
    renewal = _Renewal(settings, j)
    renewal.start()
    on_leave(early)
    try:
        yield j.shard
    finally:
        off_leave(early)
        finish()


def _early_release(finish: Callable[[], None]) -> None:
    """``finish`` (a hold's release) for a stop that leaves at once (`start_stop.on_leave`): on
    a thread of its own, since the main thread is inside an import there (what ``finish`` loads
    would find the module being imported half-built), waited for ``2 * RELEASE_S`` at most (its
    renewal stuck on Redis, then the release: both bounded by ``RELEASE_S``)."""
    t = threading.Thread(target=finish, name="prefixq-join-release", daemon=True)
    t.start()
    t.join(2 * RELEASE_S + 0.5)


class _Renewal(threading.Thread):
    """Renews a joiner's hold every quarter of ``join_hold_s`` while it is still there (a daemon
    thread: the engine's start blocks the main one for minutes). A failed renewal (Redis away)
    is tried again at the next; the hold lapses by itself if none succeeds."""

    def __init__(self, settings: Settings, joined: Joined) -> None:
        super().__init__(name="prefixq-join-hold", daemon=True)
        self.settings = settings
        self.joined = joined
        self._done = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        from prefixq.store.connection import sync_client
        from prefixq.store.deployment import renew_join
        from prefixq.worker.heartbeat import BEATEN

        r = sync_client(self.settings)
        try:
            while not self._done.wait(max(0.05, self.settings.join_hold_s / 4)):
                with self._lock:
                    if self._done.is_set() or BEATEN.is_set():  # the first heartbeat ended it
                        return
                    try:
                        renewed = renew_join(r, self.settings, self.joined)
                    except Exception as err:  # Redis away: the next renewal tries again
                        log.warning("the join's hold on shard %d: %s", self.joined.shard, err)
                        continue
                    if renewed is None:  # the first heartbeat ended it, or another holds it
                        return
                    self.joined = renewed
        finally:
            r.close()

    def stop(self, *, wait: bool = True) -> Joined:
        """Renew no more; the hold as last written (what the exit releases). Without ``wait``,
        a renewal under way (stuck on a Redis that is down) is not waited for."""
        self._done.set()
        if not wait:
            return self.joined
        if not self._lock.acquire(timeout=RELEASE_S):  # a renewal stuck on Redis: it lapses
            return self.joined
        try:
            return self.joined
        finally:
            self._lock.release()


def cmd_handover(args: argparse.Namespace, settings: Settings) -> int:
    """Move a shard's queued work (never delivered, or pending on dead workers) to the live
    shards now, whole prefix groups at a time."""
    from prefixq.store.connection import async_client
    from prefixq.store.deployment import aresolve_shards
    from prefixq.worker.handover import Handover, MoveReport

    async def move() -> MoveReport:
        r = async_client(settings)
        try:
            shards = await aresolve_shards(r, settings)
            if not 0 <= args.shard < shards:
                raise ConfigError(
                    f"shard {args.shard} does not exist (namespace has shards 0..{shards - 1})"
                )
            handover = Handover(r, settings, name="prefixq-handover")
            return await handover.move_shard(args.shard, shards, why="operator")
        finally:
            await r.aclose()

    rep = asyncio.run(move())
    if args.json:
        print(json.dumps(rep.to_json(), indent=2))
        return 0 if not rep.skipped else 1
    if rep.skipped:
        print(f"shard {args.shard}: nothing moved: {rep.skipped}")
        return 1
    to = ", ".join(f"{n} to shard {k}" for k, n in sorted(rep.moved.items())) or "nothing queued"
    print(
        f"shard {args.shard}: moved {rep.requests} requests in {rep.groups} prefix groups "
        f"({rep.tokens} prompt tokens): {to}; {rep.raced} groups taken by a worker meanwhile"
    )
    return 0
