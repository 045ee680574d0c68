"""`/v1/responses` batches end to end on real parts: the official `openai` client against
`prefixq serve`, the session's real vLLM CPU workers (the `engines` fixture, 2 shards), a real
Redis. Output lines carry Response objects (checked with the client's own model), structured
output follows its schema, refused lines are 400 lines of their own, and requests that share
their instructions share a shard (prefix affinity)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI
from openai.types.responses import Response

from openai_server import Server, jsonl
from prefixq.client import Producer, results
from prefixq.openai.formats import format_result
from test_openai_engine import lines_of, run_batch, wait

pytestmark = pytest.mark.engine

PREFIXQ = [sys.executable, "-m", "prefixq"]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "capital": {"type": "boolean"}},
    "required": ["city", "capital"],
    "additionalProperties": False,
}
#: long shared instructions: a prefix of several KV blocks
RULES = "You are a terse assistant. " + " ".join(
    f"Rule {i}: answer in few words." for i in range(20)
)


@pytest.fixture(scope="module")
def clock(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's expiry clock shift (the test-only ``clock_shift_file``): seconds ahead."""
    path = tmp_path_factory.mktemp("clock") / "shift"
    path.write_text("0")
    return path


@pytest.fixture(scope="module")
def server(engines: Any, engines_files: Path, clock: Path) -> Iterator[Server]:
    with Server(engines.settings, engines_files, extra=["--clock-shift-file", str(clock)]) as srv:
        yield srv


@pytest.fixture
def client(server: Server) -> OpenAI:
    return OpenAI(base_url=server.url, api_key="local", max_retries=0)


def responses_line(cid: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/responses",
        "body": {"model": "smollm2", "temperature": 0, "max_output_tokens": 8, **body},
    }


def test_responses_batch_gives_response_objects_and_refuses_bad_lines_alone(
    client: OpenAI, engines: Any
) -> None:
    """Given string and message inputs with shared instructions, one json_schema line and three
    lines that cannot be served (a tool, an image, previous_response_id), the batch completes:
    the output file has a Response object per served line, in input order, with output_text,
    usage and cached tokens, echoing instructions and metadata; structured output parses against
    its schema; the error file has the three refusals as 400 invalid_request_error lines naming
    the field; the shared-instruction requests ran on one shard."""
    served = [
        responses_line(
            f"s{i}", instructions=RULES, input=f"Name a colour ({i}).", metadata={"n": str(i)}
        )
        for i in range(4)
    ]
    served.append(
        responses_line(
            "msgs",
            input=[
                {"role": "user", "content": [{"type": "input_text", "text": "Say hi."}]},
            ],
        )
    )
    fmt = {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}
    served.append(
        responses_line(
            "json", input="Describe Paris as JSON.", max_output_tokens=64, text={"format": fmt}
        )
    )
    refused = [
        responses_line("tool", input="x", tools=[{"type": "web_search"}]),
        responses_line(
            "image",
            input=[
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "http://x/y.png"}],
                }
            ],
        ),
        responses_line("prev", input="x", previous_response_id="resp_123"),
    ]
    lines = [*served[:2], refused[0], *served[2:5], *refused[1:], *served[5:]]
    b = wait(client, run_batch(client, lines, "/v1/responses").id)
    assert b.status == "completed", b
    assert b.endpoint == "/v1/responses" and b.request_counts is not None
    counts = b.request_counts
    assert (counts.total, counts.completed, counts.failed) == (len(lines), len(served), 3)

    out, err = lines_of(client, b.output_file_id), lines_of(client, b.error_file_id)
    order = [x["custom_id"] for x in lines]
    assert [x["custom_id"] for x in out] == [
        i for i in order if i in {s["custom_id"] for s in served}
    ]
    bodies = {}
    for x in out:
        assert x["error"] is None and x["response"]["status_code"] == 200
        r = Response.model_validate(x["response"]["body"])
        assert r.object == "response" and r.model == "smollm2"
        assert r.status in ("completed", "incomplete") and r.output_text
        assert r.usage is not None and r.usage.input_tokens > 0
        assert 0 < r.usage.output_tokens <= 64
        assert 0 <= r.usage.input_tokens_details.cached_tokens <= r.usage.input_tokens
        bodies[x["custom_id"]] = r
    assert bodies["s2"].instructions == RULES and bodies["s2"].metadata == {"n": "2"}
    assert bodies["msgs"].instructions is None and bodies["s0"].max_output_tokens == 8
    doc = json.loads(bodies["json"].output_text)
    assert set(doc) == {"city", "capital"} and isinstance(doc["capital"], bool)
    assert b.usage is not None
    assert b.usage.output_tokens == sum(r.usage.output_tokens for r in bodies.values())  # type: ignore[union-attr]

    assert [x["custom_id"] for x in err] == ["tool", "image", "prev"]
    params = []
    for x in err:
        assert x["error"] is None and x["response"]["status_code"] == 400
        e = x["response"]["body"]["error"]
        assert e["type"] == "invalid_request_error" and "refused" in e["message"]
        params.append(e["param"])
    assert params == ["tools", "input", "previous_response_id"]

    p = subprocess.run(
        [
            *PREFIXQ,
            "results",
            b.id,
            "--format",
            "prefixq",
            "--redis-url",
            engines.settings.redis_url,
            "--namespace",
            engines.settings.namespace,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    shards = {r["id"]: r["shard"] for r in map(json.loads, p.stdout.splitlines())}
    assert len({shards[f"s{i}"] for i in range(4)}) == 1  # one prefix group, one shard


def test_prefixq_submit_takes_a_responses_file(engines: Any, tmp_path: Path) -> None:
    """`prefixq submit FILE --wait --out OUT` of /v1/responses lines writes Response lines."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl([responses_line(f"c{i}", input=f"Count to {i}.") for i in range(3)]))
    out = tmp_path / "out.jsonl"
    where = ["--redis-url", engines.settings.redis_url, "--namespace", engines.settings.namespace]
    p = subprocess.run(
        [*PREFIXQ, "submit", str(src), "--wait", "--out", str(out), *where],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in got] == ["c0", "c1", "c2"]
    for x in got:
        assert Response.model_validate(x["response"]["body"]).output_text
    # and the Python API takes the same lines
    burst = Producer(engines.settings).submit([responses_line("py", input="Say yes.")])
    results.wait(burst, engines.settings, timeout=600)
    (res,) = results.collect(burst, engines.settings)
    assert res.error is None and res.endpoint == "/v1/responses"
    body = format_result(res, burst=burst.id).obj["response"]["body"]
    assert Response.model_validate(body).output_text == res.text


def test_a_batchs_output_files_expire_as_its_output_expires_after_says(
    client: OpenAI, server: Server, clock: Path, engines: Any
) -> None:
    """A batch created with output_expires_after of an hour gets output and error files whose
    expires_at is their created_at + 3600; once the server's clock passes it, both answer 404
    and their bytes are gone, while the batch object stays."""
    lines = [responses_line("ok", input="Say hi."), responses_line("bad", input="x", stream=True)]
    f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    b = client.batches.create(
        input_file_id=f.id,
        endpoint="/v1/responses",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 3600},
    )
    b = wait(client, b.id)
    assert b.status == "completed" and b.output_file_id and b.error_file_id, b
    files = [client.files.retrieve(i) for i in (b.output_file_id, b.error_file_id)]
    for x in files:
        assert x.purpose == "batch_output" and x.expires_at == x.created_at + 3600
    assert client.files.retrieve(f.id).expires_at is None  # the input file has no policy
    try:
        clock.write_text(str(max(x.expires_at or 0 for x in files) - time.time()))
        for x in files:
            with pytest.raises(openai.NotFoundError):
                client.files.content(x.id)
            assert not (server.files_dir / engines.settings.namespace / x.id).exists()
        assert client.batches.retrieve(b.id).output_file_id == b.output_file_id
        assert client.files.retrieve(f.id).id == f.id
    finally:
        clock.write_text("0")


def test_cancelling_a_responses_batch_keeps_what_finished(client: OpenAI) -> None:
    """A responses batch cancelled while it runs ends `cancelled`: every request is in exactly
    one file, finished ones as Response objects, the others as batch_cancelled lines, and the
    refused line as its 400 line."""
    long = [
        responses_line(
            f"long-{i}",
            input=f"Write a very long story about dragon {i}.",
            max_output_tokens=256,
            temperature=1.0,
        )
        for i in range(12)
    ]
    lines = [responses_line("refused", input="x", background=True), *long]
    b = run_batch(client, lines, "/v1/responses")
    wait(client, b.id, {"in_progress", "completed"})
    c = client.batches.cancel(b.id)
    assert c.status in ("cancelling", "cancelled")
    b = wait(client, b.id)
    assert b.status == "cancelled", b
    out, err = lines_of(client, b.output_file_id), lines_of(client, b.error_file_id)
    ids = [x["custom_id"] for x in out + err]
    assert sorted(ids) == sorted(x["custom_id"] for x in lines)
    for x in out:
        assert Response.model_validate(x["response"]["body"]).output_text
    by_id = {x["custom_id"]: x for x in err}
    assert by_id["refused"]["response"]["status_code"] == 400
    cancelled = [x for x in err if x["error"] and x["error"]["code"] == "batch_cancelled"]
    assert cancelled and all(x["response"] is None for x in cancelled)
    assert b.request_counts is not None
    assert (b.request_counts.completed, b.request_counts.failed) == (len(out), len(err))
