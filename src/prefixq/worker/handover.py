"""Handing a shard's queued work to live shards, whole prefix groups at a time (`Handover`).

Affinity is a preference, never a reason for work to wait: when a shard has had no live worker
for ``orphan_after_s`` (store/liveness.py), a live worker moves its queue (worker/fleet.py runs
this; `prefixq handover` is the operator's command for it). One mover per shard at a time: a lease
in the shard's slot (`Keys.mover`). The move itself (take, put, done; exactly once, also across a
failover) is store/entry_moves.py's; this module decides what moves where:

- **what**: the entries never delivered (all of them, in queue order), and the entries pending on
  a consumer that has no heartbeat (they were in flight on the dead worker: they move with the
  deliveries they had, as `prefixq reclaim` would put them back, so ``max_attempts`` counts
  across moves);
- **in groups**: the entries of one prefix group (the checkpoint that ends their shared prefix,
  ``a`` in the entry, else the stored prefix's digest) go to one shard together, so the prefix is
  computed once there; a request without a shared prefix is a group of its own;
- **where**: the shard the prefix map names for the group when that one is live, else the live
  shard with the least estimated outstanding prefill work (the placement rule for a new prefix,
  counting what this move already gave each shard). The prefix map follows (the group's anchor
  names its new shard), the load estimate moves with the work, and the moves stream records
  each group (``why``, from, to, requests, prompt tokens);
- **after**: a shard without a worker has no reader to close its bursts' lanes, so a move of its
  queue (not a steal) closes the drained ones itself (`close_lanes`, at every move: a lane sealed
  later closes at the next), as the shard's own worker would: lua/close_lane.lua, only a lane
  that holds no entry and that no producer can add to (sealed; or of a burst that ended, whose
  record is gone included, with nothing added for a minute: `ENDED_IDLE_MS`).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

import redis.asyncio as aredis

from prefixq.core import wire
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.core.sharing import LaneInfo
from prefixq.store.entry_moves import EntryMoves
from prefixq.store.liveness import add_load, read_liveness, read_load
from prefixq.store.lua_script import LuaScript
from prefixq.store.move_log import add_moves
from prefixq.store.prefix_claims import claim, read_map
from prefixq.worker.lane_scripts import LaneScripts
from prefixq.worker.queued import Found, Group, groups, scan

__all__ = ["LEASE_HELD", "LEASE_MS", "Handover", "MoveReport"]

log = logging.getLogger(__name__)

#: how long a mover's lease lasts without renewal (it renews between groups)
LEASE_MS = 30_000
#: `MoveReport.skipped` when another mover holds the shard's lease
LEASE_HELD = "another mover holds the lease"
#: a burst record's statuses after which its producer adds nothing (`close_lanes`)
_ENDED = (b"finished", b"cancelled", b"expired")


@dataclass(slots=True)
class MoveReport:
    """What one `Handover.move_shard` did."""

    source: int
    why: str
    #: requests moved, by target shard
    moved: dict[int, int] = field(default_factory=dict)
    groups: int = 0
    #: estimated uncached prompt tokens moved
    tokens: int = 0
    #: groups left in place, whole or in part: read by a worker between the look and the move
    #: (a part taken before the race moves, and is counted in the fields above)
    raced: int = 0
    #: no live shard to move to, or another mover holds the lease
    skipped: str = ""
    #: drained lanes of the source shard closed (a move of its queue, not a steal)
    lanes_closed: int = 0

    @property
    def requests(self) -> int:
        return sum(self.moved.values())

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Handover:
    """Moves of one namespace's queued work, over one asyncio client, by ``name``."""

    def __init__(self, r: aredis.Redis, settings: Settings, *, name: str) -> None:
        self.r = r
        self.s = settings
        self.name = name
        self.keys = Keys(settings.namespace)
        self.limits = wire.Limits.from_settings(settings)
        self.moves = EntryMoves(r, settings)
        self._lease = LuaScript("batch_lease")
        self._lanes: dict[int, LaneScripts] = {}

    # ---- the lease --------------------------------------------------------------------------
    async def _acquire(self, source: int) -> str | None:
        """The shard's mover lease, unless another mover holds it (a key no mover wrote, such as
        one without a TTL, is taken over: lua/batch_lease.lua)."""
        token = f"{self.name}:{secrets.token_hex(6)}"
        args = [token, "acquire", LEASE_MS]
        got = await self._lease.acall(self.r, keys=[self.keys.mover(source)], args=args)
        return token if got else None

    async def _renew(self, source: int, token: str) -> bool:
        args = [token, "renew", LEASE_MS]
        return bool(await self._lease.acall(self.r, keys=[self.keys.mover(source)], args=args))

    async def _release(self, source: int, token: str) -> None:
        await self._lease.acall(self.r, keys=[self.keys.mover(source)], args=[token, "release", 0])

    async def finish(self, source: int) -> bool:
        """Finish the moves begun on ``source`` (a plan left by a mover that died or failed),
        under its lease; False if another mover holds it."""
        token = await self._acquire(source)
        if token is None:
            return False
        try:
            await self.moves.finish(source)
        finally:
            await self._release(source, token)
        return True

    # ---- the moves --------------------------------------------------------------------------
    async def move_shard(self, source: int, shards: int, *, why: str) -> MoveReport:
        """Move shard ``source``'s queued work (never delivered, or pending on dead consumers) to
        the live shards among ``0 .. shards-1``, each group to the shard the map names for it if
        that is live, else to the least loaded."""
        rep = MoveReport(source=source, why=why)
        live = await read_liveness(self.r, self.s, shards)
        task = live.task(source)  # its queue holds work of its task: only such shards take it
        targets = [k for k in live.live_shards() if k != source and live.task(k) == task]
        if not targets:
            rep.skipped = "no live shard to move to"
            rep.skipped += f" (that serves {task})" if task != "generate" else ""
            return rep
        # no worker serves the shard: what is pending on gone workers moves, drained lanes close
        return await self._run(rep, targets, dead_pending=True, steal=None)

    async def steal(
        self, victim: int, thief: int, *, victim_load: float, thief_load: float, why: str
    ) -> MoveReport:
        """Move whole never-delivered prefix groups from the tail of ``victim``'s queue to
        ``thief`` while that shortens the victim's backlog: a group (``w`` tokens to compute
        there, ``c`` more predicted cached there and computed again on the thief) moves if the
        victim's backlog without it, ``V - w``, stays at least the thief's with it, ``T + w + c``
        (V, T: their outstanding work, updated as groups move); a group too large is passed
        over for a smaller one before it."""
        rep = MoveReport(source=victim, why=why)
        balance = [victim_load, thief_load]
        return await self._run(rep, [thief], dead_pending=False, steal=balance)

    async def _run(
        self, rep: MoveReport, targets: list[int], *, dead_pending: bool, steal: list[float] | None
    ) -> MoveReport:
        source = rep.source
        token = await self._acquire(source)
        if token is None:
            rep.skipped = LEASE_HELD
            return rep
        try:
            await self.moves.finish(source)
            found = await scan(
                self.r,
                self.keys,
                self.limits,
                source,
                dead_pending=dead_pending,
                skip_started=steal is not None,  # a steal leaves started groups on the victim
            )
            queued = groups(found)
            if steal is not None:
                queued.reverse()  # the tail first
            if queued:
                await self._move_groups(rep, queued, targets, token, steal)
            if dead_pending:
                rep.lanes_closed = await self.close_lanes(source)
        finally:
            await self._release(source, token)
        if rep.requests or rep.raced:
            log.warning(
                "shard %d (%s): moved %d requests in %d prefix groups (%d prompt tokens) to %s; "
                "%d groups raced",
                source,
                rep.why,
                rep.requests,
                rep.groups,
                rep.tokens,
                dict(sorted(rep.moved.items())),
                rep.raced,
            )
        return rep

    async def close_lanes(self, source: int) -> int:
        """Close shard ``source``'s drained lanes, each with its lane index field
        (lua/close_lane.lua, which decides atomically: no entry left in it, and sealed, or its
        burst ended and nothing was added for `ENDED_IDLE_MS`); returns how many closed. A
        burst whose record is gone (expired after it ended) counts as ended."""
        index: dict[bytes, bytes] = await self.r.hgetall(self.keys.lanes(source))
        lanes: list[tuple[str, str, bool]] = []
        unsealed: list[str] = []
        for raw_burst, raw in index.items():
            info = LaneInfo.decode(raw)
            if info is None:  # not written by a producer: left alone, as workers do
                continue
            burst = raw_burst.decode(errors="replace")
            if info.sealed:
                lanes.append((self.keys.lane(source, burst), burst, False))
            else:
                unsealed.append(burst)
        if unsealed:
            pipe = self.r.pipeline(transaction=False)
            for burst in unsealed:
                pipe.hget(self.keys.burst(burst), "status")
            for burst, status in zip(unsealed, await pipe.execute(), strict=True):
                if status is None or status in _ENDED:
                    lanes.append((self.keys.lane(source, burst), burst, True))
        if not lanes:
            return 0
        scripts = self._lanes.get(source)
        if scripts is None:
            scripts = LaneScripts(self.r, index=self.keys.lanes(source), consumer=self.name)
            self._lanes[source] = scripts
        closed = sum(1 for reply in await scripts.close(lanes) if reply == 1)
        if closed:
            log.info("shard %d: closed %d drained lanes", source, closed)
        return closed

    async def _mapped(self, queued: list[Group], targets: list[int]) -> dict[bytes, int]:
        anchors = [g.anchor for g in queued if g.anchor is not None]
        mapped: dict[bytes, int] = {}
        if anchors:
            shards = await read_map(self.r, self.keys, anchors)
            for a, v in zip(anchors, shards, strict=True):
                # a value that is not a shard (a hand edit) names none, as placement reads it
                if v is not None and v.isdigit() and int(v) in targets:
                    mapped[a] = int(v)
        return mapped

    async def _move_groups(
        self,
        rep: MoveReport,
        queued: list[Group],
        targets: list[int],
        token: str,
        steal: list[float] | None,
    ) -> None:
        source = rep.source
        load = await read_load(self.r, self.keys, targets)
        mapped = {} if steal is not None else await self._mapped(queued, targets)
        claims: dict[bytes, int] = {}
        shifted: dict[int, int] = defaultdict(int)
        records: list[dict[str, Any]] = []
        for i, g in enumerate(queued):
            if steal is not None:
                victim, thief = steal
                if victim - thief <= 0:
                    break
                if victim - g.work < thief + g.work + g.cached:
                    continue
                target = targets[0]
            else:
                named = mapped.get(g.anchor) if g.anchor is not None else None
                target = named if named is not None else min(targets, key=lambda k: (load[k], k))
            taken = await self._take_group(source, g, target)
            if taken is not g:  # a worker read some of it meanwhile: count what moved
                rep.raced += 1
                if not taken.items:
                    continue
            g = taken
            if steal is not None:
                steal[0] -= g.work
                steal[1] += g.work + g.cached
            load[target] += g.work
            shifted[target] += g.work
            rep.moved[target] = rep.moved.get(target, 0) + len(g.items)
            rep.groups += 1
            rep.tokens += g.work
            if g.anchor is not None and g is queued[i]:  # the map follows a whole group
                claims[g.anchor] = target
            records.append(self._record(source, target, g, rep.why))
            if i % 64 == 63 and not await self._renew(source, token):
                log.warning("shard %d: the mover's lease was lost; stopping", source)
                break
        await self.moves.finish(source)
        await self._follow(source, claims, shifted, records)

    async def _take_group(self, source: int, g: Group, target: int) -> Group:
        """Take every entry of ``g`` (one call per stream and consumer, each all or none):
        ``g`` itself when all of it was taken, else the part taken (a worker read the rest
        meanwhile: what was taken moves on, the rest stays)."""
        parts: dict[tuple[str, bytes | None], list[Found]] = defaultdict(list)
        for f in g.items:
            parts[(f.stream, f.consumer)].append(f)
        taken: list[Found] = []
        for (stream, consumer), items in parts.items():
            ids = [f.id for f in items]
            if await self.moves.take(source, stream, ids, target, pending_on=consumer):
                taken += items
        if len(taken) == len(g.items):
            return g
        part = Group(g.key, anchor=g.anchor)
        for f in taken:
            part.add(f)
        return part

    def _record(self, source: int, target: int, g: Group, why: str) -> dict[str, Any]:
        return {
            "why": why,
            "from": source,
            "to": target,
            "requests": len(g.items),
            "tokens": g.work,
            "anchor": g.anchor.hex() if g.anchor else "",
            "by": self.name,
            "at": time.time(),
        }

    async def _follow(
        self,
        source: int,
        claims: dict[bytes, int],
        shifted: dict[int, int],
        records: list[dict[str, Any]],
    ) -> None:
        """The prefix map, the load estimate and the moves stream follow the moved groups."""
        if claims:
            moved = dict.fromkeys(claims, "m")
            await claim(self.r, self.keys, self.s.map_max_entries, claims, moved)
        pipe = self.r.pipeline(transaction=False)
        for target, work in shifted.items():
            add_load(pipe, self.keys, target, work)
            add_load(pipe, self.keys, source, -work)
        add_moves(pipe, self.keys, records)
        await pipe.execute()
