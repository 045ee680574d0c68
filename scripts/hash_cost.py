"""How much of a burst's enqueue time goes to block hashing (the reuse burst of `prefixq bench`).

Run against a Redis you can write to: `REDIS_URL=redis://127.0.0.1:6379/7 python scripts/hash_cost.py`.
"""

import os
import asyncio, time, secrets
from prefixq.bench.workloads import build, Shape
from prefixq.producer.producer import normalize
from prefixq.producer import Producer
from prefixq.producer.items import ItemBuilder
from prefixq.entries import split_prefix
from prefixq.settings import Settings

for label, shape in (("text", Shape()), ("token-ids", Shape(token_ids=True, vocab=128256))):
    s = Settings(
        redis_url=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
        namespace="hc" + secrets.token_hex(2),
        shards=2,
    )
    dicts, _ = build("reuse", requests=256, questions=4, shape=shape)
    reqs = normalize(dicts, s)
    b = ItemBuilder(s)
    t = time.perf_counter()
    for _ in range(5):
        items = [b.build(q, split_prefix(q)[0]) for q in reqs]
    hash_s = (time.perf_counter() - t) / 5
    p = Producer(s)

    async def sub():
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            await p.asubmit(reqs)
            ts.append(time.perf_counter() - t)
        return min(ts)

    sub_s = asyncio.run(sub())
    print(
        f"{label}: 256 requests, block hashing {hash_s * 1e3:.1f} ms of submit {sub_s * 1e3:.1f} ms ({hash_s / sub_s:.0%})"
    )
