"""A worker's samples of its shard's rolling history: what the dashboard draws over time.

Every ``history_every_s`` (checked at each heartbeat; 0 = off) a worker appends one entry to its
shard's history stream (`Keys.history`), trimmed to exactly `MAXLEN` entries in the same command,
so the stream never holds more. An entry's id is its time; its fields (short names, numbers):

- ``w`` the worker's name;
- ``q`` entries of the shard's streams waiting (not yet delivered to any worker) and ``p``
  pending (delivered, not acked), over its intakes and the lanes of its lane index — the totals
  `prefixq inspect` shows as "queued" and "in flight", read here without the per-tenant scan;
- ``e`` requests inside this worker's engine;
- ``d``, ``f``, ``a`` requests this worker finished, failed and admitted since its previous
  sample, and ``s`` the seconds that covers (deltas, so a restarted worker starts afresh and
  several workers of a shard add up; ``s`` to the millisecond). Deltas Redis refused are added to
  the next sample.

Cost: two round trips per sample (the lane index, then XLEN and XINFO GROUPS per stream, with the
XADD), off the requests' path. Size: `MAXLEN` entries per shard, about 52 bytes each in Redis
(docs/dashboard.md has the measured figure): one worker per shard sampling every 5 s keeps 5.7 h.
The dashboard's reader is prefixq.ops.history.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from prefixq.core.keys import GROUP
from prefixq.worker.shard import ShardStream

__all__ = ["MAXLEN", "History"]

log = logging.getLogger(__name__)

#: entries the history stream of a shard keeps (exact trimming)
MAXLEN = 4096
#: health fields counted as deltas, and their field in a sample
_COUNTED = {"finished": "d", "failed": "f", "admitted": "a"}


class History:
    """Samples for one worker's shard; `beat` is called by the heartbeat with the health fields
    it just wrote."""

    def __init__(self, shard: ShardStream, *, every_s: float, now: float) -> None:
        self.shard = shard
        self.every_s = every_s
        self.key = shard.keys.history(shard.shard)
        self._last = now
        #: counters as of the last sample Redis took
        self._told = dict.fromkeys(_COUNTED, 0)

    def due(self, now: float) -> bool:
        return bool(self.every_s) and now - self._last >= self.every_s

    async def beat(self, now: float, health: Mapping[str, Any]) -> None:
        """Append a sample if one is due (Redis errors propagate: the heartbeat logs them and
        the deltas go into the next sample)."""
        if not self.due(now):
            return
        waiting, pending = await self._queues()
        counts = {name: int(health.get(name, 0)) for name in _COUNTED}
        sample: dict[str, Any] = {
            "w": self.shard.consumer,
            "q": waiting,
            "p": pending,
            "e": int(health.get("inflight", 0)),
            "s": _compact(now - self._last),
        }
        for name, field in _COUNTED.items():
            sample[field] = max(0, counts[name] - self._told[name])
        await self.shard.r.xadd(self.key, sample, maxlen=MAXLEN, approximate=False)
        self._told, self._last = counts, now

    async def _queues(self) -> tuple[int, int]:
        """(waiting, pending) over the shard's intakes and lanes: a stream holds exactly its
        waiting and pending entries (acked ones are deleted), the group knows the pending."""
        lanes = await self.shard.lane_index()
        lane_keys = [
            self.shard.keys.lane(self.shard.shard, b.decode(errors="replace")) for b in lanes
        ]
        streams = [*self.shard.intakes, *lane_keys]
        pipe = self.shard.r.pipeline(transaction=False)
        for key in streams:
            pipe.xlen(key)
            pipe.xinfo_groups(key)
        replies = await pipe.execute(raise_on_error=False)
        waiting = pending = 0
        for length, groups in zip(replies[::2], replies[1::2], strict=True):
            if not isinstance(length, int):
                continue
            got = 0
            if not isinstance(groups, Exception):
                for g in groups:
                    name = g.get("name")
                    if (name.decode() if isinstance(name, bytes) else name) == GROUP:
                        got = int(g.get("pending") or 0)
            waiting += max(0, length - got)
            pending += got
        return waiting, pending


def _compact(seconds: float) -> int | float:
    """Seconds to the millisecond, an int when whole (fewer bytes in the stream)."""
    x = round(seconds, 3)
    return int(x) if x.is_integer() else x
