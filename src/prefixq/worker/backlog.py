"""A restarted worker's own pending entries (in flight when it last ran), served first.

Each is charged its delivery (XCLAIM to ourselves) only as it is admitted, not all at once as a
re-read would; one on its last allowed delivery is charged only once nothing else is in flight,
and is waited for before the next (worker/solo.py).
"""

from __future__ import annotations

import logging

from redis.exceptions import ResponseError

from prefixq.store.connection import TRANSIENT, Backoff
from prefixq.worker.admission import Admission
from prefixq.worker.shard import Pending, ShardStream, last_allowed

log = logging.getLogger(__name__)


async def replay_backlog(
    shard: ShardStream, work: Admission, *, page: int, max_attempts: int
) -> None:
    """Serve ``shard.consumer``'s own pending entries, oldest first in each of the shard's
    streams, until none is left or the worker stops."""
    for key in work.queue_keys():
        start, backoff = "-", Backoff()
        while not work.stopping:
            try:
                rows = await shard.pending([key], count=page, start=start, consumer=shard.consumer)
                if not rows:
                    break
                for p in rows:
                    await _replay_one(shard, work, p, max_attempts)
                    start = "(" + p.entry_id.decode()
                    if work.stopping:
                        return
            except (*TRANSIENT, ResponseError) as e:
                await backoff.wait("replaying the backlog", e)


async def _replay_one(shard: ShardStream, work: Admission, p: Pending, max_attempts: int) -> None:
    if work.holds(p.ref):
        return
    last = last_allowed(p.deliveries + 1, max_attempts)
    while (work.busy() if last else work.room() <= 0) and not work.stopping:
        await work.wait_room()
    if work.stopping:
        return
    got = await shard.claim([p], 0)
    if not got:  # acked meanwhile, or deleted (XCLAIM then drops it from the list)
        return
    await work.admit(got)
    if last_allowed(got[0].deliveries, max_attempts):
        await work.wait_done(p.ref)
