"""The full request body on the real vLLM CPU engine: n choices, logprobs, structured JSON output,
seeded sampling (through real workers), and aborting a request inside the engine."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import jsonschema
import pytest

from prefixq.client import Producer, results
from prefixq.core.errors import EngineAborted, EngineRefused
from prefixq.core.records import Result
from prefixq.engine.protocol import EngineRequest
from prefixq.engine.vllm_engine import VllmEngine, cpu_defaults

pytestmark = pytest.mark.engine
T = TypeVar("T")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}


def chat(cid: str, content: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "smol", "messages": [{"role": "user", "content": content}], **body},
    }


def run(engines: Any, lines: list[dict[str, Any]]) -> dict[str, Result]:
    burst = Producer(engines.settings).submit(lines)
    results.wait(burst, engines.settings, timeout=600)
    got = {r.id: r for r in results.collect(burst, engines.settings)}
    assert [(r.id, r.error) for r in got.values() if r.error] == []
    return got


@pytest.mark.vllm_compat  # logprobs (flat_logprobs), structured output, n, seed
def test_n_logprobs_json_and_seed_through_the_workers(engines: Any) -> None:
    """n=3 gives 3 choices; logprobs with top_logprobs=2 give each token's logprob and 2
    alternatives; json_schema output validates against its schema; json_object output parses;
    a logit_bias of +100 forces its token; the same seed at temperature 1 gives the same
    tokens."""
    seeded: dict[str, Any] = {"temperature": 1.0, "seed": 1234, "max_tokens": 16}
    lines = [
        chat("n3", "Name a colour.", n=3, temperature=1.0, max_tokens=8),
        chat(
            "lp",
            "The capital of France is",
            logprobs=True,
            top_logprobs=2,
            max_tokens=6,
            temperature=0.0,
        ),
        chat(
            "schema",
            "Describe Paris as JSON.",
            max_tokens=64,
            temperature=0.0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "city", "schema": SCHEMA, "strict": True},
            },
        ),
        chat(
            "object",
            'Write a JSON object with one key "colour" and the value "blue".',
            max_tokens=100,
            temperature=0.0,
            response_format={"type": "json_object"},
        ),
        chat("bias", "Say something.", logit_bias={"28": 100}, max_tokens=3, temperature=0.0),
    ]
    got = run(engines, lines)
    # on the CPU backend vLLM ignores seeds in a batch that also holds an unseeded request
    # (vllm-project/vllm#51226), so the seeded requests run in a burst of their own
    got |= run(engines, [chat(f"seed-{x}", "Tell me a story.", **seeded) for x in "ab"])

    n3 = got["n3"]
    assert [c.index for c in n3.choices] == [0, 1, 2]
    assert all(c.token_ids and c.logprobs is None for c in n3.choices)
    assert (n3.text, n3.token_ids) == (n3.choices[0].text, n3.choices[0].token_ids)
    assert n3.output_tokens == sum(len(c.token_ids) for c in n3.choices)

    (lp,) = got["lp"].choices
    assert lp.logprobs is not None and len(lp.logprobs) == len(lp.token_ids) > 0
    for tok, tid in zip(lp.logprobs, lp.token_ids, strict=True):
        assert tok.token_id == tid and tok.token is not None and tok.logprob <= 0.0
        assert len(tok.top) == 2 and tok.top[0][2] >= tok.top[1][2]
        assert tok.top[0][:1] == (tid,) and tok.top[0][2] == tok.logprob  # greedy: the top one
        assert all(t is not None for _, t, _ in tok.top)

    assert got["schema"].finish_reason == "stop"
    doc = json.loads(got["schema"].text)
    jsonschema.validate(doc, SCHEMA)
    assert got["object"].finish_reason == "stop"
    assert isinstance(json.loads(got["object"].text), dict)
    assert got["bias"].token_ids == [28, 28, 28]
    assert got["seed-a"].token_ids == got["seed-b"].token_ids
    print("n=3:", [c.text for c in n3.choices], "| schema:", doc, "| seed:", got["seed-a"].text)


class Direct:
    """One started `VllmEngine` on the embedded model, on an event loop in a thread of its own
    (an AsyncLLM stays on the loop it was started on): the module's direct tests share it
    instead of building an engine each. ``run(coro)`` awaits ``coro`` there."""

    def __init__(self, model: str) -> None:
        self.engine = VllmEngine(model, cpu_defaults())
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 600) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        try:
            self.run(self.engine.close(), 120)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)
            self.loop.close()


@pytest.fixture(scope="module")
def direct(model_path: str) -> Iterator[Direct]:
    d = Direct(model_path)
    try:
        d.run(d.engine.start())
        yield d
    finally:
        d.close()


def test_abort_ends_a_running_request_promptly(direct: Direct) -> None:
    """A long request aborted mid-way raises EngineAborted within seconds, an n=2 request too; a
    request aborted before it starts raises at once; a finished one keeps its output."""
    engine = direct.engine

    async def long(rid: str, **sampling: Any) -> float:
        req = EngineRequest(
            request_id=rid,
            prompt_token_ids=[1] * 8,
            sampling={"max_tokens": 4000, "ignore_eos": True, **sampling},
        )
        t0 = time.monotonic()
        with pytest.raises(EngineAborted):
            await engine.generate(req)
        return time.monotonic() - t0

    async def scenario() -> None:
        for rid, sampling in (("one", {}), ("two", {"n": 2, "temperature": 1.0})):
            task = asyncio.create_task(long(rid, **sampling))
            await asyncio.sleep(3.0)
            assert not task.done()  # 4,000 tokens take minutes on this CPU
            t_abort = time.monotonic()
            await engine.abort(rid)
            took = await asyncio.wait_for(task, timeout=30)
            print(f"{rid}: aborted after {took:.1f}s, {time.monotonic() - t_abort:.2f}s late")
        await engine.abort("early")
        await long("early")
        done = EngineRequest(request_id="done", prompt_token_ids=[1] * 8, sampling={})
        done.sampling = {"max_tokens": 2, "ignore_eos": True}
        out = await engine.generate(done)
        await engine.abort("done")
        assert len(out.token_ids) == 2

    direct.run(scenario())


@pytest.mark.vllm_compat  # the vocabulary checks each release does or not
def test_token_ids_outside_the_vocabulary_are_refused_and_the_engine_serves_on(
    direct: Direct,
) -> None:
    """A stop token id outside the vocabulary with min_tokens, and a prompt token id equal to the
    vocabulary size, are refused naming the field; older vLLM releases let them through to the
    model runner (engine/vllm_compat.py),
    where either killed the engine. The engine then answers the next request."""
    engine = direct.engine
    vocab = 49_152  # the embedded SmolLM2's
    bad = [
        (
            "stop_token_ids",
            EngineRequest(
                "stop", prompt="Hi", sampling={"min_tokens": 2, "stop_token_ids": [9**9]}
            ),
        ),
        ("prompt_token_ids", EngineRequest("ids", prompt_token_ids=[1, 2, vocab])),
    ]

    async def scenario() -> None:
        for field, req in bad:
            with pytest.raises(EngineRefused, match=rf"{field}: token id \d+ is out of vocabulary"):
                await engine.generate(req)
        sampling = {"max_tokens": 2, "ignore_eos": True}
        good = EngineRequest("good", prompt_token_ids=[1] * 8, sampling=sampling)
        assert len((await engine.generate(good)).token_ids) == 2

    direct.run(scenario())
