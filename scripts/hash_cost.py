"""How much of a burst's enqueue time goes to block hashing (the reuse burst of `prefixq bench`).

Writes to the Redis at REDIS_URL (default redis://127.0.0.1:6379/0), in throwaway namespaces:
    REDIS_URL=redis://127.0.0.1:6379/7 python scripts/hash_cost.py
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time

from prefixq.bench.workloads import Shape, Sizes, build
from prefixq.client import Producer
from prefixq.client.items import ItemBuilder
from prefixq.core.entries import split_prefix
from prefixq.core.inputs import normalize
from prefixq.core.records import Request
from prefixq.core.settings import Settings

ROUNDS = 5


async def best_submit(producer: Producer, reqs: list[Request]) -> float:
    times = []
    for _ in range(ROUNDS):
        t = time.perf_counter()
        await producer.asubmit(reqs)
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    for label, shape in (("text", Shape()), ("token-ids", Shape(token_ids=True, vocab=128_256))):
        s = Settings(redis_url=url, namespace=f"hashcost-{secrets.token_hex(3)}", shards=2)
        reqs = normalize(build("reuse", shape, Sizes(documents=64, questions=4)).requests, s)
        builder = ItemBuilder(s)
        t = time.perf_counter()
        for _ in range(ROUNDS):
            for q in reqs:
                builder.build(q, split_prefix(q)[0])
        hashing = (time.perf_counter() - t) / ROUNDS
        submit = asyncio.run(best_submit(Producer(s), reqs))
        print(
            f"{label}: 256 requests, block hashing {hashing * 1e3:.1f} ms of submit "
            f"{submit * 1e3:.1f} ms ({hashing / submit:.0%})"
        )


if __name__ == "__main__":
    main()
