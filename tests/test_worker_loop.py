"""The worker loop under faults, on a real Redis, with the deterministic tests/fake_engine.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aredis

from fake_engine import FakeEngine
from prefixq import wire
from prefixq.consumers.worker import EXIT_ENGINE_DEAD, EXIT_OK, Worker
from prefixq.keys import FIELD, GROUP, Keys
from prefixq.producer import Producer
from prefixq.records import Result
from prefixq.settings import Settings


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))  # type: ignore[arg-type]


async def start(
    settings: Settings, engine: FakeEngine, name: str = "w0", shard: int = 0
) -> tuple[Worker, Any]:
    w = Worker(settings, shard, engine, name=name)
    task = asyncio.create_task(w.run())
    while not w.engine_up:
        if task.done():
            await task
        await asyncio.sleep(0.01)
    return w, task


async def wait_results(settings: Settings, burst: str, n: int) -> list[Result]:
    r = aredis.Redis.from_url(settings.redis_url)
    keys = Keys(settings.namespace)
    try:
        for _ in range(3000):
            if await r.hlen(keys.results(burst)) >= n:
                break
            await asyncio.sleep(0.01)
        raw = await r.hgetall(keys.results(burst))
        out = [Result.from_wire(wire.decode(v)) for v in raw.values()]
        return sorted(out, key=lambda x: x.index)
    finally:
        await r.aclose()


def prompts(*texts: str, max_tokens: int = 8) -> list[dict[str, Any]]:
    return [{"id": f"q{i}", "prompt": t, "max_tokens": max_tokens} for i, t in enumerate(texts)]


def test_admission_is_continuous_up_to_max_inflight(make_settings: Callable[..., Settings]) -> None:
    """Given 20 slow requests and max_inflight 4, the engine holds exactly 4 at its peak and a
    new request is admitted as soon as one finishes (no waiting for a whole batch)."""
    s = make_settings(max_inflight=4)

    async def main() -> None:
        eng = FakeEngine()
        w, task = await start(s, eng)
        burst = await Producer(s).asubmit(prompts(*[f"sleep:0.{i % 3 + 1} x" for i in range(20)]))
        got = await wait_results(s, burst, 20)
        assert len(got) == 20 and all(g.error is None for g in got)
        assert eng.peak_active == 4
        admitted = sorted(g.timings.admitted for g in got)
        finished = sorted(g.timings.finished for g in got)
        # the 5th admission happens right after the 1st finish, long before the 4th
        assert admitted[4] < finished[3]
        w.stop()
        assert await task == EXIT_OK

    run(main())


def test_engine_error_becomes_failed_result_and_nothing_stays_pending(
    make_settings: Callable[..., Settings],
) -> None:
    """A request the engine refuses gets a failed result with the reason; the others succeed."""
    s = make_settings()

    async def main() -> None:
        w, task = await start(s, FakeEngine())
        burst = await Producer(s).asubmit(prompts("a b", "fail:too long", "c d"))
        got = await wait_results(s, burst, 3)
        assert got[0].error is None
        assert got[1].error == "fake engine refused: too long"
        assert got[2].text == "d c"
        w.stop()
        await task
        r = aredis.Redis.from_url(s.redis_url)
        assert (await r.xpending(Keys(s.namespace).stream(0), GROUP))["pending"] == 0
        await r.aclose()

    run(main())


def test_undecodable_entries_go_to_dead_letters_and_the_worker_keeps_serving(
    make_settings: Callable[..., Settings],
) -> None:
    """Garbage, a wrong codec tag and a missing field each land in the dead-letter stream with
    a reason; a good request after them is served."""
    s = make_settings()

    async def main() -> None:
        w, task = await start(s, FakeEngine())
        r = aredis.Redis.from_url(s.redis_url)
        keys = Keys(s.namespace)
        await r.xadd(keys.stream(0), {FIELD: b"\x01garbage"})
        await r.xadd(keys.stream(0), {FIELD: b"\x09" + wire.pack({"v": 1})})
        await r.xadd(keys.stream(0), {b"other": b"x"})
        await r.xadd(keys.stream(0), {FIELD: wire.encode({"v": 1, "b": "x"})})
        burst = await Producer(s).asubmit(prompts("still alive"))
        got = await wait_results(s, burst, 1)
        assert got[0].text == "alive still"
        dead = await r.xrange(keys.dead(0))
        reasons = [d[1][b"reason"].decode() for d in dead]
        assert len(reasons) == 4, reasons
        assert all(x.startswith("undecodable") or "no 'd' field" in x for x in reasons)
        assert (await r.xpending(keys.stream(0), GROUP))["pending"] == 0
        w.stop()
        assert await task == EXIT_OK
        await r.aclose()

    run(main())


def test_engine_death_leaves_in_flight_entries_pending_and_exits_3(
    make_settings: Callable[..., Settings],
) -> None:
    """When the engine dies, in-flight requests are not failed: they stay pending, the worker
    exits 3, and a restarted worker (same name) serves them exactly once."""
    s = make_settings()

    async def main() -> None:
        eng = FakeEngine()
        _, task = await start(s, eng)
        burst = await Producer(s).asubmit(prompts("sleep:5 a", "sleep:5 b", "die:now"))
        assert await task == EXIT_ENGINE_DEAD
        r = aredis.Redis.from_url(s.redis_url)
        keys = Keys(s.namespace)
        assert (await r.xpending(keys.stream(0), GROUP))["pending"] == 3
        assert await r.hlen(keys.results(burst)) == 0

        w2, task2 = await start(s, FakeEngine(lethal=False))  # the restart: same name
        got = await wait_results(s, burst, 3)
        assert [g.error for g in got] == [None, None, None]
        assert got[2].text == "die:now"  # served, this time, by an engine that survives it
        w2.stop()
        await task2
        assert (await r.xpending(keys.stream(0), GROUP))["pending"] == 0
        await r.aclose()

    run(main())


def test_stop_finishes_in_flight_requests_and_acks_them(
    make_settings: Callable[..., Settings],
) -> None:
    """stop() (SIGTERM) stops reading; what is in flight finishes within the grace period, its
    results are written and acked; unread entries stay queued for the next worker."""
    s = make_settings(max_inflight=2, grace_s=10)

    async def main() -> None:
        w, task = await start(s, FakeEngine())
        burst = await Producer(s).asubmit(prompts(*["sleep:0.5 x"] * 6))
        while len(w.inflight) < 2:
            await asyncio.sleep(0.01)
        w.stop()
        assert await task == EXIT_OK
        r = aredis.Redis.from_url(s.redis_url)
        keys = Keys(s.namespace)
        assert await r.hlen(keys.results(burst)) == 2
        assert (await r.xpending(keys.stream(0), GROUP))["pending"] == 0
        assert await r.xlen(keys.stream(0)) == 4
        await r.aclose()

    run(main())


def test_redelivered_request_with_a_result_is_only_acked(
    make_settings: Callable[..., Settings],
) -> None:
    """A result is recorded once per request: serving the same entry again writes nothing new
    and only acknowledges it."""
    s = make_settings()

    async def main() -> None:
        w, task = await start(s, FakeEngine())
        burst = await Producer(s).asubmit(prompts("one", "two"))
        await wait_results(s, burst, 2)
        r = aredis.Redis.from_url(s.redis_url)
        keys = Keys(s.namespace)
        before = await r.hgetall(keys.burst(burst))
        # a crash after the write but before the ack: the same entry comes back
        entry = wire.encode({"v": 1, "b": burst, "i": 0, "id": "q0", "p": "one", "e": 0.0})
        await r.xadd(keys.stream(0), {FIELD: entry})
        for _ in range(500):
            if w.writer.duplicates:
                break
            await asyncio.sleep(0.01)
        assert w.writer.duplicates == 1
        assert await r.hgetall(keys.burst(burst)) == before
        assert await r.hlen(keys.results(burst)) == 2
        assert (await r.xpending(keys.stream(0), GROUP))["pending"] == 0
        w.stop()
        await task
        await r.aclose()

    run(main())


def test_four_shards_four_workers_serve_a_burst_with_documents_kept_together(
    make_settings: Callable[..., Settings],
) -> None:
    """A 4-shard deployment (one worker loop per shard): a burst of 12 documents x 3 questions
    is spread over all four shards, each document's questions on one shard, every request
    answered once."""
    s = make_settings(shards=4)

    async def main() -> None:
        started = [await start(s, FakeEngine(), name=f"w{k}", shard=k) for k in range(4)]
        doc = "Document {d}: " + "words about the subject at hand " * 40
        reqs = [
            {
                "id": f"d{d}q{q}",
                "prefix": doc.format(d=d),
                "prompt": f" question {q}",
                "max_tokens": 4,
            }
            for q in range(3)
            for d in range(12)
        ]
        burst = await Producer(s).asubmit(reqs)
        got = await wait_results(s, burst, len(reqs))
        assert [g.id for g in got] == [q["id"] for q in reqs]
        assert all(g.error is None for g in got)
        shards_of: dict[str, set[int]] = {}
        for g in got:
            shards_of.setdefault(g.id.split("q")[0], set()).add(g.shard)
        assert all(len(v) == 1 for v in shards_of.values()), shards_of
        assert {g.shard for g in got} == {0, 1, 2, 3}
        for w, task in started:
            w.stop()
            assert await task == EXIT_OK

    run(main())
