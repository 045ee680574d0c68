"""The simulated engine (bench/sim_engine.py): vLLM's real scheduler and block pool on a modelled
clock. What it must get right is what the design questions of several bursts turn on: a prefix
cached while it fits, evicted (least recently freed first) once the documents overflow the cache,
the step clock, and the `Engine` protocol's aborts and refusals."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from prefixq.bench.sim_engine import SimCore, SimEngine, StepCost, is_sim
from prefixq.core.errors import EngineAborted, EngineDead, EngineRefused
from prefixq.engine.protocol import EngineRequest

#: bytes of 2,048 KV tokens of the Llama-3.1-8B shape (128 blocks of 16)
SMALL_CACHE = 2_048 * 131_072
#: a clock a hundred times faster than the H200's, so that a test takes a fraction of a second
FAST = {"sim_step_ms": 0.05, "sim_token_us": 0.2, "sim_context_ns": 0.0}


def sync(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    @functools.wraps(test)
    def run() -> None:
        asyncio.run(test())

    return run


def doc(k: int, tokens: int = 512) -> list[int]:
    return [1000 + k * 7919 + i for i in range(tokens)]


def ask(engine: SimEngine, rid: str, ids: list[int], max_tokens: int = 4) -> Any:
    sampling = {"max_tokens": max_tokens}
    return engine.generate(EngineRequest(rid, prompt_token_ids=ids, sampling=sampling))


async def started(**args: Any) -> SimEngine:
    engine = SimEngine("sim:llama-3.1-8b", {"kv_cache_memory_bytes": SMALL_CACHE, **FAST, **args})
    await engine.start()
    return engine


def test_names() -> None:
    assert is_sim("sim:llama-3.1-8b")
    assert not is_sim("dummy:llama-3.1-8b")


@sync
async def test_a_prefix_is_cached_while_it_fits_and_evicted_once_documents_overflow() -> None:
    engine = await started()
    try:
        assert engine.kv_tokens == 2_048 and engine.max_num_seqs == 128
        first = await ask(engine, "a", [*doc(0), 5, 6])
        again = await ask(engine, "b", [*doc(0), 7, 8])
        assert (first.cached_tokens, again.cached_tokens) == (0, 512)  # whole blocks of doc 0
        assert first.prompt_tokens == 514 and len(first.token_ids) == 4
        for k in range(1, 6):  # 5 more documents of 512 tokens: 3,072 tokens through 2,048
            await ask(engine, f"d{k}", [*doc(k), 9])
        evicted = await ask(engine, "c", [*doc(0), 9, 9])
        recent = await ask(engine, "e", [*doc(5), 9, 9])
        assert evicted.cached_tokens == 0
        assert recent.cached_tokens == 512
    finally:
        await engine.close()


@sync
async def test_requests_of_one_document_in_one_step_share_its_blocks() -> None:
    """vLLM caches a block as it is allocated: a second request scheduled in the same step finds
    the first's blocks (the reason a sorted burst's duplicates cost nothing)."""
    engine = await started()
    try:
        outs = await asyncio.gather(*(ask(engine, f"q{i}", [*doc(1), i]) for i in range(4)))
        assert sorted(o.cached_tokens for o in outs) == [0, 512, 512, 512]
    finally:
        await engine.close()


@sync
async def test_the_clock_follows_the_step_cost() -> None:
    """One request of 512 prompt tokens at 1 ms a token takes at least half a second: the
    engine sleeps each step's modelled time."""
    engine = await started(sim_token_us=1000.0)
    try:
        t0 = time.perf_counter()
        await ask(engine, "slow", doc(2), max_tokens=2)
        took = time.perf_counter() - t0
        assert 0.5 <= took < 2.0
        assert engine.core.steps >= 2 and engine.core.busy_s >= 0.5
    finally:
        await engine.close()


@sync
async def test_abort_and_refusals() -> None:
    engine = await started(sim_token_us=200.0)  # ~0.1 s a request: time to abort it
    try:
        task = asyncio.ensure_future(ask(engine, "gone", doc(3), max_tokens=64))
        await asyncio.sleep(0.02)
        await engine.abort("gone")
        with pytest.raises(EngineAborted):
            await task
        assert "gone#0" not in engine.core.sched.requests  # vLLM let it go
        with pytest.raises(EngineRefused, match="max_model_len"):
            await ask(engine, "long", doc(4, 8_190), max_tokens=16)
        ok = await ask(engine, "after", doc(3))  # the engine still serves
        assert len(ok.token_ids) == 4
    finally:
        await engine.close()
    with pytest.raises(EngineRefused, match="takes no tensor_parallel_size"):
        SimEngine("sim:llama-3.1-8b", {"tensor_parallel_size": 2})


def test_the_core_runs_in_virtual_time() -> None:
    """`SimCore` has no clock of its own (scripts/sim_fit.py steps it in virtual time): the
    modelled seconds of a step follow `StepCost` from what vLLM scheduled."""
    core = SimCore({"kv_cache_memory_bytes": SMALL_CACHE, "max_num_batched_tokens": 256})
    core.add("r", doc(0), 2, 0, 0.0)
    out, seconds, sampled = core.schedule()
    assert out.total_num_scheduled_tokens == 256  # a chunk of the prefill
    assert sampled == set()  # mid-prefill: no token yet
    assert seconds == pytest.approx(StepCost().seconds(256, 256))
    assert core.finish(out, sampled, seconds) == []
    done, t = [], seconds
    while not done:
        out, seconds, sampled = core.schedule()
        t += seconds
        done = core.finish(out, sampled, t)
    assert done[0].rid == "r" and len(done[0].token_ids) == 2 and done[0].cached == 0


@sync
async def test_a_failing_scheduler_fails_the_waiting_requests_as_a_dead_engine() -> None:
    """vLLM's scheduler raising (a bug, a bad state) ends the waiting requests with EngineDead
    and refuses new ones, as a real engine's death does: nothing waits for good."""
    engine = await started(sim_token_us=200.0)
    try:
        waiting = asyncio.ensure_future(ask(engine, "w", doc(6), max_tokens=64))
        await asyncio.sleep(0.02)

        def broken() -> Any:
            raise RuntimeError("scheduler state")

        engine.core.schedule = broken  # type: ignore[method-assign]
        with pytest.raises(EngineDead, match="scheduler state"):
            await asyncio.wait_for(waiting, 5)
        with pytest.raises(EngineDead):
            await ask(engine, "after", doc(6))
    finally:
        await engine.close()
