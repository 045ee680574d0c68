"""``prefixq handover`` and ``prefixq worker --join``: the operator's side of an elastic fleet
(worker/handover.py moves a shard's queue; store/deployment.py picks a joining worker's shard).
"""

from __future__ import annotations

import argparse
import asyncio
import json

from prefixq.core.errors import ConfigError
from prefixq.core.settings import Settings


def join_shard(settings: Settings) -> int:
    """The shard a worker started with ``--join`` serves (held for it while its engine starts)."""
    from prefixq.store.connection import async_client
    from prefixq.store.deployment import ajoin_shard

    async def pick() -> int:
        r = async_client(settings)
        try:
            return await ajoin_shard(r, settings)
        finally:
            await r.aclose()

    return asyncio.run(pick())


def cmd_handover(args: argparse.Namespace, settings: Settings) -> int:
    """Move a shard's queued work (never delivered, or pending on dead workers) to the live
    shards now, whole prefix groups at a time."""
    from prefixq.store.connection import async_client
    from prefixq.store.deployment import aresolve_shards
    from prefixq.worker.handover import Handover, MoveReport

    async def move() -> MoveReport:
        r = async_client(settings)
        try:
            shards = await aresolve_shards(r, settings)
            if not 0 <= args.shard < shards:
                raise ConfigError(
                    f"shard {args.shard} does not exist (namespace has shards 0..{shards - 1})"
                )
            handover = Handover(r, settings, name="prefixq-handover")
            return await handover.move_shard(args.shard, shards, why="operator")
        finally:
            await r.aclose()

    rep = asyncio.run(move())
    if args.json:
        print(json.dumps(rep.to_json(), indent=2))
        return 0 if not rep.skipped else 1
    if rep.skipped:
        print(f"shard {args.shard}: nothing moved: {rep.skipped}")
        return 1
    to = ", ".join(f"{n} to shard {k}" for k, n in sorted(rep.moved.items())) or "nothing queued"
    print(
        f"shard {args.shard}: moved {rep.requests} requests in {rep.groups} prefix groups "
        f"({rep.tokens} prompt tokens): {to}; {rep.raced} groups taken by a worker meanwhile"
    )
    return 0
