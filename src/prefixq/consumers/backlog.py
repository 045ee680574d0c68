"""A restarted worker's own pending entries (in flight when it last ran), served first.

Each is charged its delivery (XCLAIM to ourselves) only as it is admitted, not all at once as a
re-read would; one on its last allowed delivery is charged only once nothing else is in flight,
and is waited for before the next (consumers/solo.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from redis.exceptions import ResponseError

from prefixq.connection import TRANSIENT, Backoff
from prefixq.consumers.deadletters import carried
from prefixq.keys import GROUP

if TYPE_CHECKING:
    from prefixq.consumers.worker import Worker

log = logging.getLogger(__name__)


async def replay_backlog(w: Worker) -> None:
    """Serve ``w``'s own pending entries, oldest first, until none is left or `w.stop()`."""
    start, backoff = "-", Backoff()
    while not w.stopping:
        try:
            page = await w.r.xpending_range(
                w.stream, GROUP, min=start, max="+", count=w.settings.read_count,
                consumername=w.name,
            )  # fmt: skip
            if not page:
                return
            for p in page:
                await _replay_one(w, p["message_id"], p["times_delivered"] + 1)
                start = "(" + p["message_id"].decode()
                if w.stopping:
                    return
        except TRANSIENT as e:
            await backoff.wait("replaying the backlog", e)
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            return  # the group is gone, and our backlog with it: the read loop rejoins


async def _replay_one(w: Worker, entry_id: bytes, delivery: int) -> None:
    if entry_id in w.inflight:
        return
    last = 1 < w.settings.max_attempts <= delivery
    while (w.inflight if last else len(w.inflight) >= w.max_inflight) and not w.stopping:
        await w.wait_room()
    if w.stopping:
        return
    got = await w.r.xclaim(w.stream, GROUP, w.name, 0, [entry_id])
    if not got:  # acked meanwhile, or deleted (XCLAIM then drops it from the list)
        return
    last = 1 < w.settings.max_attempts <= delivery + carried(got[0][1])
    await w.admit(got, {entry_id: delivery})
    task = w.inflight.get(entry_id)
    if task is not None and last:
        await w.wait_done(task)
