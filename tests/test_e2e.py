"""End to end on real parts: producer -> Redis streams -> `prefixq worker` (vLLM CPU) -> results."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis

from helpers import wait_until
from prefixq.client import Producer, results
from prefixq.core.keys import GROUP, Keys
from prefixq.engine.vllm_engine import cpu_defaults

pytestmark = pytest.mark.engine

PROMPTS = [
    "The capital of Italy is",
    "List three colours:",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The chemical formula of water is",
    "Translate to French: good morning",
]
CHAT = [
    [{"role": "user", "content": "Name a large animal."}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "What colour is the sky?"},
    ],
]


def _direct(model: str, groups: list[list[dict[str, Any]]]) -> list[list[list[int]]]:
    """The same requests handed straight to a fresh vLLM AsyncLLM (no prefixq code involved),
    one group at a time, each group all at once (the way one worker received it)."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    async def run() -> list[list[list[int]]]:
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, **cpu_defaults()))
        try:
            tok = llm.get_tokenizer()

            async def one(i: int, req: dict[str, Any]) -> list[int]:
                params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"])
                kwargs: dict[str, Any] = {}
                if "messages" in req:
                    prompt = tok.apply_chat_template(
                        req["messages"], tokenize=False, add_generation_prompt=True
                    )
                    kwargs["tokenization_kwargs"] = {"add_special_tokens": False}
                else:
                    prompt = req["prompt"]
                final = None
                async for out in llm.generate(prompt, params, f"direct-{i}", **kwargs):
                    final = out
                assert final is not None
                return list(final.outputs[0].token_ids)

            out = []
            for g, requests in enumerate(groups):
                out.append(
                    list(
                        await asyncio.gather(
                            *(one(g * 1000 + i, q) for i, q in enumerate(requests))
                        )
                    )
                )
            return out
        finally:
            llm.shutdown()

    return asyncio.run(run())


def test_greedy_results_equal_direct_engine_token_for_token(engines: Any, model_path: str) -> None:
    """Given greedy prompts and chats, the pipeline's tokens equal a direct AsyncLLM's.

    vLLM is not batch-invariant on the CPU (a near-tie can flip with the batch's shape), so the
    direct engine gets the same batches: each shard's requests together, in input order."""
    reqs: list[dict[str, Any]] = [
        {"id": f"p{i}", "prompt": p, "max_tokens": 24, "temperature": 0.0}
        for i, p in enumerate(PROMPTS)
    ]
    reqs += [
        {"id": f"c{i}", "messages": m, "max_tokens": 24, "temperature": 0.0}
        for i, m in enumerate(CHAT)
    ]
    burst = Producer(engines.settings).submit(reqs)
    results.wait(burst, engines.settings, timeout=600)
    got = results.collect(burst, engines.settings)
    assert [r.error for r in got] == [None] * len(reqs)
    shards = sorted({r.shard for r in got})
    groups = [[q for q, r in zip(reqs, got, strict=True) if r.shard == k] for k in shards]
    direct = _direct(model_path, groups)
    by_id = {
        q["id"]: d for g, ds in zip(groups, direct, strict=True) for q, d in zip(g, ds, strict=True)
    }
    for req, res in zip(reqs, got, strict=True):
        exp = by_id[req["id"]]
        assert res.id == req["id"]
        assert res.token_ids == exp, f"{req['id']}: pipeline {res.text!r}"
        assert res.output_tokens == len(exp)
    print(f"{len(reqs)} requests identical token for token; shards used: {shards}")


@pytest.mark.vllm_compat  # chats rendered with the tokenizer's template
def test_chat_answer_about_france_mentions_paris(engines: Any) -> None:
    """The embedded model, through its chat template, answers the capital question with Paris."""
    burst = Producer(engines.settings).submit(
        [
            {
                "id": "france",
                "max_tokens": 32,
                "temperature": 0.0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
            }
        ]
    )
    results.wait(burst, engines.settings, timeout=600)
    (res,) = results.collect(burst, engines.settings)
    print("answer:", res.text)
    assert res.error is None
    assert "Paris" in res.text


def test_results_come_back_in_input_order_with_stage_timestamps(engines: Any) -> None:
    """Requests finishing out of order are still yielded in input order, each with ordered
    enqueued <= admitted <= first_token <= finished timestamps."""
    lengths = [40, 2, 30, 1, 20, 3, 10, 5]
    reqs = [
        {
            "id": f"r{i}",
            "prompt": f"Count slowly to {n}:",
            "max_tokens": n,
            "ignore_eos": True,
            "temperature": 0.0,
        }
        for i, n in enumerate(lengths)
    ]
    burst = Producer(engines.settings).submit(reqs)
    got = list(results.iterate(burst, engines.settings, timeout=600))
    assert [r.id for r in got] == [q["id"] for q in reqs]
    assert [r.output_tokens for r in got] == lengths
    finish_order = sorted(got, key=lambda r: r.timings.finished)
    assert [r.id for r in finish_order] != [r.id for r in got], "expected out-of-order finishes"
    for res in got:
        t = res.timings
        assert 0 < t.enqueued <= t.admitted <= t.first_token <= t.finished, res


def test_engine_failure_becomes_failed_result_and_worker_keeps_serving(
    engines: Any,
) -> None:
    """A prompt longer than max_model_len fails with the engine's reason; the rest succeed, the
    worker serves the next burst, and nothing is left pending."""
    s = engines.settings
    too_long = {"id": "long", "prompt": "word " * 9000, "max_tokens": 4}
    reqs = [
        {"id": "a", "prompt": "Hello there", "max_tokens": 4},
        too_long,
        {"id": "b", "prompt": "Good night", "max_tokens": 4},
    ]
    burst = Producer(s).submit(reqs)
    st = results.wait(burst, s, timeout=600)
    assert (st.done, st.failed) == (2, 1)
    res = {r.id: r for r in results.collect(burst, s)}
    assert res["long"].error is not None and "maximum context length" in res["long"].error
    assert res["a"].error is None and res["b"].error is None

    again = Producer(s).submit([{"id": "after", "prompt": "Still there?", "max_tokens": 4}])
    assert results.wait(again, s, timeout=600).done == 1
    r = redis.Redis.from_url(s.redis_url)
    keys = Keys(s.namespace)
    # a result is readable before its entry is acknowledged (the writer records, fences, acks)
    streams = [keys.stream(k) for k in range(s.shards)]
    wait_until(lambda: all(r.xpending(x, GROUP)["pending"] == 0 for x in streams), 30, "no pending")
    assert all(r.xlen(x) == 0 for x in streams)
    assert all(w.proc.poll() is None for w in engines.workers)
