"""A live worker's part in an elastic fleet (`FleetWatch`): no queue waits for a dead or busy GPU.

Every heartbeat, each live worker reads which shards have a live worker (store/liveness.py, one
round trip), and:

- **orphans**: a shard seen without one gets its first-seen time recorded (`Keys.orphans`); once
  it has been without one for ``orphan_after_s``, this worker moves its queue to the live shards
  (worker/handover.py), under the shard's mover lease, so only one live worker does it at a time.
  What producers still send it meanwhile (no new prefix: placement skips shards without a live
  worker) is moved on a later look;
- **steals**: when this worker is idle (nothing read and waiting, room in its engine) and its
  own outstanding work is small, it takes whole never-delivered prefix groups from the tail of
  the live shard with the most outstanding work (`Handover.steal` has the rule). A worker that
  joins a deployment mid-burst (``--join``) starts idle, so this is how it takes its share;
- **hand-over** (`hand_over`, ``--hand-over``): a worker that stops moves what is left of its
  shard's queue to the live shards, unless another live worker serves the shard.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis.asyncio as aredis
from redis.exceptions import RedisError

from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.store.deployment import aresolve_shards
from prefixq.store.liveness import read_liveness, read_load
from prefixq.store.redis_errors import TRANSIENT, error_text
from prefixq.worker.aio import within
from prefixq.worker.handover import LEASE_HELD, LEASE_MS, Handover, MoveReport
from prefixq.worker.lifecycle import HAND_OVER_S

__all__ = ["FleetWatch", "MoveTotals"]

#: heartbeats an idle worker waits after a look for work to steal that found none
STEAL_BACKOFF = 5
#: seconds between a hand-over's tries for its shard's lease while another mover holds it
LEASE_POLL_S = 0.2

log = logging.getLogger(__name__)


@dataclass(slots=True)
class MoveTotals:
    """What this worker moved for one reason (orphaned, steal, drain) since it started."""

    #: moves that moved at least one request
    moves: int = 0
    groups: int = 0
    requests: int = 0
    #: estimated uncached prompt tokens
    tokens: int = 0


class FleetWatch:
    """Watches the namespace's shards from the worker of shard ``shard``."""

    def __init__(
        self,
        r: aredis.Redis,
        settings: Settings,
        *,
        shard: int,
        name: str,
        idle: Callable[[], bool] = lambda: False,
        on_move: Callable[[MoveReport], Awaitable[None] | None] | None = None,
    ) -> None:
        self.r = r
        self.s = settings
        self.shard = shard
        self.keys = Keys(settings.namespace)
        self.name = name
        self.handover = Handover(r, settings, name=name)
        self.idle = idle
        self.on_move = on_move
        #: what this worker moved, by why (read by the metrics exporter at scrape time)
        self.totals: dict[str, MoveTotals] = {}
        #: shards of the deployment and how many had a live worker / were orphaned, last look
        self.shards = self.live_shards = self.orphaned_shards = 0
        self._next_steal = 0.0
        #: the steal threshold in force (0: no steals); `commands` switches it for `prefixq bench`
        self.steal_min_tokens = settings.steal_min_tokens

    async def look(self) -> list[MoveReport]:
        """One look: record shards first seen without a live worker, move the queues of those
        orphaned for ``orphan_after_s``. Returns what was moved."""
        shards = await aresolve_shards(self.r, self.s)
        live = await read_liveness(self.r, self.s, shards)
        if not live.alive(self.shard):  # this worker's own beat is not written yet
            return []
        out: list[MoveReport] = []
        await self._finish_plans(shards)
        self.shards, self.live_shards = shards, len(live.live_shards())
        orphaned = 0
        for k in range(shards):
            if k == self.shard or live.alive(k) or self.s.orphan_after_s <= 0:
                continue
            if k not in live.last and k not in live.seen_dead:  # never had a worker
                # HSET, not HSETNX: a value there that is not a time must not block it for good
                await self.r.hset(self.keys.orphans, str(k), repr(live.now))
                continue
            if live.dead_for(k) < self.s.orphan_after_s:
                continue
            orphaned += 1
            await self._report(await self.handover.move_shard(k, shards, why="orphaned"), out)
        self.orphaned_shards = orphaned
        if self.steal_min_tokens > 0 and self.idle() and time.monotonic() >= self._next_steal:
            mine = live.task(self.shard)  # only work this worker's engine serves
            await self._steal([k for k in live.live_shards() if live.task(k) == mine], out)
        return out

    async def _finish_plans(self, shards: int) -> None:
        """Moves a mover began and did not finish (it died, or failed mid-move), on any shard:
        finished under that shard's lease (each step is safe to repeat)."""
        pipe = self.r.pipeline(transaction=False)
        for k in range(shards):
            pipe.hlen(self.keys.moving(k))
        for k, n in enumerate(await pipe.execute()):
            if n:
                await self.handover.finish(k)

    async def _steal(self, live: list[int], out: list[MoveReport]) -> None:
        load = await read_load(self.r, self.keys, live)
        mine = load.get(self.shard, 0.0)
        others = [k for k in live if k != self.shard]
        if not others:
            return
        victim = max(others, key=lambda k: (load[k], -k))
        if load[victim] - mine <= self.steal_min_tokens:
            return
        rep = await self.handover.steal(
            victim, self.shard, victim_load=load[victim], thief_load=mine, why="steal"
        )
        if not rep.requests:  # nothing worth taking: look again a while later, not every beat
            self._next_steal = time.monotonic() + STEAL_BACKOFF * self.s.heartbeat_s
        await self._report(rep, out)

    def commands(self) -> dict[str, Callable[[], Awaitable[None]]]:
        """Control commands (worker/control.py) switching steals off and back on: on restores
        the ``steal_min_tokens`` setting, or its default where the setting is 0."""
        on = self.s.steal_min_tokens or Settings().steal_min_tokens

        def switch(tokens: int) -> Callable[[], Awaitable[None]]:
            async def run() -> None:
                self.steal_min_tokens = tokens
                self._next_steal = 0.0

            return run

        return {"steal:off": switch(0), "steal:on": switch(on)}

    def _count(self, rep: MoveReport) -> None:
        t = self.totals.setdefault(rep.why, MoveTotals())
        t.moves += 1
        t.groups += rep.groups
        t.requests += rep.requests
        t.tokens += rep.tokens

    async def _report(self, rep: MoveReport, out: list[MoveReport]) -> None:
        if not rep.requests:
            return
        out.append(rep)
        self._count(rep)
        if self.on_move is not None:
            result = self.on_move(rep)
            if result is not None:
                await result

    async def hand_over(self) -> MoveReport | None:
        """Move what is left of this worker's shard to the live shards, unless another live
        worker serves it (called once this worker has unregistered); waits for the shard's lease
        while another mover holds it."""
        keys = self.keys
        others = await self.r.zrange(keys.workers(self.shard), 0, -1)
        for w in others:
            name = w.decode(errors="replace")
            if name != self.name and await self.r.exists(keys.heartbeat(self.shard, name)):
                return None
        await self.r.hdel(keys.live, str(self.shard))  # no new prefix comes here now
        shards = await aresolve_shards(self.r, self.s)
        # a steal or an operator's move of this shard may hold its lease: it ends within a
        # lease's life, and what it leaves is this hand-over's to move
        give_up = time.monotonic() + LEASE_MS / 1000
        while True:
            rep = await self.handover.move_shard(self.shard, shards, why="drain")
            if rep.skipped != LEASE_HELD or time.monotonic() >= give_up:
                break
            await asyncio.sleep(LEASE_POLL_S)
        if rep.skipped:
            log.warning("hand-over of shard %d: %s; its queue waits", self.shard, rep.skipped)
        elif rep.requests:
            self._count(rep)
        return rep

    async def hand_over_on_stop(self, reached: bool) -> None:
        """`hand_over` as a stopping worker's last step (``--hand-over``), within `HAND_OVER_S`;
        never an error of the stop. ``reached``: whether its unregister reached Redis; when it
        did not (Redis down), or the move fails or runs out of time, what is left waits for a
        live worker, which moves the shard's queue once it is orphaned (``orphan_after_s``)."""
        later = "a live worker moves the rest once the shard is orphaned"
        if not reached:
            log.warning(
                "hand-over of shard %d skipped: Redis did not answer; %s", self.shard, later
            )
            return
        try:
            if not await within(self.hand_over(), HAND_OVER_S):
                log.warning(
                    "hand-over of shard %d: not done in %.0f s; %s", self.shard, HAND_OVER_S, later
                )
        except (*TRANSIENT, RedisError) as err:
            log.warning("hand-over of shard %d failed: %s; %s", self.shard, error_text(err), later)
        except Exception:  # a bug here must not turn a clean stop into a failed one
            log.exception("hand-over of shard %d failed; %s", self.shard, later)

    async def run(self, stop: asyncio.Event) -> None:
        """Look every ``heartbeat_s`` until ``stop``. A Redis error skips one look: unreachable
        quietly; a refusal (out of memory, a read-only replica) with one warning until a look
        succeeds again; anything else (a bug) with its traceback."""
        refused = False
        while not stop.is_set():
            try:
                await self.look()
                refused = False
            except TRANSIENT as err:
                log.debug("fleet look skipped: %s", err)
            except RedisError as err:
                if not refused:
                    log.warning("fleet looks skipped while Redis refuses: %s", error_text(err))
                refused = True
            except Exception:  # a bug here must not end the watch: the next look tries again
                log.exception("fleet look failed (looking again in %.1f s)", self.s.heartbeat_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.s.heartbeat_s)
