"""Affinity placement over a prefix map shared in Redis by every producer (`AffinityPlacer`).

A request goes to the shard named by the deepest of its checkpoints (chained block hashes) that the
map knows or this burst has already placed; a request with none starts a new prefix group on the
shard with the least estimated outstanding prefill work. Only shards with a live worker are chosen
(store/liveness.py): a checkpoint the map gives to a shard without one is placed again, and the map
moves with it (affinity is a preference, never a reason for work to wait). Two invariants: new
checkpoints are claimed atomically (``HSETNX`` in lua/claim_prefixes.lua), so when two producers
race for one prefix the loser follows the winner; and the map stays bounded (``map_max_entries``;
an approximate LRU in two generations: a checkpoint claimed or used stays while fewer than
``map_max_entries`` / 2 others were written after it). docs/architecture.md, "Affinity", has the
design (checkpoints, the load guard, moves) and its measured costs.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field

import redis.asyncio as aredis

from prefixq.affinity.ancestors import Ancestry
from prefixq.affinity.placement import Item, Placed
from prefixq.core.settings import Settings
from prefixq.store.liveness import alive_mask, read_load
from prefixq.store.move_log import add_moves
from prefixq.store.prefix_claims import claim, read_map

log = logging.getLogger(__name__)


def _cp(h: int) -> bytes:
    return h.to_bytes(8, "little")


@dataclass(slots=True)
class _Plan:
    """One request's checkpoints and decision."""

    cps: list[tuple[int, bytes]]  # (block index, hash) shallow -> deep
    shard: int = -1
    matched: int = 0  # blocks matched in the map
    claims: list[bytes] = field(default_factory=list)


class AffinityPlacer:
    """The default placement (``placement="affinity"``)."""

    def __init__(self, settings: Settings, *, engine_block: int = 0) -> None:
        self.s = settings
        self.keys = settings.keys
        #: the engine's KV block in tokens: predicted hits are rounded down to it
        self.engine_block = engine_block or settings.block_size
        self.moves: list[dict[str, float | int | str]] = []
        #: each group's shared ancestor, over the burst's chunks (affinity/ancestors.py)
        self.ancestry = Ancestry()
        #: the shards it may place on (those that serve the burst's task: affinity/serving.py);
        #: None = every shard
        self.among: list[int] | None = None
        self._recorded = 0

    def checkpoints(self, item: Item) -> list[tuple[int, bytes]]:
        """(block index, checkpoint) of every ``checkpoint_every``-th block, the prefix's last
        and the last, in order."""
        blocks = item.blocks
        n = len(blocks)
        every = self.s.checkpoint_every
        idx = list(range(every - 1, n, every))
        # at most two more, each not a multiple of `every` already in the list: insert in order
        for extra in (min(item.prefix_blocks, n) - 1 if item.prefix_blocks else -1, n - 1):
            if extra >= 0 and (extra + 1) % every:
                bisect.insort(idx, extra)
        if len(idx) > 1 and idx[-1] == idx[-2]:  # the prefix's last block is the last one
            del idx[-1]
        return [(i, blocks[i].to_bytes(8, "little")) for i in idx]

    async def place(self, r: aredis.Redis, items: list[Item], shards: int) -> list[Placed]:
        plans = [_Plan(self.checkpoints(it)) for it in items]
        unique = list({cp for p in plans for _, cp in p.cps})
        raw_live = await r.hgetall(self.keys.live)
        alive = alive_mask(raw_live, shards, self.s.heartbeat_ttl_s, time.time(), self.among)
        live = [k for k in range(shards) if alive[k]]
        known: dict[bytes, int] = {}
        modes: dict[bytes, str] = {}
        for start in range(0, len(unique), 10_000):
            chunk = unique[start : start + 10_000]
            for cp, v in zip(chunk, await read_map(r, self.keys, chunk), strict=True):
                if v is None:
                    continue
                held = int(v) if v.isdigit() else -1
                if 0 <= held < shards and alive[held]:
                    known[cp] = held
                else:  # no live worker there, or not a shard: placed anew, the map entry moved
                    modes[cp] = "m"
        by_shard = await read_load(r, self.keys, range(shards))
        load = [by_shard[k] for k in range(shards)]

        local: dict[bytes, int] = {}  # decided in this burst (claims and moves)
        placed: list[Placed] = []
        for it, plan in zip(items, plans, strict=True):
            shard, depth = -1, 0
            for i, cp in reversed(plan.cps):
                hit = local.get(cp, known.get(cp))
                if hit is not None:
                    shard, depth = hit, i + 1
                    break
            if shard >= 0 and depth * it.block_tokens < self.s.affinity_min_match * it.tokens:
                shard, depth = -1, 0  # only a short common head (an instruction): a new group
            if shard >= 0 and self._guard(load, live, shard):
                target = min(live, key=lambda k: (load[k], k))
                self._record_move(plan, shard, target, load)
                for _, cp in plan.cps[: self._depth_index(plan, depth)]:
                    local[cp] = target
                    modes[cp] = "m"
                shard, depth = target, 0
            if shard < 0:
                shard = min(live, key=lambda k: (load[k], k))
            cached = self._cached_tokens(it, depth)
            for _, cp in plan.cps:
                if cp not in local and cp not in known:
                    local[cp] = shard
                    modes.setdefault(cp, "n")
                    plan.claims.append(cp)
            plan.shard, plan.matched = shard, depth
            work = max(0, it.tokens - cached)
            load[shard] += work
            placed.append(Placed(shard, work, cached, self._anchor(it)))

        cps, anchors = [p.cps for p in plans], [pl.anchor for pl in placed]
        for it, pl, (ancestor, depth) in zip(
            items, placed, self.ancestry.mark(items, cps, anchors), strict=True
        ):
            tokens = self._cached_tokens(it, depth)  # whole engine blocks, as a prefix hit
            if ancestor is not None and tokens > 0:
                pl.ancestor, pl.ancestor_tokens = ancestor, tokens
        stored = await self._claim(r, local, modes, [cp for cp in unique if cp not in local])
        # a racing producer claimed some checkpoints first: their requests follow the winner
        lost = {cp: v for cp, v in stored.items() if modes.get(cp) == "n" and v != local[cp]}
        follow: dict[bytes, int] = {}
        if lost:
            for plan, pl in zip(plans, placed, strict=True):
                winner = next((lost[cp] for _, cp in plan.cps if cp in lost), None)
                if winner is None or winner == pl.shard:
                    continue
                pl.shard, pl.predicted_cached = winner, 0
                follow.update({cp: winner for cp in plan.claims if cp not in lost})
            log.info("prefix race: %d checkpoints owned by another producer", len(lost))
        if follow:
            await self._claim(r, follow, dict.fromkeys(follow, "m"), [])
        await self._record(r)
        return placed

    def _anchor(self, item: Item) -> bytes | None:
        """The checkpoint that ends ``item``'s shared prefix (one of its `checkpoints`)."""
        n = len(item.blocks)
        if not (item.prefix_blocks and n):
            return None
        return _cp(item.blocks[min(item.prefix_blocks, n) - 1])

    def _depth_index(self, plan: _Plan, depth: int) -> int:
        return sum(1 for i, _ in plan.cps if i < depth)

    def _guard(self, load: list[float], live: list[int], shard: int) -> bool:
        low = min(load[k] for k in live)
        return (
            load[shard] - low > self.s.guard_margin_tokens
            and load[shard] > self.s.guard_factor * low
        )

    def _cached_tokens(self, it: Item, depth: int) -> int:
        if depth <= 0:
            return 0
        tokens = min(depth * it.block_tokens, it.tokens - 1)
        eb = self.engine_block
        return int(tokens // eb * eb)

    def _record_move(self, plan: _Plan, src: int, dst: int, load: list[float]) -> None:
        anchor = plan.cps[-1][1].hex() if plan.cps else ""
        self.moves.append(
            {
                "anchor": anchor,
                "from": src,
                "to": dst,
                "at": time.time(),
                "load_from": round(load[src]),
                "load_to": round(load[dst]),
            }
        )
        log.info(
            "load guard: prefix group %s moved from shard %d (%d tok) to %d (%d tok)",
            anchor,
            src,
            load[src],
            dst,
            load[dst],
        )

    async def _claim(
        self,
        r: aredis.Redis,
        local: dict[bytes, int],
        modes: dict[bytes, str],
        touched: list[bytes],
    ) -> dict[bytes, int]:
        return await claim(r, self.keys, self.s.map_max_entries, local, modes, touched)

    async def _record(self, r: aredis.Redis) -> None:
        """Add the moves decided since the last call to the moves stream (a burst is placed in
        chunks; each move is recorded once)."""
        if len(self.moves) <= self._recorded:
            return
        pipe = r.pipeline(transaction=False)
        add_moves(pipe, self.keys, self.moves[self._recorded :])
        await pipe.execute()
        self._recorded = len(self.moves)
