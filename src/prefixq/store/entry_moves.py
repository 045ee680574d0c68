"""Moving queued entries from one shard to another, exactly once (`EntryMoves`).

A shard's streams share one Cluster slot and another shard's do not, so a move is three steps,
each atomic in one slot, and each safe to repeat:

1. **take** (lua/take_entries.lua, source slot): the entries — all of a group or none — are
   written to the source shard's plan hash (`Keys.moving`) with their target and fields, and
   deleted from their stream (acked first when they were pending on a dead consumer; the
   deliveries they had are added to the carried count, `CARRIED`, so ``max_attempts`` counts
   across moves). A moved entry loses its lane doorbell and its place (`LANE`, `POS`): it waits
   for nothing on its new shard, like an entry `prefixq reclaim` put back.
2. **put** (lua/put_entries.lua, target slot): each planned entry is added to the tail of the
   target's intake of its priority unless its token (source, stream, id) is in the target's
   set of entries moved in (`Keys.moved_in`): a repeated put adds nothing.
3. **done**: the plan's fields are deleted.

A mover that dies after 1 leaves the plan; `finish` (run first by every mover of that shard) puts
what is planned and deletes the plan. With ``min_replicas_acked`` the source's master is fenced
after 1 and the target's after 2 (store/fence.py), so a failover cannot lose a step that the
next one relies on; the target's fence first reads the put's tokens back from the set of entries
moved in, so a failover between the put and its fence (the promoted replica never got the put) is
`WritesLost` and the plan stays for the next `finish`, where a bare WAIT on the new master would
have confirmed, and the plan's deletion lost the entries. docs/delivery.md, "Moves between
shards", has the rest.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import redis.asyncio as aredis

from prefixq.core import wire
from prefixq.core.entries import Entry
from prefixq.core.keys import CARRIED, FIELD, GROUP, LANE, POS, Keys
from prefixq.core.settings import Settings
from prefixq.core.sharing import DEFAULT_PRIORITY, PRIORITIES
from prefixq.store.dead_letters import DEAD_MAXLEN, dead_letter_record, identify
from prefixq.store.fence import afence
from prefixq.store.lua_script import LuaScript

__all__ = ["MOVED_IN_TTL_S", "EntryMoves", "Planned"]

log = logging.getLogger(__name__)

#: how long a shard remembers the entries moved onto it (a retried put adds none of them again)
MOVED_IN_TTL_S = 7 * 24 * 3600
#: entries per put script call
_PUT_BATCH = 200


@dataclass(slots=True)
class Planned:
    """An entry taken off ``source`` (``field`` of its plan hash), on its way to ``target``."""

    source: int
    field: bytes
    target: int
    fields: dict[bytes, bytes]

    @property
    def token(self) -> bytes:
        return str(self.source).encode() + b"\n" + self.field


class EntryMoves:
    """The three steps of a move over one asyncio client."""

    def __init__(self, r: aredis.Redis, settings: Settings) -> None:
        self.r = r
        self.s = settings
        self.keys = Keys(settings.namespace)
        self.limits = wire.Limits.from_settings(settings)
        self._take = LuaScript("take_entries")
        self._put = LuaScript("put_entries")

    async def take(
        self,
        source: int,
        stream: str,
        ids: Sequence[bytes | str],
        target: int,
        *,
        pending_on: bytes | None = None,
        idle_ms: int = 0,
    ) -> int:
        """Step 1 for ``ids`` of ``stream`` (of shard ``source``): all or none of them (0).
        ``pending_on``: they are pending on that (dead) consumer, idle ``idle_ms`` at least;
        else they were never delivered."""
        mode = "new" if pending_on is None else "pending"
        args: list[bytes | str | int] = [
            GROUP,
            mode,
            pending_on or b"",
            idle_ms,
            CARRIED,
            LANE,
            POS,
            target,
            *ids,
        ]
        taken = int(
            await self._take.acall(self.r, keys=[stream, self.keys.moving(source)], args=args)
        )
        if taken and self.s.min_replicas_acked:
            await afence(self.r, self.s, [self.keys.moving(source)])
        return taken

    async def planned(self, source: int) -> list[Planned]:
        """What is taken off ``source`` and not yet done (a dead mover's plan included)."""
        out: list[Planned] = []
        bad: dict[bytes, tuple[bytes, str]] = {}
        async for field, raw in self.r.hscan_iter(self.keys.moving(source), count=1000):
            try:
                target, flat = msgpack.unpackb(raw, raw=True)
                fields = dict(zip(flat[::2], flat[1::2], strict=True))
                out.append(Planned(source, field, int(target), fields))
            except (ValueError, TypeError) as err:
                bad[field] = (raw, str(err))
        if bad:
            await self._dead_plans(source, bad)
        return out

    async def _dead_plans(self, source: int, bad: dict[bytes, tuple[bytes, str]]) -> None:
        """Plans no mover can read (written by something else: no move writes them so) go to the
        source shard's dead letters, raw, and leave the plan hash: each is reported once, not at
        every look, and none is lost without a trace."""
        pipe = self.r.pipeline(transaction=False)
        for field, (raw, err) in bad.items():
            log.error(
                "plan %r of shard %d is unreadable (%s): moved to its dead letters",
                field,
                source,
                err,
            )
            reason = f"unreadable move plan: {err}"
            record, _ = dead_letter_record(
                field, source, {FIELD: raw}, reason, 0, "mover", self.limits
            )
            pipe.xadd(self.keys.dead(source), record, maxlen=DEAD_MAXLEN, approximate=True)
            pipe.hdel(self.keys.moving(source), field)
        await pipe.execute()

    async def put(self, plans: Sequence[Planned]) -> int:
        """Steps 2 and 3 for ``plans`` (of one source shard): returns the entries added."""
        if not plans:
            return 0
        by_target: dict[int, list[Planned]] = defaultdict(list)
        for p in plans:
            by_target[p.target].append(p)
        added = 0
        for target, group in by_target.items():
            for start in range(0, len(group), _PUT_BATCH):
                added += await self._put_batch(target, group[start : start + _PUT_BATCH])
        if self.s.min_replicas_acked:  # the tokens read back: a put a failover lost keeps its plan
            members = {self.keys.moved_in(t): [p.token for p in g] for t, g in by_target.items()}
            await afence(self.r, self.s, list(members), members=members)
        source = plans[0].source
        for start in range(0, len(plans), 1000):
            fields = [p.field for p in plans[start : start + 1000]]
            await self.r.hdel(self.keys.moving(source), *fields)
        return added

    async def finish(self, source: int) -> int:
        """Complete every move of ``source`` that a mover began (steps 2 and 3)."""
        plans = await self.planned(source)
        added = await self.put(plans)
        if plans:
            log.info(
                "shard %d: finished %d planned moves (%d added, the rest were in place)",
                source,
                len(plans),
                added,
            )
        return added

    async def _put_batch(self, target: int, plans: Sequence[Planned]) -> int:
        keys: list[str] = [self.keys.moved_in(target)]
        slot: dict[str, int] = {}
        args: list[bytes | str | int] = [MOVED_IN_TTL_S, len(plans)]
        for p in plans:
            intake = self.keys.intake(target, self.priority(p.fields))
            if intake not in slot:
                keys.append(intake)
                slot[intake] = len(keys)
            flat = [x for kv in p.fields.items() for x in kv]
            args += [p.token, slot[intake], len(flat), *flat]
        return int(await self._put.acall(self.r, keys=keys, args=args))

    def priority(self, fields: dict[bytes, bytes]) -> str:
        """The priority of an entry's request (its intake on the new shard); ``normal`` for one
        that does not decode (its worker dead-letters it there, as it would have here)."""
        entry: Entry | None = identify(fields.get(FIELD), self.limits)
        if entry is None or entry.priority not in PRIORITIES:
            return DEFAULT_PRIORITY
        return entry.priority
