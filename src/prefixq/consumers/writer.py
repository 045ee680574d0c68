"""Writes finished results in pipelined groups: record once (Lua), then XACK + XDEL the entries.

A group is whatever finished while the previous group was being written, up to ``write_batch``:
no timer, so a lone result is written at once and a burst of completions shares one round trip.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from redis.exceptions import ResponseError

from prefixq import wire
from prefixq.connection import TRANSIENT, Backoff, lua
from prefixq.entries import Entry
from prefixq.keys import GROUP
from prefixq.records import Result

if TYPE_CHECKING:
    from prefixq.consumers.worker import Worker

log = logging.getLogger(__name__)

#: recorded and it completed its burst (see lua/record_result.lua)
BURST_DONE = 2
#: not recorded: the index is outside the burst (a forged or corrupt entry)
OUT_OF_RANGE = -1
Item = tuple[bytes, Entry, Result]


class ResultWriter:
    """The worker's single writer task."""

    def __init__(self, worker: Worker) -> None:
        self.w = worker
        self.queue: asyncio.Queue[Item | None] = asyncio.Queue()
        self.record = worker.r.register_script(lua("record_result"))
        #: called with the burst id when a result completes a burst (exactly once per burst)
        self.on_burst_done: list[Callable[[str], Awaitable[None]]] = []
        self.duplicates = 0
        self._closed = asyncio.Event()

    def put(self, entry_id: bytes, entry: Entry, result: Result) -> None:
        self.queue.put_nowait((entry_id, entry, result))

    async def write_now(self, entry_id: bytes, entry: Entry, result: Result) -> None:
        """Record and ack one result before returning (dead letters: the entry must be acked
        before the reader could be delivered it again)."""
        await self._write_with_retry([(entry_id, entry, result)])

    async def run(self) -> None:
        try:
            while True:
                item = await self.queue.get()
                batch: list[Item] = []
                stop = item is None
                if item is not None:
                    batch.append(item)
                while len(batch) < self.w.settings.write_batch and not self.queue.empty():
                    nxt = self.queue.get_nowait()
                    if nxt is None:
                        stop = True
                        break
                    batch.append(nxt)
                if batch:
                    await self._write_with_retry(batch)
                if stop and self.queue.empty():
                    return
        finally:
            self._closed.set()

    async def close(self) -> None:
        """Flush what is queued, then stop."""
        self.queue.put_nowait(None)
        try:
            await asyncio.wait_for(self._closed.wait(), timeout=self.w.settings.grace_s + 30)
        except TimeoutError:
            log.error(
                "results still unwritten at exit: %d (their entries stay pending)",
                self.queue.qsize(),
            )

    async def _write_with_retry(self, batch: list[Item]) -> None:
        backoff = Backoff(first=0.05)
        while True:
            try:
                await self._write(batch)
                return
            except TRANSIENT as e:
                await backoff.wait(f"writing {len(batch)} results", e)
            except ResponseError as e:  # NOSCRIPT after a Redis restart, OOM, READONLY, ...:
                # a dead writer would strand every later result, so it outlives them too
                await backoff.wait(f"writing {len(batch)} results", e, logging.ERROR)

    async def _write(self, batch: list[Item]) -> None:
        w, keys = self.w, self.w.keys
        codec, ttl, now = w.settings.codec, w.settings.result_ttl_s, repr(time.time())
        pipe = w.r.pipeline(transaction=False)
        for _, e, res in batch:
            await self.record(
                keys=[keys.results(e.burst), keys.burst(e.burst), keys.events(e.burst)],
                args=[
                    e.index,
                    wire.encode(res.to_wire(), codec),
                    int(res.error is not None),
                    ttl,
                    now,
                    res.prompt_tokens,
                    res.cached_tokens,
                    res.predicted_cached_tokens,
                ],
                client=pipe,
            )
        ids = [entry_id for entry_id, _, _ in batch]
        pipe.xack(w.stream, GROUP, *ids)
        pipe.xdel(w.stream, *ids)
        k = w.shard
        pipe.hincrby(keys.load, str(k), -sum(e.work for _, e, _ in batch))
        pipe.hincrby(keys.shard_stats, f"{k}:prompt", sum(r.prompt_tokens for _, _, r in batch))
        pipe.hincrby(keys.shard_stats, f"{k}:cached", sum(r.cached_tokens for _, _, r in batch))
        pipe.hincrby(
            keys.shard_stats, f"{k}:predicted", sum(r.predicted_cached_tokens for _, _, r in batch)
        )
        replies = await pipe.execute()
        for (_, e, _), reply in zip(batch, replies[: len(batch)], strict=True):
            if reply == 0:
                self.duplicates += 1
                log.info(
                    "result for %s:%d already recorded; acked the redelivery", e.burst, e.index
                )
            elif reply == OUT_OF_RANGE:
                log.warning("entry for %s:%d is outside its burst; acked", e.burst, e.index)
            elif reply == BURST_DONE:
                log.info("burst %s finished", e.burst)
                for hook in self.on_burst_done:
                    try:
                        await hook(e.burst)
                    except Exception:  # a hook must not stop result writing
                        log.exception("burst-done hook failed for %s", e.burst)
