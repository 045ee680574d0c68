"""`prefixq inspect`'s numbers (prefixq/ops/stats.py): bounded cost per burst, a self-pruning burst
index, and in-flight counts that agree with the results."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from helpers import cli, wait_until
from prefixq.cli.redis_server import RedisServer
from prefixq.client import Producer, results
from prefixq.core.errors import BurstRecordLost
from prefixq.core.keys import GROUP
from prefixq.core.records import Result, Timings
from prefixq.core.settings import Settings
from prefixq.ops import stats
from prefixq.store.burst_end import cancel
from prefixq.store.connection import lua
from prefixq.store.scripts import record_call


@pytest.fixture
def quiet_server() -> Iterator[RedisServer]:
    """A private redis-server whose traffic counters only this test moves."""
    with RedisServer() as srv:
        yield srv


def recorded_burst(r: redis.Redis, s: Settings, n: int) -> str:
    """A burst of ``n`` requests submitted by the Producer, each result recorded by the record
    script as a worker's writer does (about 300 bytes of text each)."""
    burst = Producer(s).submit([{"id": f"q{i}", "prompt": f"p {i}"} for i in range(n)])
    script = r.register_script(lua("record_result"))
    keys = s.keys
    now = time.time()
    pipe = r.pipeline(transaction=False)
    for i in range(n):
        res = Result(
            id=f"q{i}",
            index=i,
            text="answer " * 40 + str(i),
            prompt_tokens=10,
            output_tokens=41,
            timings=Timings(now - 3, now - 2 + i / n, now - 1.5, now - 1 + i / n),
        )
        res.cached_tokens = res.predicted_cached_tokens = 4
        rkeys, args = record_call(keys, burst, [(res, 0.0)], s, repr(now))
        script(keys=rkeys, args=args, client=pipe)
    pipe.execute()
    return burst


def bytes_out(r: redis.Redis) -> int:
    return int(r.info("stats")["total_net_output_bytes"])


def test_inspect_reads_a_bounded_sample_of_a_large_burst(
    quiet_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`snapshot` of a burst of 5,000 results decodes at most `SAMPLE` of them and Redis sends
    about as many bytes as for a burst of 1,000; the JSON says how many were sampled, and the
    counts and tokens still cover every result (the burst's record)."""
    s = Settings(redis_url=quiet_server.url, namespace="big", shards=1)
    r = redis.Redis.from_url(s.redis_url)
    decoded: list[int] = []
    real = Result.from_wire

    def counting(d: Any) -> Result:
        decoded.append(1)
        return real(d)

    monkeypatch.setattr(Result, "from_wire", staticmethod(counting))
    try:
        sent = {}
        for n in (stats.SAMPLE, 5 * stats.SAMPLE):
            burst = recorded_burst(r, s, n)
            decoded.clear()
            before = bytes_out(r)
            snap = stats.snapshot(s, burst=burst, client=r)
            sent[n] = bytes_out(r) - before
            (b,) = snap["bursts"]
            assert len(decoded) <= stats.SAMPLE
            assert (b["results"], b["sampled"], b["done"]) == (n, stats.SAMPLE, n)
            assert b["prompt_tokens"] == 10 * n and b["cached_tokens"] == 4 * n
            assert b["status"] == "finished" and b["end_to_end_s"]["p50"] > 0
        print(f"  bytes sent by Redis per snapshot: {sent}")
        assert sent[5 * stats.SAMPLE] < 1.5 * sent[stats.SAMPLE]
    finally:
        r.close()


def test_inspect_drops_index_entries_of_gone_bursts_a_bounded_number_per_call(
    quiet_server: RedisServer,
) -> None:
    """With 1,000 index entries whose records are gone (expired) under one live burst, a snapshot
    shows the live burst, drops the gone entries it met (the newest and the `PRUNE` oldest), and
    checks no more than that; calls repeated drain the index to the live burst."""
    s = Settings(redis_url=quiet_server.url, namespace="idx", shards=1)
    r = redis.Redis.from_url(s.redis_url)
    try:
        r.zadd(s.keys.bursts, {f"gone{i:04d}": 1_000 + i for i in range(1_000)})
        live = Producer(s).submit([{"id": "a", "prompt": "x"}])  # prunes a few itself
        before = r.zcard(s.keys.bursts)
        r.config_resetstat()
        snap = stats.snapshot(s, recent=5, client=r)
        assert [b["burst"] for b in snap["bursts"]] == [live]
        checked = int(r.info("commandstats")["cmdstat_exists"]["calls"])
        left = r.zcard(s.keys.bursts)
        print(f"  first call checked {checked} records; index {before} -> {left}")
        assert checked <= 5 + 2 * stats.PRUNE
        assert before - left == checked - 1  # every gone entry it checked, and only those
        for _ in range(20):
            stats.snapshot(s, recent=5, client=r)
        assert r.zrange(s.keys.bursts, 0, -1) == [live.encode()]
    finally:
        r.close()


def test_inspect_in_flight_is_the_consumer_groups_pending_not_a_stale_heartbeat(
    settings: Settings, r: redis.Redis, fake_worker: Callable[..., Any]
) -> None:
    """Once a burst is done, inspect shows nothing in flight or pending for the shard, although
    the worker's last heartbeat still says 3 requests were in its engine; that figure appears
    only in the worker's own row."""
    s = settings.replace(heartbeat_s=60.0, heartbeat_ttl_s=120.0)
    with fake_worker(s, name="beat0"):
        burst = Producer(s).submit([{"id": f"q{i}", "prompt": f"hi {i}"} for i in range(20)])
        results.wait(burst, s, timeout=30)
        # a result is readable just before its entry is acknowledged
        wait_until(lambda: not r.xpending(s.keys.stream(0), GROUP)["pending"], 10, "the acks")
        r.hset(s.keys.heartbeat(0, "beat0"), "inflight", 3)  # what a beat mid-burst wrote
        snap = stats.snapshot(s, burst=burst, client=r)
    (b,) = snap["bursts"]
    (shard,) = snap["shards"]
    assert b["done"] == b["total"] == 20
    assert (shard["inflight"], shard["pending"], shard["waiting"]) == (0, 0, 0)
    (w,) = shard["worker_detail"]
    assert (w["name"], w["pending"], w["inflight_at_beat"]) == ("beat0", 0, 3)


def test_inspect_shows_a_burst_with_a_lost_record_as_lost_and_the_others_as_usual(
    settings: Settings, r: redis.Redis
) -> None:
    """A recent burst whose record is incomplete is listed as lost, with why, next to a healthy
    one; asked for by id, it is an error (BurstRecordLost), not a finished burst."""
    s = settings
    lost = Producer(s).submit([{"id": "a", "prompt": "x"}])
    ok = Producer(s).submit([{"id": "b", "prompt": "y"}])
    r.delete(s.keys.burst(lost))
    r.hset(s.keys.burst(lost), "done", 1)
    snap = stats.snapshot(s, recent=5, client=r)
    by_id = {b["burst"]: b for b in snap["bursts"]}
    assert by_id[lost]["status"] == "lost" and "record is incomplete" in by_id[lost]["error"]
    assert by_id[ok]["total"] == 1 and by_id[ok]["status"] != "lost"
    with pytest.raises(BurstRecordLost):
        stats.snapshot(s, burst=lost, client=r)


def test_inspect_says_a_cancelled_burst_was_cancelled(settings: Settings, r: redis.Redis) -> None:
    """A cancelled burst is finished (every request has a result), but `inspect` showed it as
    `finished` where its record, `prefixq cancel` and the OpenAI batch say `cancelled`."""
    done = recorded_burst(r, settings, 2)
    cut = Producer(settings).submit([{"id": f"q{i}", "prompt": f"p {i}"} for i in range(3)])
    cancel(cut, settings)
    assert results.status(cut, settings).status == "cancelled"
    snap = stats.snapshot(settings, recent=5, client=r)
    by_id = {b["burst"]: b for b in snap["bursts"]}
    assert by_id[cut]["status"] == "cancelled" and by_id[cut]["failed"] == 3
    assert by_id[done]["status"] == "finished"


def test_inspect_refuses_a_negative_recent(settings: Settings) -> None:
    p = cli(settings, "inspect", "--recent", "-1", "--shards", "1")
    assert p.returncode == 2 and "--recent must be 0 to 1,000,000" in p.stderr, p.stderr


def test_inspect_says_queued_then_running_and_reads_past_an_unreadable_result(
    settings: Settings, r: redis.Redis
) -> None:
    """A burst is `queued` until its first result, then `running` (it showed `queued` while
    being served); a sampled result written over in Redis does not fail the view."""
    s = settings
    waiting = Producer(s).submit([{"id": f"w{i}", "prompt": f"p {i}"} for i in range(3)])
    served = Producer(s).submit([{"id": f"q{i}", "prompt": f"p {i}"} for i in range(3)])
    script = r.register_script(lua("record_result"))
    rkeys, args = record_call(s.keys, served, [(Result(id="q0", index=0, text="a"), 0.0)], s, "1")
    assert script(keys=rkeys, args=args) == [1]
    done = recorded_burst(r, s, 3)
    r.hset(s.keys.results(done), "1", b"\xff\xfe not a result")
    snap = stats.snapshot(s, recent=5, client=r)
    by_id = {b["burst"]: b for b in snap["bursts"]}
    assert by_id[waiting]["status"] == "queued"
    assert by_id[served]["status"] == "running" and by_id[served]["done"] == 1
    assert by_id[done]["status"] == "finished" and by_id[done]["sampled"] == 3
    p = cli(s, "inspect", "--shards", "1")
    assert p.returncode == 0 and "running" in p.stdout, p.stderr


def test_a_live_worker_forgets_workers_gone_for_more_than_a_day(
    settings: Settings, r: redis.Redis, fake_worker: Callable[..., Any]
) -> None:
    """Given two workers killed without unregistering, one last seen 2 days ago and one an hour
    ago, a live worker's heartbeat drops the first from the shard's worker set and keeps the
    second (inspect still shows it as gone)."""
    from helpers import wait_until
    from prefixq.worker.heartbeat import GONE_KEPT_S

    workers = settings.keys.workers(0)
    now = time.time()
    r.zadd(workers, {"old-dead": now - 2 * GONE_KEPT_S, "recent-dead": now - 3600})
    fake_worker(settings.replace(heartbeat_s=0.1), name="live")
    wait_until(lambda: r.zscore(workers, "old-dead") is None, 10, "the old one dropped")
    assert {m.decode() for m in r.zrange(workers, 0, -1)} == {"live", "recent-dead"}


def test_inspect_shows_each_workers_share_of_a_burst_and_the_moves_totals(
    make_settings: Callable[..., Settings], fake_worker: Callable[..., Any], r: redis.Redis
) -> None:
    """Two workers on two shards: the burst's record counts each one's results (the sum is the
    burst; a redelivered result counts once), and `inspect` prints them; the fleet's move totals
    come from the totals hash, not the stream."""
    s = make_settings(shards=2, placement="hash")
    a, b = fake_worker(s, name="share-a", shard=0), fake_worker(s, name="share-b", shard=1)
    burst = Producer(s).submit([{"id": f"q{i}", "prompt": f"doc {i % 7} ?"} for i in range(40)])
    status = burst.wait(timeout=60)
    assert (status.done, status.failed) == (40, 0)
    got = stats.burst_stats(r, s, burst.id)["workers"]
    by_shard = [sum(1 for x in burst.collect() if x.shard == k) for k in (0, 1)]
    assert got == {n: c for n, c in (("share-a", by_shard[0]), ("share-b", by_shard[1])) if c}
    assert sum(got.values()) == 40
    # a result recorded again (a redelivery) is not counted again
    again = next(iter(burst.collect()))
    keys, args = record_call(s.keys, burst.id, [(again, 0.0)], s, repr(time.time()), again.worker)
    assert r.register_script(lua("record_result"))(keys=keys, args=args) == [3]
    assert stats.burst_stats(r, s, burst.id)["workers"] == got
    out = cli(s, "inspect", "--burst", burst.id)
    assert out.returncode == 0, out.stderr
    assert "results by worker:" in out.stdout and "share-a" in out.stdout
    del a, b
    r.xadd(s.keys.moves, {"why": "steal", "requests": 3, "tokens": 900})  # not in the totals
    r.hset(s.keys.move_totals, mapping={"steal:groups": 2, "steal:requests": 5, "x": 1})
    fleet = stats.snapshot(s, client=r)["fleet"]
    assert fleet["moves"] == {"steal": {"groups": 2, "requests": 5, "tokens": 0}}
    assert fleet["recent_moves"][0]["why"] == "steal"


def test_inspect_shows_what_it_can_when_keys_hold_another_type(
    settings: Settings, r: redis.Redis, fake_worker: Callable[..., Any]
) -> None:
    """Given a served burst and a live worker, when the shard's stats, dead letters, lane index
    and the moves' keys hold strings (anything with write access may write one), then inspect
    (the table and --json) still shows the shard, its worker and the burst, and names each part
    it could not read (before: the whole command failed with WRONGTYPE)."""
    s = settings.replace(heartbeat_s=60.0, heartbeat_ttl_s=120.0)
    with fake_worker(s, name="w0"):
        burst = Producer(s).submit([{"id": f"q{i}", "prompt": f"hi {i}"} for i in range(5)])
        results.wait(burst, s, timeout=30)
        bad = [s.keys.shard_stats, s.keys.dead(0), s.keys.lanes(0), s.keys.moves, s.keys.load]
        for key in (*bad, s.keys.move_totals):
            r.delete(key)
            r.set(key, "garbage")
        snap = stats.snapshot(s, client=r)
        table = cli(s, "inspect")
    (shard,) = snap["shards"]
    assert shard["worker_names"] == ["w0"] and shard["dead_letters"] == 0
    assert [b["burst"] for b in snap["bursts"]] == [burst] and snap["bursts"][0]["done"] == 5
    problems = " ".join(snap["problems"])
    for part in ("cached tokens", "shard 0's dead letters", "shard 0's queues", "moves"):
        assert f"{part} not shown" in problems, snap["problems"]
    assert table.returncode == 0, table.stderr
    assert "not shown" in table.stdout and burst in table.stdout
