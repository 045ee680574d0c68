"""Embeddings requests without an engine: parsing every OpenAI input form and refusing the rest,
the wire round trip, the output lines (parsed by the `openai` package), placement by task on a
real Redis (shards that embed take embeddings bursts, and only those), the 50,000-inputs limit of
a batch at `prefixq serve`, and the real worker loop over the fake engine's vectors.
tests/test_embeddings_engine.py runs them on a real vLLM CPU engine."""

from __future__ import annotations

import asyncio
import base64
import struct
import time
from collections.abc import Callable
from typing import Any

import openai
import pytest
import redis
from openai import OpenAI
from openai.types import CreateEmbeddingResponse

from helpers import FakeWorker, queued_entries, wait_burst
from openai_server import jsonl, wait_batch
from prefixq.client.producer import Producer
from prefixq.core import wire
from prefixq.core.embeddings import MAX_BATCH_INPUTS, MAX_INPUTS, pack_vector
from prefixq.core.entries import Entry, split_prefix, to_wire
from prefixq.core.errors import ConfigError, ValidationError
from prefixq.core.keys import Keys
from prefixq.core.records import Request, Result
from prefixq.core.settings import Settings
from prefixq.openai.formats import format_result
from prefixq.ops.fleet_stats import fleet
from prefixq.store.connection import async_client
from prefixq.worker.handover import Handover, MoveReport


def line(value: Any, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": "e1",
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": "m", "input": value, **body},
    }


@pytest.mark.parametrize(
    ("value", "inputs"),
    [
        ("one text", ["one text"]),
        (["a", "b"], ["a", "b"]),
        ([5, 6, 7], [[5, 6, 7]]),
        ([[5, 6], [7]], [[5, 6], [7]]),
    ],
)
def test_every_openai_input_form_becomes_a_list_of_inputs(value: Any, inputs: list[Any]) -> None:
    """A string, strings, token ids and token-id lists: one input each, an embed task."""
    req = Request.from_json(line(value))
    assert req.inputs == inputs and req.task == "embed" and req.endpoint == "/v1/embeddings"
    assert Request.from_json({"id": "p", "input": value}).inputs == inputs  # a plain line too


@pytest.mark.parametrize(
    ("obj", "says"),
    [
        (line(""), "empty string"),
        (line([]), "not empty"),
        (line(["a", [1]]), "mixes strings and token ids"),
        (line([[1], []]), r"input\[1\] must be"),
        (line(["a"] * (MAX_INPUTS + 1)), f"over {MAX_INPUTS}"),
        (line("a", dimensions=0), "dimensions=0"),
        (line("a", encoding_format="int8"), "encoding_format"),
        (line("a", temperature=0.5), "unknown body fields: temperature"),
        ({"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {}}, "'input'"),
        ({"id": "p", "input": "a", "max_tokens": 3}, "no sampling fields"),
        ({"id": "p", "prompt": "a", "dimensions": 3}, "unknown fields: dimensions"),
    ],
)
def test_embeddings_lines_outside_openai_forms_are_refused(obj: Any, says: str) -> None:
    """Each refusal names what is wrong; nothing is silently dropped."""
    with pytest.raises(ValidationError, match=says):
        Request.from_json(obj)


def test_user_is_accepted_and_ignored() -> None:
    assert Request.from_json(line("a", user="u1")).pooling == {}


def test_an_embeddings_request_travels_through_the_wire_and_back() -> None:
    """Entry and result round trips keep the inputs, the options and the vectors' bytes."""
    req = Request.from_json(line([[1, 2], [3]], dimensions=8, encoding_format="base64"))
    prefix, own = split_prefix(req)
    assert prefix is None
    d = to_wire(
        req,
        burst="b",
        index=2,
        shard=1,
        enqueued=1.0,
        work=3,
        predicted_cached=0,
        prefix=None,
        prefix_ref=None,
        own=own,
    )
    e = Entry.from_wire(wire.unpack(wire.pack(d)))
    back = e.to_request(None)
    back.validate()
    assert (back.inputs, back.pooling) == (req.inputs, req.pooling)
    res = e.result(1, "w")
    assert res.encoding_format == "base64"
    res.embeddings = [pack_vector([0.5, -1.0]), pack_vector([2.0, 0.25])]
    again = Result.from_wire(wire.unpack(wire.pack(res.to_wire())))
    assert again.embeddings == res.embeddings and again.encoding_format == "base64"
    assert again.to_json()["embeddings"] == [[0.5, -1.0], [2.0, 0.25]]


def _result(fmt: str) -> Result:
    res = Result(id="e1", index=0, prompt_tokens=7, endpoint="/v1/embeddings", model="m")
    res.embeddings = [pack_vector([0.5, -1.0, 0.25]), pack_vector([1.0, 0.0, 0.0])]
    res.encoding_format = fmt
    return res


def test_output_line_is_openais_embeddings_list() -> None:
    """Floats: a CreateEmbeddingResponse with data[i] per input and usage.prompt_tokens."""
    ln = format_result(_result("float"), burst="b")
    assert ln.ok and ln.obj["response"]["status_code"] == 200
    body = CreateEmbeddingResponse.model_validate(ln.obj["response"]["body"])
    assert [d.index for d in body.data] == [0, 1] and body.data[0].embedding == [0.5, -1.0, 0.25]
    assert body.usage.prompt_tokens == body.usage.total_tokens == 7 and body.model == "m"


def test_base64_is_little_endian_float32_as_openai_writes_it() -> None:
    data = format_result(_result("base64"), burst="b").obj["response"]["body"]["data"]
    raw = base64.b64decode(data[0]["embedding"])
    assert struct.unpack("<3f", raw) == (0.5, -1.0, 0.25)


def test_settings_task_is_generate_or_embed() -> None:
    assert Settings().task == "generate" and Settings(task="embed").task == "embed"
    with pytest.raises(ConfigError, match="task must be one of generate, embed"):
        Settings(task="classify")


# ---- placement by task, on a real Redis -----------------------------------------------------
def _serve(r: redis.Redis, s: Settings, tasks: dict[int, str]) -> None:
    r.hset(Keys(s.namespace).tasks, mapping={str(k): t for k, t in tasks.items()})


def test_an_embeddings_burst_is_refused_when_no_shard_embeds(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """No shard serves embed: a clear error, and no burst is left behind."""
    s = make_settings(shards=2)
    with pytest.raises(ValidationError, match=r"serves embed.*--task embed"):
        Producer(s).submit([{"id": "a", "input": "x"}], burst_id="nope")
    assert not r.exists(Keys(s.namespace).burst("nope"))


def test_embeddings_go_only_to_embed_shards_and_the_rest_only_elsewhere(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Shard 1 of 3 embeds: every embeddings request is queued there, every generation request
    on shards 0 and 2, whichever placement the burst names."""
    s = make_settings(shards=3)
    _serve(r, s, {0: "generate", 1: "embed", 2: "generate"})
    p = Producer(s)
    p.submit([{"id": f"e{i}", "input": [f"t{i}", "u"]} for i in range(12)])
    for placement in ("affinity", "round-robin"):
        p.submit(
            [{"id": f"g{i}", "prompt": f"doc {i} " * 40} for i in range(12)], placement=placement
        )
    counts = {k: len(queued_entries(r, s, k)) for k in range(3)}
    assert counts[1] == 12 and counts[0] + counts[2] == 24 and counts[0] and counts[2]


def test_a_burst_holds_one_kind_of_work(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    s = make_settings(shards=1)
    _serve(r, s, {0: "embed"})
    reqs = [{"id": "a", "input": "x"}, {"id": "b", "prompt": "y"}]
    with pytest.raises(ValidationError, match="one kind of work"):
        Producer(s).submit(reqs)


def test_a_worker_records_what_its_shard_serves_and_embeds(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: Callable[..., FakeWorker]
) -> None:
    """The real worker loop with task embed: its shard is recorded as embed before it serves,
    each result holds one vector per input in order, and an input the engine refuses fails its
    request alone."""
    s = make_settings(shards=1, task="embed")
    fake_worker(s)
    assert r.hget(Keys(s.namespace).tasks, "0") == b"embed"
    reqs = [
        {"id": "a", "input": ["xy", "zzz"]},
        {"id": "b", "input": "fail:no"},
        {"id": "c", "input": [9, 8]},
    ]
    burst = Producer(s).submit(reqs)
    a, b, c = wait_burst(r, s, str(burst))
    assert a.error is None and a.embeddings == [
        pack_vector([2.0, ord("x"), 1.0, 0.0]),
        pack_vector([3.0, ord("z"), 1.0, 1.0]),
    ]
    assert b.error_code == "invalid_request" and "refused: no" in (b.error or "")
    assert c.embeddings == [pack_vector([2.0, 9.0, 1.0, 0.0])] and c.prompt_tokens == 2


# ---- the batch limit at `prefixq serve` -----------------------------------------------------
def test_a_batch_over_50000_inputs_is_refused_at_create(client: OpenAI) -> None:
    """OpenAI's limit across an embeddings batch: create answers 400 with OpenAI's error shape
    (code too_many_inputs, param input_file_id); at the limit it is accepted."""
    per = MAX_BATCH_INPUTS // 20  # the server fixture takes files of up to 20 lines
    at = [line(["a"] * per) | {"custom_id": f"c{i}"} for i in range(20)]
    over = [*at[:-1], line(["a"] * (per + 1)) | {"custom_id": "last"}]
    f = client.files.create(file=("in.jsonl", jsonl(over)), purpose="batch")
    with pytest.raises(openai.BadRequestError) as exc:
        client.batches.create(
            input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h"
        )
    assert exc.value.code == "too_many_inputs" and exc.value.param == "input_file_id"
    assert "50,000" in exc.value.message
    ok = client.files.create(file=("in.jsonl", jsonl(at)), purpose="batch")
    b = client.batches.create(
        input_file_id=ok.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    assert b.status == "validating"


def test_a_batch_fails_validation_when_no_shard_embeds(client: OpenAI) -> None:
    """No worker serves embed in the namespace: the batch fails with the producer's reason and
    queues nothing."""
    f = client.files.create(file=("in.jsonl", jsonl([line("hello")])), purpose="batch")
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    b = wait_batch(client, b.id, {"failed", "completed", "cancelled", "expired"})
    assert b.status == "failed" and b.errors is not None and b.errors.data
    (err,) = b.errors.data
    assert err.code == "invalid_request" and "serves embed" in (err.message or "")


def test_an_orphaned_embed_shards_queue_moves_only_to_another_embed_shard(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Shards 0 and 2 embed, shard 1 generates, all live: shard 0's embeddings queue moves to
    shard 2 alone; with no other embed shard live it waits."""
    s = make_settings(shards=3)
    _serve(r, s, {0: "embed", 1: "generate", 2: "embed"})
    keys = Keys(s.namespace)
    for k in (0, 1, 2):
        r.hset(keys.live, str(k), repr(time.time()))
    r.hset(keys.live, "2", "0")  # shard 2 dead: shard 0 takes the whole burst
    Producer(s).submit([{"id": f"e{i}", "input": f"text {i}"} for i in range(6)])
    assert len(queued_entries(r, s, 0)) == 6
    r.hset(keys.live, "0", "0")  # shard 0 dead now, shard 1 (generate) live
    assert _move(s, 0).skipped == "no live shard to move to (that serves embed)"
    r.hset(keys.live, "2", repr(time.time()))
    assert _move(s, 0).requests == 6
    assert len(queued_entries(r, s, 2)) == 6 and not queued_entries(r, s, 1)


def _move(s: Settings, source: int) -> MoveReport:
    async def go() -> MoveReport:
        client = async_client(s)
        try:
            return await Handover(client, s, name="test").move_shard(source, 3, why="orphaned")
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_inspect_shows_what_each_shard_serves(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    s = make_settings(shards=2)
    _serve(r, s, {1: "embed"})
    shards = fleet(r, s, 2, time.time())["shards"]
    assert [x["task"] for x in shards] == ["generate", "embed"]
