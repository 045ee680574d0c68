"""The worker loop under faults, on a real Redis, with the deterministic tests/fake_engine.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from fake_engine import FakeEngine
from helpers import FakeWorker, pending_on, queue_empty, wait_burst, wait_settled, wait_until
from prefixq.client import Producer
from prefixq.core import wire
from prefixq.core.keys import FIELD, GROUP, Keys
from prefixq.core.settings import Settings
from prefixq.worker.worker import EXIT_ENGINE_DEAD, EXIT_OK

MakeWorker = Callable[..., FakeWorker]


def prompts(*texts: str, max_tokens: int = 8) -> list[dict[str, Any]]:
    return [{"id": f"q{i}", "prompt": t, "max_tokens": max_tokens} for i, t in enumerate(texts)]


def test_admission_is_continuous_up_to_max_inflight(
    make_settings: Callable[..., Settings], fake_worker: MakeWorker, r: redis.Redis
) -> None:
    """Given 20 slow requests and max_inflight 4, the engine holds exactly 4 at its peak and a
    new request is admitted as soon as one finishes (no waiting for a whole batch)."""
    s = make_settings(max_inflight=4)
    fw = fake_worker(s)
    burst = Producer(s).submit(prompts(*[f"sleep:0.{i % 3 + 1} x" for i in range(20)]))
    got = wait_burst(r, s, burst, 30)
    assert all(g.error is None for g in got)
    assert fw.engine.peak_active == 4
    admitted = sorted(g.timings.admitted for g in got)
    finished = sorted(g.timings.finished for g in got)
    # the 5th admission happens right after the 1st finish, long before the 4th
    assert admitted[4] < finished[3]
    assert fw.stop() == EXIT_OK


def test_engine_error_becomes_failed_result_and_nothing_stays_pending(
    settings: Settings, fake_worker: MakeWorker, r: redis.Redis
) -> None:
    """A request the engine refuses gets a failed result with the reason; the others succeed."""
    s = settings
    fw = fake_worker(s)
    burst = Producer(s).submit(prompts("a b", "fail:too long", "c d"))
    got = wait_burst(r, s, burst, 30)
    assert got[0].error is None
    assert got[1].error == "fake engine refused: too long"
    assert got[2].text == "d c"
    assert fw.stop() == EXIT_OK
    assert r.xpending(Keys(s.namespace).stream(0), GROUP)["pending"] == 0


def test_undecodable_entries_go_to_dead_letters_and_the_worker_keeps_serving(
    settings: Settings, fake_worker: MakeWorker, r: redis.Redis
) -> None:
    """Garbage, a wrong codec tag and a missing field each land in the dead-letter stream with
    a reason; a good request after them is served."""
    s, keys = settings, Keys(settings.namespace)
    fw = fake_worker(s)
    r.xadd(keys.stream(0), {FIELD: b"\x01garbage"})
    r.xadd(keys.stream(0), {FIELD: b"\x09" + wire.pack({"v": 1})})
    r.xadd(keys.stream(0), {b"other": b"x"})
    r.xadd(keys.stream(0), {FIELD: wire.encode({"v": 1, "b": "x"})})
    burst = Producer(s).submit(prompts("still alive"))
    (got,) = wait_burst(r, s, burst, 30)
    assert got.text == "alive still"
    reasons = [f[b"reason"].decode() for _, f in r.xrange(keys.dead(0))]
    assert len(reasons) == 4, reasons
    assert all(x.startswith("undecodable") or "no 'd' field" in x for x in reasons)
    wait_settled(r, s)
    assert fw.stop() == EXIT_OK


def test_engine_death_leaves_in_flight_entries_pending_and_exits_3(
    settings: Settings, fake_worker: MakeWorker, r: redis.Redis
) -> None:
    """When the engine dies, in-flight requests are not failed: they stay pending, the worker
    exits 3, and a restarted worker (same name) serves them exactly once."""
    s, keys = settings, Keys(settings.namespace)
    fw = fake_worker(s, engine=FakeEngine(lethal=True))
    # input order: the two sleeps go in ahead of the request that kills the engine
    burst = Producer(s).submit(prompts("sleep:5 a", "sleep:5 b", "die:now"), order="input")
    assert fw.wait(30) == EXIT_ENGINE_DEAD
    assert fw.engine.dead.is_set()
    assert r.xpending(keys.stream(0), GROUP)["pending"] == 3
    assert r.hlen(keys.results(burst)) == 0

    again = fake_worker(s, engine=FakeEngine(lethal=False))  # the restart: same name
    got = wait_burst(r, s, burst, 30)
    assert [g.error for g in got] == [None, None, None]
    assert got[2].text == "die:now"  # served, this time, by an engine that survives it
    assert again.stop() == EXIT_OK
    assert r.xpending(keys.stream(0), GROUP)["pending"] == 0


def test_stop_finishes_in_flight_requests_and_acks_them(
    make_settings: Callable[..., Settings], fake_worker: MakeWorker, r: redis.Redis
) -> None:
    """stop() (SIGTERM) stops reading; what is in flight finishes within the grace period, its
    results are written and acked; unread entries stay queued for the next worker."""
    s = make_settings(max_inflight=2, grace_s=10)
    keys = Keys(s.namespace)
    fw = fake_worker(s)
    burst = Producer(s).submit(prompts(*["sleep:0.5 x"] * 6))
    wait_until(lambda: pending_on(r, s, fw.name) >= 2, 10, "2 requests in flight", 0.01)
    assert fw.stop() == EXIT_OK
    assert r.hlen(keys.results(burst)) == 2
    assert queue_empty(r, s) == (4, 0), "what was read but not started was given back"


def test_redelivered_request_with_a_result_is_only_acked(
    settings: Settings, fake_worker: MakeWorker, r: redis.Redis
) -> None:
    """A result is recorded once per request: serving the same entry again writes nothing new
    (the stored result, the counters and the events stay as they were) and only acks it."""
    s, keys = settings, Keys(settings.namespace)
    fake_worker(s)
    burst = Producer(s).submit(prompts("one", "two"))
    wait_burst(r, s, burst, 30)
    before = r.hgetall(keys.burst(burst)), r.hgetall(keys.results(burst))
    # a crash after the write but before the ack: the same entry comes back
    entry = wire.encode({"v": 1, "b": burst, "i": 0, "id": "q0", "p": "changed", "e": 0.0})
    again = r.xadd(keys.stream(0), {FIELD: entry})
    wait_until(
        lambda: (
            not r.xrange(keys.stream(0), again, again)
            and r.xpending(keys.stream(0), GROUP)["pending"] == 0
        ),
        10,
        "the redelivered entry acked and deleted",
    )
    assert (r.hgetall(keys.burst(burst)), r.hgetall(keys.results(burst))) == before
    assert r.xlen(keys.events(burst)) == 2


def test_four_shards_four_workers_serve_a_burst_with_documents_kept_together(
    make_settings: Callable[..., Settings], fake_worker: MakeWorker, r: redis.Redis
) -> None:
    """A 4-shard deployment (one worker loop per shard): a burst of 12 documents x 3 questions
    is spread over all four shards, each document's questions on one shard, every request
    answered once."""
    s = make_settings(shards=4)
    workers = [fake_worker(s, name=f"w{k}", shard=k) for k in range(4)]
    doc = "Document {d}: " + "words about the subject at hand " * 40
    reqs = [
        {"id": f"d{d}q{q}", "prefix": doc.format(d=d), "prompt": f" question {q}", "max_tokens": 4}
        for q in range(3)
        for d in range(12)
    ]
    burst = Producer(s).submit(reqs)
    got = wait_burst(r, s, burst, 60)
    assert [g.id for g in got] == [q["id"] for q in reqs]
    assert all(g.error is None for g in got)
    shards_of: dict[str, set[int]] = {}
    for g in got:
        shards_of.setdefault(g.id.split("q")[0], set()).add(g.shard)
    assert all(len(v) == 1 for v in shards_of.values()), shards_of
    assert {g.shard for g in got} == {0, 1, 2, 3}
    assert [w.stop() for w in workers] == [EXIT_OK] * 4


def test_read_to_engine_time_leaves_out_an_idle_blocked_read(
    settings: Settings, fake_worker: MakeWorker, r: redis.Redis
) -> None:
    """The worker's read-to-engine time runs from the read returning to the engine call: a burst
    that arrives while the worker's read has been blocked for 0.35 s (of its 0.5 s) does not
    count those 0.35 s (`prefixq bench` reports this figure as the pipeline's own delay)."""
    s = settings
    fw = fake_worker(s)
    assert fw.worker is not None
    probes = fw.worker.probes
    for i in range(3):
        time.sleep(0.35)  # the worker's reader is blocked in XREADGROUP, idle
        wait_burst(r, s, Producer(s).submit(prompts(f"idle {i}")), 30)
    stats = probes.read_to_engine.stats("r2e")
    assert stats["r2e_n"] == 3
    assert stats["r2e_max_ms"] < 200, stats
    assert fw.stop() == EXIT_OK


def test_a_burst_done_hook_that_meets_redis_loading_runs_again_until_it_succeeds(
    make_settings: Callable[..., Settings],
    fake_worker: Callable[..., FakeWorker],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Given a burst-done hook (the RQ completion callback's) that fails twice as Redis answers
    LOADING after a restart, when the worker records the burst's last result, the hook is run
    again with backoff until it succeeds, with no traceback logged (it was logged as failed and
    never run again: the burst's on_complete job was lost)."""
    from contextlib import asynccontextmanager

    from prefixq.worker.middleware import Middleware

    calls: list[str] = []

    class Loading(Middleware):
        async def after_burst_done(self, burst: str) -> None:
            calls.append(burst)
            if len(calls) <= 2:
                raise redis.BusyLoadingError("Redis is loading the dataset in memory")

    @asynccontextmanager
    async def with_hook(w: Any) -> Any:
        w.add_middleware(Loading())
        yield

    s = make_settings()
    with fake_worker(s, wrap=with_hook):
        burst = Producer(s).submit([{"id": "a", "prompt": "hi", "max_tokens": 2}])
        wait_until(lambda: len(calls) >= 3, 10, "the hook run a third time")
    assert calls == [burst] * 3
    assert "burst-done hook failed" not in caplog.text


def test_results_waiting_for_their_replicas_do_not_hold_up_recording_later_ones(
    make_settings: Callable[..., Settings], fake_worker: MakeWorker, r: redis.Redis
) -> None:
    """With min_replicas_acked=1 on a Redis whose replica never confirms (here: none), no result
    is acked, yet the results that finish while the first batch waits are recorded on the master
    too (the writer's retried batch takes them in: worker/writer.py `_top_up`), so a replica that
    falls behind holds up the acks, not the master's copy of the results."""
    s = make_settings(max_inflight=3)  # the producer's: it would fence its entries too
    keys = Keys(s.namespace)
    fw = fake_worker(s.replace(min_replicas_acked=1, min_replicas_acked_timeout_ms=50))
    # all three in the engine at once (unacked results keep their slots), finishing apart
    burst = Producer(s).submit(prompts("sleep:0.1 a", "sleep:1.0 b", "sleep:2.0 c"))
    wait_until(lambda: r.hlen(keys.results(burst)) == 3, 30, "all 3 results on the master")
    assert pending_on(r, s, fw.name) == 3  # recorded, none acked: the replicas never confirmed
    fw.stop()
