"""An elastic fleet on real parts (issue 31): real `prefixq worker` processes with the vLLM CPU
engine, a real redis-server, workers killed with -9 and started mid-burst.

- a worker lost for good: its shard's queue moves to the live worker by itself and the burst ends
  with every result exactly once;
- a worker that joins (`--join`) takes a shard, whole groups from the backlogged one, and serves
  a share of the burst.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from helpers import kill_tree
from prefixq.client import Producer
from prefixq.core import wire
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.ops import stats

pytestmark = [pytest.mark.engine, pytest.mark.slow]

#: seconds a worker's heartbeat lives (and the orphan threshold) in these tests
TTL_S = 3.0
ORPHAN_S = 6.0


def _burst(docs: int, per_doc: int, max_tokens: int) -> list[dict[str, Any]]:
    out = []
    for d in range(docs):
        sections = " ".join(f"Section {d}.{i} says item {i * d} holds." for i in range(40))
        doc = f"Report {d}. {sections}"
        for q in range(per_doc):
            out.append(
                {
                    "id": f"d{d}-q{q}",
                    "prefix": doc,
                    "prompt": f"Question {q}: what does section {d}.{q} say?",
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                    "ignore_eos": True,
                }
            )
    return out


def _results(r: redis.Redis, s: Settings, burst: str) -> dict[int, dict[str, Any]]:
    raw = r.hgetall(Keys(s.namespace).results(burst))
    return {int(k): wire.decode(v) for k, v in raw.items()}


def _wait_done(r: redis.Redis, s: Settings, burst: str, total: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(_results(r, s, burst)) < total:
        if time.monotonic() > deadline:
            raise AssertionError(f"{len(_results(r, s, burst))}/{total} results after {timeout}s")
        time.sleep(0.5)


def _settings(redis_url: str, shards: int) -> Settings:
    return Settings(
        redis_url=redis_url,
        namespace=f"fleet{secrets.token_hex(3)}",
        shards=shards,
        heartbeat_s=0.5,
        heartbeat_ttl_s=TTL_S,
        orphan_after_s=ORPHAN_S,
        claim_idle_s=10.0,
        grace_s=30.0,
    )


def _extra() -> list[str]:
    return [
        "--heartbeat-ttl-s",
        str(TTL_S),
        "--orphan-after-s",
        str(ORPHAN_S),
        "--max-inflight",
        "16",
    ]


def test_a_worker_lost_for_good_has_its_queue_moved_and_the_burst_ends_exactly_once(
    redis_server: Any, start_worker: Callable[..., Any], r: redis.Redis
) -> None:
    """Given 2 shards served by 2 real workers and a burst of 120 requests over 24 documents,
    when worker 1 and its engine are killed with -9 after 25 results and never restarted, then
    worker 0 takes shard 1's queue (whole documents), the burst ends by itself with 120 results,
    each exactly once and none failed, and the moves stream says why."""
    s = _settings(redis_server.url, 2)
    w0 = start_worker(s, shard=0, name="fleet-a", extra=_extra())
    w1 = start_worker(s, shard=1, name="fleet-b", extra=_extra())
    w0.wait_up()
    w1.wait_up()
    burst = Producer(s).submit(_burst(24, 5, 8))
    deadline = time.monotonic() + 300
    while len(_results(r, s, burst.id)) < 25:
        assert time.monotonic() < deadline, "no 25 results"
        time.sleep(0.2)
    killed_at = time.monotonic()
    kill_tree(w1.proc.pid)
    _wait_done(r, s, burst.id, 120, timeout=300)
    took = time.monotonic() - killed_at
    got = _results(r, s, burst.id)
    assert sorted(got) == list(range(120))
    errors = [res.error for res in burst.collect() if res.error]
    assert errors == [], errors
    status = burst.wait(timeout=30)
    assert (status.done, status.failed) == (120, 0)
    moves = r.xrange(Keys(s.namespace).moves)
    orphaned = [f for _, f in moves if f.get(b"why") == b"orphaned"]
    assert orphaned and {f[b"from"] for f in orphaned} == {b"1"}
    assert {f[b"to"] for f in orphaned} == {b"0"}
    # worker 0 served its own 60 and what moved off shard 1
    on_zero = sum(1 for res in burst.collect() if res.shard == 0)
    moved = sum(int(f[b"requests"]) for f in orphaned)
    assert moved > 0 and on_zero >= moved, (on_zero, moved)
    print(f"kill -> last result: {took:.1f}s; moved {len(orphaned)} groups; shard 0 ran {on_zero}")


def test_a_worker_that_joins_mid_burst_takes_a_share_of_it(
    redis_server: Any, start_worker: Callable[..., Any], r: redis.Redis
) -> None:
    """Given one shard served by one real worker (2 requests at a time: a slow GPU) and a burst of
    80 requests over 20 documents, when a second worker starts with --join once the first
    results are in, then the shard count grows to 2, the new worker takes whole not-yet-started
    documents from shard 0 (steals) and serves them, every result once. (Each
    engine on a core of its own: vLLM's CPU engine binds its threads to core 0 by default.)"""
    s = _settings(redis_server.url, 1)
    slow = [*_extra(), "--max-inflight", "2"]
    w0 = start_worker(s, shard=0, name="join-a", extra=slow, env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    w0.wait_up()
    # answers long enough that the one worker is still busy when the joiner's engine is up (~30 s
    # on this machine): with 8-token answers it finished the burst first, and nothing was left.
    # (the joiner served 32 of these 80 alone on 2 cores, 104 s; 12 of 64 with its core at a
    # third of its speed: so 80, not 64)
    burst = Producer(s).submit(_burst(20, 4, 32))
    deadline = time.monotonic() + 300
    while not _results(r, s, burst.id):
        assert time.monotonic() < deadline, "no result"
        time.sleep(0.2)
    joiner = start_worker(
        s,
        name="join-b",
        # a CPU burst is small: steal while a few documents' prefill is left, not 4,096 tokens
        # (the default, sized for GPUs: on a loaded machine the joiner came up after w0 was
        # within that of the end, and took nothing)
        extra=[*_extra(), "--join", "--steal-min-tokens", "512"],
        env={"VLLM_CPU_OMP_THREADS_BIND": "1"},
    )
    _wait_done(r, s, burst.id, 80, timeout=480)
    assert joiner.proc.poll() is None, joiner.tail()
    got = _results(r, s, burst.id)
    assert sorted(got) == list(range(80))
    assert r.hget(Keys(s.namespace).config, "shards") == b"2"
    by_shard: dict[int, int] = {}
    for res in burst.collect():
        by_shard[res.shard] = by_shard.get(res.shard, 0) + 1
    print(f"results by shard: {by_shard}")
    # whole documents: at least two of them (4 questions each); the share itself (23% of the
    # burst here on a loaded 2-core machine; the target is 25%) is measured, not asserted
    assert by_shard.get(1, 0) >= 8, by_shard
    moves = [f for _, f in r.xrange(Keys(s.namespace).moves) if f.get(b"why") == b"steal"]
    assert moves and {f[b"to"] for f in moves} == {b"1"}
    # each worker's share, as inspect and the dashboard read it (the burst's record)
    assert stats.burst_stats(r, s, burst.id)["workers"] == {
        n: c for n, c in (("join-a", by_shard.get(0, 0)), ("join-b", by_shard[1])) if c
    }
