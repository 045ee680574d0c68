"""Placement by task: a burst goes only to the shards that serve its kind of work (`for_task`).

Each worker records what its shard serves (`Keys.tasks`: ``generate`` or ``embed``,
store/liveness.py). A burst holds one kind (`Request.task`), and its placer sees only the shards of
that kind:

- an embeddings burst goes to the live embed shards by load (`LoadPlacer`): its inputs are
  distinct texts, and a pooling request keeps no KV cache for later requests, so there is no prefix
  to follow (a placement other than affinity, or a `Placer` of your own, is kept, on those shards);
- a generation burst keeps its placer; where some shards embed, the affinity placer skips them
  (``among``) and any other placer is mapped onto the generate shards (`ServingPlacer`).

No shard of the burst's kind is a `ValidationError` before anything is written: work no worker
could serve is never queued.
"""

from __future__ import annotations

import time

import redis.asyncio as aredis

from prefixq.affinity.placement import Item, Placed, Placer
from prefixq.affinity.prefix_map import AffinityPlacer
from prefixq.core.errors import ValidationError
from prefixq.core.settings import Settings
from prefixq.store.liveness import alive_mask, read_load

__all__ = ["LoadPlacer", "ServingPlacer", "for_task"]


class ServingPlacer:
    """``inner`` placing over ``allowed`` alone: its shard i is ``allowed[i]``."""

    def __init__(self, inner: Placer, allowed: list[int]) -> None:
        self.inner, self.allowed = inner, allowed

    async def place(self, r: aredis.Redis, items: list[Item], shards: int) -> list[Placed]:
        placed = await self.inner.place(r, items, len(self.allowed))
        for p in placed:
            p.shard = self.allowed[p.shard]
        return placed


class LoadPlacer:
    """Each request to the live shard of ``allowed`` with the least estimated outstanding work
    (`Keys.load`, plus what this burst placed so far)."""

    def __init__(self, settings: Settings, allowed: list[int]) -> None:
        self.s, self.allowed = settings, allowed

    async def place(self, r: aredis.Redis, items: list[Item], shards: int) -> list[Placed]:
        keys = self.s.keys
        raw_live = await r.hgetall(keys.live)
        alive = alive_mask(raw_live, shards, self.s.heartbeat_ttl_s, time.time(), self.allowed)
        live = [k for k in self.allowed if alive[k]]
        load = await read_load(r, keys, live)
        out = []
        for it in items:
            k = min(live, key=lambda k: (load[k], k))
            load[k] += it.tokens
            out.append(Placed(k, it.tokens))
        return out


def for_task(placer: Placer, task: str, tasks: list[str], settings: Settings) -> Placer:
    """The placer of a burst of ``task`` given what each shard serves (``tasks``)."""
    allowed = [k for k, t in enumerate(tasks) if t == task]
    if not allowed:
        hint = " (prefixq worker --task embed, or PREFIXQ_TASK=embed)" if task == "embed" else ""
        raise ValidationError(
            f"no shard of namespace {settings.namespace!r} serves {task}: its shards serve "
            f"{', '.join(sorted(set(tasks)))}; start a worker that serves {task}{hint}"
        )
    if task == "embed" and isinstance(placer, AffinityPlacer):
        return LoadPlacer(settings, allowed)
    if len(allowed) == len(tasks):
        return placer
    if isinstance(placer, AffinityPlacer):
        placer.among = allowed
        return placer
    return ServingPlacer(placer, allowed)
