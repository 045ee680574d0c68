"""Placement strategies: which shard each request of a burst goes to.

Every strategy sees the same `Item` per request (its chained block hashes and token estimate) and
returns a `Placed` (shard, estimated uncached prompt tokens, predicted cached tokens).
``affinity`` (the default, in affinity/prefix_map.py) shares a prefix map in Redis; the others are
baselines for the benchmark: ``hash`` (first block), ``random`` and ``round-robin``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aredis


@dataclass(slots=True)
class Item:
    """What placement sees of one request."""

    #: chained hashes of the request's whole blocks (prefix first)
    blocks: list[int]
    #: estimated prompt tokens
    tokens: int
    #: tokens one block stands for (block_size, or the estimate for a character block)
    block_tokens: float
    #: blocks that belong to the shared prefix (the rest are the request's own)
    prefix_blocks: int
    #: a hash of the whole prompt, for prompts shorter than one block
    key: int


@dataclass(slots=True)
class Placed:
    """Where one request goes and what it is expected to cost there."""

    shard: int
    work: int
    predicted_cached: int = 0
    #: the checkpoint that ends the request's shared prefix (its prefix group; affinity only)
    anchor: bytes | None = None
    #: the deepest checkpoint its group shares with other groups, and its tokens (affinity only:
    #: affinity/ancestors.py)
    ancestor: int | None = None
    ancestor_tokens: int = 0


class Placer(Protocol):
    """A placement strategy."""

    async def place(self, r: aredis.Redis, items: list[Item], shards: int) -> list[Placed]:
        """One `Placed` per item, in order. A burst is placed in chunks, in enqueue order: one
        call per chunk, on the same placer (it may carry state from one chunk to the next)."""
        ...


class HashPlacer:
    """Shard = hash of the first block: same document, same shard; blind to load."""

    async def place(self, r: aredis.Redis, items: list[Item], shards: int) -> list[Placed]:
        return [Placed((it.blocks[0] if it.blocks else it.key) % shards, it.tokens) for it in items]


class RandomPlacer:
    """Uniformly random shards (the benchmark's no-affinity baseline)."""

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)

    async def place(self, r: aredis.Redis, items: list[Item], shards: int) -> list[Placed]:
        return [Placed(self.rng.randrange(shards), it.tokens) for it in items]


class RoundRobinPlacer:
    """Shards in turn, by enqueue order (across the chunks of a burst)."""

    def __init__(self) -> None:
        self.next = 0

    async def place(self, r: aredis.Redis, items: list[Item], shards: int) -> list[Placed]:
        start, self.next = self.next, self.next + len(items)
        return [Placed((start + i) % shards, it.tokens) for i, it in enumerate(items)]
