"""Embeddings end to end on real parts: one real vLLM CPU worker started with ``--task embed``
(the embedded SmolLM2 through vLLM's pooling runner) on shard 1 of a 2-shard namespace whose
shard 0 serves generate, a real Redis, `prefixq serve` driven by the official `openai` client,
`Producer.submit` and `prefixq submit`. Vectors are checked for sense: the model's hidden size,
unit length, the same text gives the same vector, base64 decodes to the float vector."""

from __future__ import annotations

import base64
import json
import math
import secrets
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from openai import OpenAI
from openai.types import CreateEmbeddingResponse

from conftest import WorkerProc
from helpers import cli, wait_burst, wait_until
from openai_server import Server, jsonl, wait_batch
from prefixq.cli.redis_server import RedisServer
from prefixq.client.producer import Producer
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings

pytestmark = pytest.mark.engine

FINAL = {"completed", "failed", "expired", "cancelled"}
TEXTS = ["The capital of France is Paris.", "A cat sat on the mat.", "Embeddings map text."]


def embed_line(cid: str, value: Any, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": "smollm2", "input": value, **body},
    }


def norm(v: list[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / (norm(a) * norm(b))


@pytest.fixture(scope="module")
def hidden_size(model_path: str) -> int:
    """The embedded model's hidden size, read from its own config."""
    return int(json.loads((Path(model_path) / "config.json").read_text())["hidden_size"])


@pytest.fixture(scope="module")
def deployment(redis_server: RedisServer, start_worker: Callable[..., WorkerProc]) -> Settings:
    """A 2-shard namespace: shard 1 has a worker that embeds; shard 0 serves generate (no
    worker: nothing here generates)."""
    s = Settings(
        redis_url=redis_server.url,
        namespace=f"embed{secrets.token_hex(3)}",
        shards=2,
        heartbeat_s=1.0,
        grace_s=30.0,
    )
    worker = start_worker(s, shard=1, name="embed-s1", extra=["--task", "embed"])
    worker.wait_up()
    r = redis.Redis.from_url(s.redis_url)
    r.hset(Keys(s.namespace).tasks, "0", "generate")
    r.close()
    return s


@pytest.fixture(scope="module")
def embed_server(
    deployment: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    with Server(deployment, tmp_path_factory.mktemp("embed") / "files") as srv:
        yield srv


@pytest.fixture
def oai(embed_server: Server) -> OpenAI:
    return OpenAI(base_url=embed_server.url, api_key="local", max_retries=0)


def create(c: OpenAI, lines: list[dict[str, Any]]) -> Any:
    f = c.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return c.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")


def lines_of(c: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    return (
        []
        if file_id is None
        else [json.loads(x) for x in c.files.content(file_id).text.splitlines()]
    )


def test_official_client_runs_an_embeddings_batch_with_every_input_form(
    oai: OpenAI, embed_server: Server, hidden_size: int
) -> None:
    """Given lines with a string, a list of strings, token ids, token-id lists, base64 and a
    `dimensions` the model does not allow: the batch completes; each good line is a
    CreateEmbeddingResponse with one vector per input (the model's hidden size, unit length),
    the same text gives the same vector, base64 decodes to the float vector, prompt_tokens sums
    the inputs' tokens; the `dimensions` line alone fails, with OpenAI's error shape."""
    ids = [[1, 2, 3, 4, 5], [7, 8, 9]]
    lines = [
        embed_line("one", TEXTS[0]),
        embed_line("many", TEXTS),
        embed_line("ids", ids[0]),
        embed_line("id-lists", ids),
        embed_line("b64", TEXTS[0], encoding_format="base64"),
        embed_line("dims", TEXTS[0], dimensions=32),
    ]
    b = create(oai, lines)
    assert b.endpoint == "/v1/embeddings" and b.status == "validating"
    b = wait_batch(oai, b.id, FINAL, timeout=300)
    assert b.status == "completed", embed_server.tail()
    assert b.request_counts is not None
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (
        6,
        5,
        1,
    )
    out = {x["custom_id"]: x for x in lines_of(oai, b.output_file_id)}
    assert list(out) == ["one", "many", "ids", "id-lists", "b64"]
    bodies = {}
    for cid, x in out.items():
        assert x["error"] is None and x["response"]["status_code"] == 200
        if cid != "b64":
            body = CreateEmbeddingResponse.model_validate(x["response"]["body"])
            assert body.object == "list" and body.model == "smollm2"
            assert [d.index for d in body.data] == list(range(len(body.data)))
            for d in body.data:
                assert len(d.embedding) == hidden_size
                assert abs(norm(d.embedding) - 1.0) < 1e-3
            assert body.usage.total_tokens == body.usage.prompt_tokens > 0
            bodies[cid] = body
    assert len(bodies["many"].data) == 3 and len(bodies["id-lists"].data) == 2
    one = bodies["one"].data[0].embedding
    assert bodies["many"].data[0].embedding == one  # the same text, the same vector
    assert abs(cosine(one, one) - 1.0) < 1e-6
    assert cosine(one, bodies["many"].data[1].embedding) < 0.999  # another text, another vector
    assert bodies["ids"].usage.prompt_tokens == len(ids[0])
    assert bodies["id-lists"].usage.prompt_tokens == sum(map(len, ids))
    assert bodies["id-lists"].data[0].embedding == bodies["ids"].data[0].embedding
    assert bodies["many"].usage.prompt_tokens > bodies["one"].usage.prompt_tokens
    (b64,) = out["b64"]["response"]["body"]["data"]
    raw = base64.b64decode(b64["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == one
    (err,) = lines_of(oai, b.error_file_id)
    assert err["custom_id"] == "dims" and err["response"]["status_code"] == 400
    error = err["response"]["body"]["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and "Matryoshka" in error["message"]
    assert (
        b.usage is not None
        and b.usage.input_tokens
        == sum(x.usage.prompt_tokens for x in bodies.values())
        + out["b64"]["response"]["body"]["usage"]["prompt_tokens"]
    )


def test_official_client_cancels_an_embeddings_batch_and_its_inputs_leave_the_engine(
    oai: OpenAI, deployment: Settings
) -> None:
    """An embeddings batch cancelled while its lines are in the engine ends `cancelled` with
    fewer lines completed than it holds, and every input still in the engine is aborted: the
    worker has nothing in flight again long before the batch's work could have been done."""
    lines = [embed_line(f"c{i}", [f"text {i}-{j} " * 60 for j in range(16)]) for i in range(150)]
    b = create(oai, lines)
    r = redis.Redis.from_url(deployment.redis_url)
    hb = Keys(deployment.namespace).heartbeat(1, "embed-s1")
    try:
        wait_until(lambda: int(r.hget(hb, "inflight") or 0) > 0, 120, "lines in the engine")
        b = oai.batches.cancel(b.id)
        assert b.status in ("cancelling", "cancelled")
        b = wait_batch(oai, b.id, FINAL, timeout=120)
        assert b.status == "cancelled"
        assert b.request_counts is not None and b.request_counts.completed < 150
        wait_until(lambda: r.hget(hb, "inflight") == b"0", 30, "the aborted inputs to leave")
    finally:
        r.close()


def test_producer_submit_places_embeddings_on_the_embed_shard_only(
    deployment: Settings, hidden_size: int
) -> None:
    """`Producer.submit` of plain embeddings lines: every request goes to shard 1 (the only one
    that embeds), and each result holds one vector per input."""
    reqs = [{"id": f"p{i}", "input": [TEXTS[i % 3], TEXTS[(i + 1) % 3]]} for i in range(8)]
    burst = Producer(deployment).submit(reqs)
    r = redis.Redis.from_url(deployment.redis_url)
    try:
        results = wait_burst(r, deployment, str(burst), timeout=120)
    finally:
        r.close()
    assert [x.id for x in results] == [f"p{i}" for i in range(8)]
    for x in results:
        assert x.error is None and x.shard == 1 and x.embeddings is not None
        assert [len(v) for v in x.embeddings] == [4 * hidden_size] * 2
        assert x.prompt_tokens > 0 and x.output_tokens == 0
    assert results[0].embeddings[0] == results[3].embeddings[0]  # type: ignore[index]


def test_prefixq_submit_runs_an_embeddings_file(deployment: Settings, tmp_path: Path) -> None:
    """`prefixq submit FILE --wait --out OUT` of OpenAI embeddings lines writes OpenAI output
    lines, as for a chat file."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([embed_line(f"f{i}", TEXTS[i]) for i in range(3)]))
    out = tmp_path / "out.jsonl"
    done = cli(deployment, "submit", str(path), "--wait", "--out", str(out), timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == ["f0", "f1", "f2"]
    for x in lines:
        body = CreateEmbeddingResponse.model_validate(x["response"]["body"])
        assert len(body.data) == 1 and abs(norm(body.data[0].embedding) - 1.0) < 1e-3
