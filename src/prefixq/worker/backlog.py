"""A restarted worker's own pending entries (in flight when it last ran), served first.

Each is charged its delivery (XCLAIM to ourselves) only as it is admitted, not all at once as a
re-read would; one on its last allowed delivery is charged only once nothing else is in flight,
and is waited for before the next (worker/solo.py).
"""

from __future__ import annotations

import logging

from prefixq.store.retry import retry
from prefixq.worker.deliveries import Pending, last_allowed
from prefixq.worker.shard import ShardStream
from prefixq.worker.view import WorkerView

log = logging.getLogger(__name__)


async def replay_backlog(
    stream: ShardStream, work: WorkerView, *, page: int, max_attempts: int
) -> None:
    """Serve ``stream.consumer``'s own pending entries, oldest first in each of the shard's
    streams, until none is left or the worker stops."""
    for key in work.queue_keys():
        start = "-"

        async def one_page(key: str = key) -> bool:
            """Serve the next page of ``key``'s backlog; False once nothing is left."""
            nonlocal start
            rows = await stream.pending([key], count=page, start=start, consumer=stream.consumer)
            for p in rows:
                await _replay_one(stream, work, p, max_attempts)
                start = "(" + p.entry_id.decode()
                if work.stopping:
                    break
            return bool(rows)

        while not work.stopping and await retry("replaying the backlog", one_page):
            pass


async def _replay_one(stream: ShardStream, work: WorkerView, p: Pending, max_attempts: int) -> None:
    if work.holds(p.ref):
        return
    last = last_allowed(p.deliveries + 1, max_attempts)
    while (work.busy() if last else work.room() <= 0) and not work.stopping:
        await work.wait_room()
    if work.stopping:
        return
    got = await stream.claim([p], 0)
    if not got:  # acked meanwhile, or deleted (XCLAIM then drops it from the list)
        return
    await work.admit(got)
    if last_allowed(got[0].deliveries, max_attempts):
        await work.wait_done(p.ref)
