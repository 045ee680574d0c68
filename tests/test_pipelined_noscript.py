"""Scripts called in pipelines survive a script cache emptied again and again
(store/pipelined_script.py): calls refused with NOSCRIPT are sent again once the script is loaded
again, and those refused again with the script's text (EVAL never answers NOSCRIPT). Each call
runs exactly once: a refused call ran nothing. (Before, a NOSCRIPT that outlasted five loads stayed
in the replies: the recording of results and the acks of entries, worker/shard.py, then failed.)"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence

import redis

from prefixq.cli.redis_server import RedisServer
from prefixq.core.settings import Settings
from prefixq.store.connection import async_client
from prefixq.store.pipelined_script import PipelinedScript
from redis_cluster import RedisCluster

INCR = "return redis.call('INCR', KEYS[1])"
#: pipelines run, and calls in each (on keys of several slots)
ROUNDS, CALLS = 150, 8


def _run(s: Settings, nodes: Sequence[redis.Redis], counter: redis.Redis) -> None:
    done = threading.Event()
    flushes = [0]

    def flush() -> None:
        while not done.is_set():
            for n in nodes:
                n.script_flush()
            flushes[0] += 1

    async def calls() -> list[object]:
        r = async_client(s)
        script = PipelinedScript(r, INCR, "incr")
        replies: list[object] = []
        try:
            for _ in range(ROUNDS):
                calls = [([f"pq-noscript:{{k{i}}}"], []) for i in range(CALLS)]
                replies += await script.run(calls)
        finally:
            await r.aclose()
        return replies

    t = threading.Thread(target=flush, daemon=True)
    t.start()
    try:
        replies = asyncio.run(calls())
    finally:
        done.set()
        t.join(5)
    assert flushes[0] >= 20
    errors = [x for x in replies if isinstance(x, BaseException)]
    assert not errors, errors[:3]
    counts = [int(counter.get(f"pq-noscript:{{k{i}}}") or 0) for i in range(CALLS)]
    assert counts == [ROUNDS] * CALLS  # every call ran once: none lost, none twice


def test_pipelined_calls_survive_a_script_cache_flushed_in_a_tight_loop(
    make_settings: Callable[..., Settings], redis_server: RedisServer, r: redis.Redis
) -> None:
    s = make_settings()
    r.delete(*[f"pq-noscript:{{k{i}}}" for i in range(CALLS)])
    _run(s, [redis.Redis.from_url(redis_server.url)], r)


def test_pipelined_calls_on_a_cluster_whose_masters_flush_their_caches(
    cluster: RedisCluster, cluster_settings: Callable[..., Settings], cr: redis.Redis
) -> None:
    s = cluster_settings()
    for i in range(CALLS):
        cr.delete(f"pq-noscript:{{k{i}}}")
    _run(s, [m.client() for m in cluster.live_masters()], cr)
