"""The worker's single writer: records finished results in pipelined groups, then acks them.

A group is whatever finished while the previous group was being written, up to ``write_batch``:
no timer, so a lone result is written at once and a burst of completions shares a round trip.
Each group goes through `ShardStream.record` (exactly once per request, Lua) and then
`ShardStream.ack` for the results that were recorded; a result Redis refused (out of memory, a
lost script) stays queued and its entry pending, and the group is tried again with backoff.

With ``min_replicas_acked`` a group is acked only once its fence (store/fence.py) found every
result on the master serving it now and that master's replicas confirmed it; a result a failover
lost between the record and the fence is recorded again.

Back-pressure: results not yet written count against the worker's in-flight window (`backlog`),
so while Redis refuses writes the reader stops reading instead of piling up finished work; and
the entries of unwritten results stay leased to this worker (`holding`), so no other worker
reclaims them meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from prefixq.core.entries import Entry
from prefixq.core.errors import ReplicasBehind, WritesLost
from prefixq.core.records import Result
from prefixq.store.fence import afence
from prefixq.store.redis_errors import TRANSIENT
from prefixq.store.retry import Backoff, retry
from prefixq.store.scripts import (
    BURST_DONE,
    DUPLICATE,
    FINISHED_DUPLICATE,
    OUT_OF_RANGE,
    RECORD_LOST,
)
from prefixq.worker.deliveries import Ref, Written
from prefixq.worker.shard import ShardStream

log = logging.getLogger(__name__)

#: called with a burst id when a result completes it (again after a duplicate of a finished one)
BurstDone = Callable[[str], Awaitable[None]]


class ResultWriter:
    """Runs as one task (`run`); the worker hands it results with `put`."""

    def __init__(
        self,
        stream: ShardStream,
        *,
        write_batch: int,
        on_burst_done: BurstDone | None = None,
        on_written: Callable[[], None] | None = None,
    ) -> None:
        self.stream = stream
        self.write_batch = write_batch
        self.on_burst_done = on_burst_done
        #: called after each group is acked (the reader waits on room)
        self.on_written = on_written or (lambda: None)
        self.queue: asyncio.Queue[Written | None] = asyncio.Queue()
        #: entries whose results are queued or being written, still pending on this consumer
        self._unwritten: set[Ref] = set()
        self.duplicates = 0
        self.written = 0
        self._closed = asyncio.Event()

    @property
    def backlog(self) -> int:
        """Results finished but not yet recorded and acked."""
        return len(self._unwritten)

    def holds(self, ref: Ref) -> bool:
        return ref in self._unwritten

    def holding(self) -> list[Ref]:
        """Entries of results not yet acked (leased to this worker)."""
        return list(self._unwritten)

    def put(self, ref: Ref, entry: Entry, result: Result) -> None:
        self._unwritten.add(ref)
        self.queue.put_nowait(Written(ref[0], ref[1], entry, result))

    async def write_now(self, ref: Ref, entry: Entry, result: Result) -> None:
        """Record and ack one result before returning (a dead letter's failed result: its entry
        must be acked before the reader could be delivered it again)."""
        self._unwritten.add(ref)
        await self._write([Written(ref[0], ref[1], entry, result)])

    async def run(self) -> None:
        try:
            while True:
                item = await self.queue.get()
                if item is None:  # the end (`close`), once what was queued after it is written
                    if self.queue.empty():
                        return
                    self.queue.put_nowait(None)
                    continue
                await self._write(self._fill([item]))
        finally:
            self._closed.set()

    async def close(self, flush_s: float) -> None:
        """Flush what is queued within ``flush_s`` seconds, then stop (the caller cancels the
        writer's task if it is still trying: Redis away or refusing writes)."""
        self.queue.put_nowait(None)
        try:
            await asyncio.wait_for(self._closed.wait(), timeout=max(0.0, flush_s))
        except TimeoutError:
            log.error(
                "results still unwritten at exit: %d (their entries stay pending)", self.backlog
            )

    async def _write(self, batch: list[Written]) -> None:
        """Record ``batch``, ack what was recorded, retry what was refused, until all is done."""
        backoff = Backoff(first=0.05)
        todo = batch
        while todo:
            try:
                replies = await self.stream.record(todo)
            except TRANSIENT as e:
                await backoff.wait(f"recording {len(todo)} results", e)
                continue
            done = [(w, r) for w, r in zip(todo, replies, strict=True) if isinstance(r, int)]
            errors = [r for r in replies if not isinstance(r, int)]
            if done and not await self._fenced(done, backoff):
                # not acked: recorded again (a duplicate, or afresh if a failover lost it), with
                # the results finished meanwhile
                todo = self._fill(todo)
                continue
            await self._ack([w for w, _ in done])
            for w, reply in done:
                await self._settled(w, reply)
            todo = [w for w, r in zip(todo, replies, strict=True) if not isinstance(r, int)]
            if errors:  # out of memory, a read-only replica, ... (a lost script is loaded again)
                await backoff.wait(f"recording {len(todo)} results", errors[0], logging.ERROR)
            else:
                backoff.reset()

    def _fill(self, todo: list[Written]) -> list[Written]:
        """``todo`` with the results queued behind it, up to ``write_batch``; the end of the
        queue (None) stays in it, behind what is queued, for `run`. A batch whose replicas have
        not confirmed it is filled again before it is recorded again: the master records the
        results finished meanwhile as it would without the fence, and they are confirmed and
        acked together, so a replica that falls behind holds up the acks, not the recording."""
        out = list(todo)
        while len(out) < self.write_batch and not self.queue.empty():
            nxt = self.queue.get_nowait()
            if nxt is None:
                self.queue.put_nowait(None)
                break
            out.append(nxt)
        return out

    async def _fenced(self, done: list[tuple[Written, int]], backoff: Backoff) -> bool:
        """With ``min_replicas_acked``: whether the masters now serving these results still hold
        them and their replicas confirmed them (store/fence.py: the fence reads back each result
        the script recorded or found, so a failover between the record and the fence cannot
        confirm a result the old master took with it); False after a backoff when they did not
        (the caller records them again)."""
        s = self.stream.settings
        if s.min_replicas_acked <= 0:
            return True
        present: dict[str, list[int]] = {}
        for w, reply in done:
            if reply >= 0:  # recorded, or there already (a negative reply wrote nothing)
                present.setdefault(s.keys.results(w.entry.burst), []).append(w.result.index)
        try:
            await afence(
                self.stream.r,
                s,
                {s.keys.results(w.entry.burst) for w, _ in done},
                present=present,
            )
        except WritesLost as e:
            await backoff.wait(f"confirming {len(done)} results: recording them again", e)
            return False
        except (*TRANSIENT, ReplicasBehind) as e:
            await backoff.wait(f"confirming {len(done)} results on the replicas", e)
            return False
        return True

    async def _ack(self, done: list[Written]) -> None:
        if done:  # acking twice is harmless: retry whatever fails until it lands
            await retry(
                f"acking {len(done)} recorded results",
                lambda: self.stream.ack(done),
                errors=(Exception,),
                backoff=Backoff(first=0.05),
                level=logging.ERROR,
            )
        for w in done:
            self._unwritten.discard((w.key, w.entry_id))
        self.written += len(done)
        self.on_written()

    async def _settled(self, w: Written, reply: int) -> None:
        e = w.entry
        if reply in (DUPLICATE, FINISHED_DUPLICATE):
            self.duplicates += 1
            log.info("result for %s:%d already recorded; acked the redelivery", e.burst, e.index)
        elif reply == OUT_OF_RANGE:
            log.warning("entry for %s:%d is outside its burst; acked", e.burst, e.index)
        elif reply == RECORD_LOST:
            log.warning(
                "burst %s has no record of this entry (expired, evicted, never created, or the "
                "id submitted again since): result %d dropped",
                e.burst,
                e.index,
            )
        elif reply == BURST_DONE:
            log.info("burst %s finished", e.burst)
        if reply in (BURST_DONE, FINISHED_DUPLICATE) and self.on_burst_done is not None:
            await self._burst_done(e.burst, self.on_burst_done)

    async def _burst_done(self, burst: str, hook: BurstDone) -> None:
        """Run the burst-done hook; again with backoff while Redis is away or loading (the hook
        is idempotent: RQ's on_complete is enqueued once), else once."""
        backoff = Backoff(first=0.05)
        while True:
            try:
                await hook(burst)
                return
            except TRANSIENT as e:  # a restarted Redis loading its AOF, a connection lost
                await backoff.wait(f"the burst-done hook of {burst}", e)
            except Exception:  # a hook must not stop result writing
                log.exception("burst-done hook failed for %s", burst)
                return
