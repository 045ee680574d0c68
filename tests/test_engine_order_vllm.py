"""Fair shares inside the real vLLM CPU engine (worker/engine_order.py): three tenants' bursts
that each fit the worker's window arrive apart; vLLM's priority queue serves them in turn, so
while all three have work their completions stay within 20% of each other (the bound of
docs/BENCHMARKS.md, measured as `prefixq bench` does: bench/measures.py `shares`)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from helpers import wait_burst, wait_until
from prefixq.bench.measures import shares
from prefixq.cli.redis_server import RedisServer
from prefixq.client import Producer
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings

pytestmark = pytest.mark.engine

SEQS = 4  # the engine runs 4 at a time; each burst of 32 waits in it in 8 rounds
PER_BURST = 32


def burst(tag: str) -> list[dict[str, Any]]:
    return [
        {
            "id": f"{tag}{i}",
            "prompt": f"Request {tag}{i}: count from one to forty in words:",
            "max_tokens": 12 + i % 5,
            "ignore_eos": True,
        }
        for i in range(PER_BURST)
    ]


def test_three_bursts_inside_the_engine_complete_within_20_percent_of_each_other(
    redis_server: RedisServer, start_worker: Callable[..., Any]
) -> None:
    """Given a `prefixq worker` (vLLM on the CPU, max_num_seqs 4) whose window holds all three
    bursts of 32, when tenant A's burst arrives, then B's one service time later (as observed:
    A's first completion) and C's after another, then from C's arrival to the first burst's end
    the three complete within 20% of each other (first come, first served: A's all, none of C's)."""
    s = Settings(redis_url=redis_server.url, namespace=f"eo{secrets.token_hex(3)}", shards=1)
    extra = ["--max-inflight", str(3 * PER_BURST), "--engine-arg", f"max_num_seqs={SEQS}"]
    start_worker(s, name="order-w", extra=extra).wait_up()
    r = redis.Redis.from_url(s.redis_url)
    keys = Keys(s.namespace)
    try:
        p, arrived, ids = Producer(s), [time.time()], []
        ids.append(p.submit(burst("a"), tenant="ta"))
        wait_until(lambda: r.hlen(keys.results(ids[0])) >= 1, 120, "A's first completion")
        gap = time.time() - arrived[0]  # one service time, as observed
        for tag in ("b", "c"):
            if tag == "c":
                time.sleep(max(0.0, arrived[-1] + gap - time.time()))
            arrived.append(time.time())
            ids.append(p.submit(burst(tag), tenant=f"t{tag}"))
        results = [wait_burst(r, s, b, 300) for b in ids]
    finally:
        r.close()
    burst_of = [k for k, res in enumerate(results) for _ in res]
    done = [x.timings.finished for res in results for x in res]
    t0 = arrived[0]
    got = shares(burst_of, [t - t0 for t in done], [t - t0 for t in arrived])
    assert got is not None
    print(f"  gap {gap:.2f}s; while all had work {got}")
    start, end = got["window_s"]
    assert end > start, f"the bursts did not overlap: {got}"
    assert min(got["completed"]) > 0, f"a burst completed nothing while all had work: {got}"
    assert sum(got["completed"]) >= PER_BURST, f"too short a window to judge: {got}"
    assert got["ratio"] <= 1.2, f"completions while all had work: {got}"
