"""The shards' rolling history (worker/history.py writes it, ops/history.py reads it) on a real
Redis: its bound, what a sample holds, and how the reader puts samples into steps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import redis

from helpers import FakeWorker, requests, wait_burst, wait_until
from prefixq.client import Producer
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.ops.history import series
from prefixq.store.connection import async_client
from prefixq.worker.history import MAXLEN, History
from prefixq.worker.shard import ShardStream

#: docs/dashboard.md: "about 52 bytes a sample" (Redis's MEMORY USAGE of a full stream)
BYTES_PER_SAMPLE = 60


def health(finished: int = 0, failed: int = 0, admitted: int = 0, inflight: int = 0) -> Any:
    return {"finished": finished, "failed": failed, "admitted": admitted, "inflight": inflight}


def beats(s: Settings, calls: list[tuple[float, dict[str, Any]]], name: str = "w0") -> None:
    """``History.beat(now, health)`` for each call, on a fresh client (the worker's view)."""

    async def main() -> None:
        r = async_client(s)
        try:
            h = History(ShardStream(r, s, 0, name), every_s=s.history_every_s, now=calls[0][0])
            for now, fields in calls:
                await h.beat(now, fields)
        finally:
            await r.aclose()

    asyncio.run(main())


def test_the_history_stream_is_capped_at_maxlen_samples_of_about_50_bytes(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Given more samples than the cap, the shard's history holds exactly `MAXLEN`, the newest,
    and a full stream takes at most `BYTES_PER_SAMPLE` bytes a sample in Redis."""
    s = make_settings(history_every_s=1.0)
    t0 = 1_700_000_000.0
    calls = [
        (t0 + i, health(finished=3 * i, admitted=3 * i, inflight=i % 5))
        for i in range(MAXLEN + 300)
    ]
    beats(s, calls)
    key = Keys(s.namespace).history(0)
    assert r.xlen(key) == MAXLEN
    newest = r.xrevrange(key, count=1)[0][1]
    assert newest[b"d"] == b"3" and newest[b"e"] == str((MAXLEN + 299) % 5).encode()
    size = r.memory_usage(key, samples=0)
    assert size / MAXLEN <= BYTES_PER_SAMPLE, size / MAXLEN


def test_a_sample_holds_the_shards_queue_and_the_workers_counts_since_its_last_one(
    settings: Settings, r: redis.Redis
) -> None:
    """Given 7 requests waiting on the shard (no worker), a sample says 7 waiting, 0 pending;
    samples come only every ``history_every_s`` and carry deltas of the counters."""
    s = settings.replace(history_every_s=5.0)
    Producer(s).submit(requests(7))
    t0 = 1_700_000_000.0
    beats(
        s,
        [
            (t0, health()),
            (t0 + 2, health(finished=4)),  # not due: no sample
            (t0 + 5, health(finished=4, failed=1, admitted=6, inflight=2)),
            (t0 + 11, health(finished=9, failed=1, admitted=7, inflight=0)),
        ],
    )
    rows = [f for _, f in r.xrange(Keys(s.namespace).history(0))]
    assert len(rows) == 2
    first, second = ({k.decode(): v.decode() for k, v in f.items()} for f in rows)
    assert first == {
        "w": "w0",
        "q": "7",
        "p": "0",
        "e": "2",
        "s": "5",
        "d": "4",
        "f": "1",
        "a": "6",
    }
    assert (second["d"], second["f"], second["a"], second["s"]) == ("5", "0", "1", "6")


def test_counts_a_refused_sample_did_not_record_go_into_the_next(
    settings: Settings, r: redis.Redis
) -> None:
    """Given a sample Redis refuses (the key is not a stream), the next sample after the key
    is fixed carries the requests of both periods."""
    s = settings.replace(history_every_s=1.0)
    key = Keys(s.namespace).history(0)
    r.set(key, "not a stream")
    t0 = 1_700_000_000.0

    async def main() -> None:
        c = async_client(s)
        try:
            h = History(ShardStream(c, s, 0, "w0"), every_s=1.0, now=t0)
            try:
                await h.beat(t0 + 1, health(finished=3))
                raise AssertionError("the sample should have been refused")
            except redis.ResponseError:
                pass
            await c.delete(key)
            await h.beat(t0 + 2, health(finished=5))
        finally:
            await c.aclose()

    asyncio.run(main())
    ((_, f),) = r.xrange(key)
    assert (f[b"d"], f[b"s"]) == (b"5", b"2")


def test_series_puts_samples_into_steps_per_shard_and_in_total(
    settings: Settings, r: redis.Redis
) -> None:
    """Given samples of two workers on shard 0 and one on shard 1 at known times, each step
    shows the last queue figures, the engines summed per worker, and requests per second;
    a step without samples is null, and the total adds the shards where one has a value."""
    keys = Keys(settings.namespace)
    t0 = 1_700_000_000  # steps of 10 s from t0
    for shard, t, fields in [
        (0, t0 + 1, {"w": "a", "q": 9, "p": 2, "e": 2, "d": 10, "f": 0, "a": 10, "s": 5}),
        (0, t0 + 3, {"w": "b", "q": 8, "p": 3, "e": 1, "d": 20, "f": 1, "a": 20, "s": 5}),
        (0, t0 + 6, {"w": "a", "q": 7, "p": 3, "e": 3, "d": 10, "f": 0, "a": 10, "s": 5}),
        (1, t0 + 4, {"w": "c", "q": 1, "p": 0, "e": 0, "d": 5, "f": 0, "a": 5, "s": 5}),
        (1, t0 + 25, {"w": "c", "q": 0, "p": 0, "e": 0, "d": 30, "f": 2, "a": 5, "s": 5}),
    ]:
        r.xadd(keys.history(shard), fields, id=f"{t * 1000}-0")  # type: ignore[arg-type]
    got = series(r, keys, 2, window_s=30, step_s=10, now=t0 + 30)
    assert got["t"] == [t0, t0 + 10, t0 + 20] and got["step_s"] == 10
    s0, s1 = got["shards"]
    assert s0["waiting"] == [7, None, None] and s0["pending"] == [3, None, None]
    assert s0["in_engine"] == [4, None, None]  # a's last (3) + b's (1)
    assert s0["done_per_s"] == [4.0, None, None] and s0["failed_per_s"] == [0.1, None, None]
    assert s1["waiting"] == [1, None, 0] and s1["done_per_s"] == [0.5, None, 3.0]
    assert got["total"]["waiting"] == [8, None, 0]
    assert got["total"]["done_per_s"] == [4.5, None, 3.0]


def test_a_worker_samples_its_shard_with_its_heartbeat(
    make_settings: Callable[..., Settings],
    fake_worker: Callable[..., FakeWorker],
    r: redis.Redis,
) -> None:
    """Given a fake-engine worker sampling every 0.2 s, a burst of 12 requests shows up in the
    history as 12 finished (summed over its samples) and the queue drained."""
    s = make_settings(heartbeat_s=0.1, history_every_s=0.2)
    fake_worker(s, name="h0")
    burst = Producer(s).submit(requests(12))
    wait_burst(r, s, burst, 20)
    key = Keys(s.namespace).history(0)

    def finished() -> int:
        return sum(int(f[b"d"]) for _, f in r.xrange(key))

    wait_until(lambda: finished() == 12, 10, "12 finished requests in the history")
    last = r.xrevrange(key, count=1)[0][1]
    assert (last[b"w"], last[b"q"]) == (b"h0", b"0")
