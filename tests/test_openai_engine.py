"""The OpenAI Batch API end to end on real parts: the official `openai` client against
`prefixq serve`, the session's real vLLM CPU workers (the `engines` fixture, 2 shards), a real
Redis. Output and error files are checked line by line against the input."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aredis
from openai import OpenAI
from openai.types import Batch
from openai.types.chat import ChatCompletion
from openai.types.completion import Completion

from openai_server import Server, chat_line, completion_line
from prefixq.core.keys import Keys
from prefixq.worker import control

pytestmark = pytest.mark.engine

FINAL = {"completed", "failed", "expired", "cancelled"}
PREFIXQ = [sys.executable, "-m", "prefixq"]


def where(s: Any) -> list[str]:
    return ["--redis-url", s.redis_url, "--namespace", s.namespace]


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


@pytest.fixture(scope="module")
def server(engines: Any, engines_files: Path) -> Iterator[Server]:
    with Server(engines.settings, engines_files) as srv:
        yield srv


@pytest.fixture
def client(server: Server) -> OpenAI:
    return OpenAI(base_url=server.url, api_key="local", max_retries=0)


def run_batch(c: OpenAI, lines: list[dict[str, Any]], endpoint: str, **kw: Any) -> Batch:
    f = c.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    return c.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h", **kw)  # type: ignore[arg-type]


def wait(c: OpenAI, batch_id: str, until: set[str] = FINAL, timeout: float = 600) -> Batch:
    deadline = time.monotonic() + timeout
    while True:
        b = c.batches.retrieve(batch_id)
        if b.status in until or time.monotonic() > deadline:
            return b
        time.sleep(0.5)


def lines_of(c: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines()]


def test_chat_batch_completes_with_files_that_match_the_input_line_by_line(
    client: OpenAI, server: Server
) -> None:
    """Given chat lines and one prompt longer than the model's context, polling reaches
    `completed`: the output file has one 200 line per good request in input order, each body a
    chat.completion with usage (cached prompt tokens included); the error file has the refused
    request as a 400 invalid_request_error line, as OpenAI answers an invalid request; counts and
    timestamps are set. The server is killed and restarted while the batch runs: the batch is
    still there and still completes."""
    lines = [chat_line(f"q-{i}", f"Name a colour. ({i})", max_tokens=6) for i in range(6)]
    lines.insert(3, chat_line("too-long", "word " * 9000, max_tokens=4))
    b = run_batch(client, lines, "/v1/chat/completions", metadata={"run": "chat"})
    assert b.status == "validating" and b.metadata == {"run": "chat"}
    assert wait(client, b.id, {"in_progress", *FINAL}).status in ("in_progress", "completed")
    server.restart()
    b = wait(client, b.id)
    assert b.status == "completed", server.tail()
    assert b.request_counts is not None
    counts = b.request_counts
    assert (counts.total, counts.completed, counts.failed) == (7, 6, 1)
    times = [b.created_at, b.in_progress_at, b.finalizing_at, b.completed_at]
    assert all(t is not None for t in times) and times == sorted(times)  # type: ignore[type-var]
    assert b.expires_at == b.created_at + 86400 and b.model == "smollm2"

    out, err = lines_of(client, b.output_file_id), lines_of(client, b.error_file_id)
    assert [x["custom_id"] for x in out] == [f"q-{i}" for i in range(6)]
    assert len({x["id"] for x in out}) == 6
    for x in out:
        assert x["error"] is None and x["response"]["status_code"] == 200
        body = ChatCompletion.model_validate(x["response"]["body"])
        assert body.object == "chat.completion" and body.model == "smollm2"
        assert body.choices[0].message.content and body.choices[0].message.role == "assistant"
        assert body.choices[0].finish_reason in ("stop", "length")
        u = body.usage
        assert u is not None and 0 < u.completion_tokens <= 6 and u.prompt_tokens > 0
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
        assert u.prompt_tokens_details is not None
        assert 0 <= (u.prompt_tokens_details.cached_tokens or 0) <= u.prompt_tokens
    (bad,) = err
    assert bad["custom_id"] == "too-long" and bad["error"] is None
    assert bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["type"] == "invalid_request_error"
    assert set(bad["response"]["body"]["error"]) == {"message", "type", "param", "code"}
    assert "8192" in bad["response"]["body"]["error"]["message"]  # the engine's own reason
    assert b.usage is not None
    used = sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out)
    assert b.usage.output_tokens == used


def test_completions_batch_returns_text_completions(client: OpenAI) -> None:
    lines = [completion_line(f"c{i}", f"The number {i} is", max_tokens=5) for i in range(4)]
    b = wait(client, run_batch(client, lines, "/v1/completions").id)
    assert b.status == "completed" and b.error_file_id is None
    out = lines_of(client, b.output_file_id)
    assert [x["custom_id"] for x in out] == ["c0", "c1", "c2", "c3"]
    for x in out:
        body = Completion.model_validate(x["response"]["body"])
        assert body.object == "text_completion" and body.choices[0].text
        assert body.usage is not None and 0 < body.usage.completion_tokens <= 5


def test_n_choices_and_logprobs_take_openais_shapes(client: OpenAI) -> None:
    """A chat line asking for n=2 with logprobs and top_logprobs=2, and a completions line asking
    for logprobs=2, come back with every choice and one logprob entry per output token, in each
    endpoint's OpenAI shape; completion_tokens counts the tokens of every choice."""
    chat = chat_line(
        "multi",
        "Name a fruit.",
        max_tokens=5,
        n=2,
        temperature=0.8,
        seed=7,
        logprobs=True,
        top_logprobs=2,
    )
    b = wait(client, run_batch(client, [chat], "/v1/chat/completions").id)
    assert b.status == "completed", b
    (line,) = lines_of(client, b.output_file_id)
    body = ChatCompletion.model_validate(line["response"]["body"])
    assert [c.index for c in body.choices] == [0, 1]
    per_choice = []
    for c in body.choices:
        assert c.logprobs is not None and c.logprobs.content
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in c.logprobs.content)
        assert "".join(t.token for t in c.logprobs.content) == c.message.content
        per_choice.append(len(c.logprobs.content))
    assert body.usage is not None and body.usage.completion_tokens == sum(per_choice)

    comp = completion_line("lp", "The sky is", max_tokens=4, logprobs=2)
    b = wait(client, run_batch(client, [comp], "/v1/completions").id)
    (line,) = lines_of(client, b.output_file_id)
    text = Completion.model_validate(line["response"]["body"])
    lp = text.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == text.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]


def _reset_prefix_cache(settings: Any) -> None:
    async def go() -> None:
        r = aredis.Redis.from_url(settings.redis_url)
        try:
            await control.send(r, settings.keys, "reset_prefix_cache", ["cluster-s0", "cluster-s1"])
        finally:
            await r.aclose()

    asyncio.run(go())


def _strip(line: dict[str, Any]) -> dict[str, Any]:
    """The line without its ids and timestamps."""
    out = json.loads(json.dumps(line))
    del out["id"]
    resp = out["response"]
    del resp["request_id"]
    del resp["body"]["id"], resp["body"]["created"]
    return out


def test_submit_wait_out_gives_the_same_bodies_as_the_server(
    client: OpenAI, engines: Any, tmp_path: Path
) -> None:
    """The same input file through `prefixq submit --wait --out` (OpenAI lines: the openai format
    by default) and through the server gives byte-identical lines apart from ids and timestamps.
    Distinct short prompts and a reset prefix cache before each run make cached tokens equal."""
    lines = [completion_line(f"s{i}", f"Count to {i}:", max_tokens=6) for i in range(5)]
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl(lines))
    _reset_prefix_cache(engines.settings)
    out = tmp_path / "out.jsonl"
    p = subprocess.run(
        [
            *PREFIXQ,
            "submit",
            str(src),
            "--wait",
            "--out",
            str(out),
            *where(engines.settings),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    cli = [json.loads(x) for x in out.read_text().splitlines()]
    _reset_prefix_cache(engines.settings)
    b = wait(client, run_batch(client, lines, "/v1/completions").id)
    served = lines_of(client, b.output_file_id)
    assert len(cli) == len(served) == 5
    for a, s in zip(cli, served, strict=True):
        assert json.dumps(_strip(a)) == json.dumps(_strip(s))
    # and `prefixq results BATCH` writes the server's own lines again, byte for byte
    p = subprocess.run(
        [*PREFIXQ, "results", b.id, *where(engines.settings)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout == client.files.content(b.output_file_id or "").text


def test_cancel_mid_way_gives_partial_output_and_cancelled_lines(client: OpenAI) -> None:
    """Given three quick requests and ten long ones, a cancel once the quick ones are done ends
    `cancelled`: their lines are in the output file, the long ones have batch_cancelled lines in
    the error file, each file in input order, every request exactly once."""
    quick = [chat_line(f"fast-{i}", "Say hi.", max_tokens=2) for i in range(3)]
    slow = [
        chat_line(f"slow-{i}", f"Write a long story {i}.", max_tokens=256, ignore_eos=True)
        for i in range(10)
    ]
    b = run_batch(client, quick + slow, "/v1/chat/completions")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        cur = client.batches.retrieve(b.id)
        if cur.request_counts and cur.request_counts.completed >= 3:
            break
        time.sleep(0.2)
    c = client.batches.cancel(b.id)
    assert c.status in ("cancelling", "cancelled") and c.cancelling_at is not None
    b = wait(client, b.id)
    assert b.status == "cancelled" and b.cancelled_at is not None
    out, err = lines_of(client, b.output_file_id), lines_of(client, b.error_file_id)
    assert {x["custom_id"] for x in out} >= {"fast-0", "fast-1", "fast-2"}
    cancelled = [x for x in err if x["error"] and x["error"]["code"] == "batch_cancelled"]
    assert cancelled and all(x["response"] is None for x in cancelled)
    order = [x["custom_id"] for x in quick + slow]
    out_ids, err_ids = [x["custom_id"] for x in out], [x["custom_id"] for x in err]
    assert sorted(out_ids + err_ids) == sorted(order)  # each request exactly once
    assert out_ids == [i for i in order if i in out_ids]
    assert err_ids == [i for i in order if i in err_ids]
    assert b.request_counts is not None
    assert (b.request_counts.completed, b.request_counts.failed) == (len(out), len(err))


def test_a_batch_on_the_real_engine_sends_its_signed_webhook(engines: Any, server: Server) -> None:
    """Given a server with a webhook endpoint and the real CPU workers, a chat batch that completes
    sends one ``batch.completed`` that the official client's ``webhooks.unwrap`` accepts, naming
    the batch, whose output file is there by then."""
    import base64
    import os

    from helpers import wait_until
    from webhook_receiver import Receiver

    secret = "whsec_" + base64.b64encode(os.urandom(32)).decode()
    s = engines.settings
    # the module's server, without the webhooks setting, would race this one to finalize the
    # batch (and write no event): every server of a namespace needs the same setting, so it
    # stops meanwhile; this one takes its files directory (the namespace's: files_volume.py)
    server.stop()
    try:
        with Receiver() as rx:
            hooks = json.dumps({s.namespace: {"secret": secret, "endpoints": [{"url": rx.url}]}})
            with Server(s, server.files_dir, extra=["--webhooks", hooks]) as srv:
                c = OpenAI(base_url=srv.url, api_key="local", max_retries=0)
                lines = [chat_line(f"w{i}", "Say hi.", max_tokens=4) for i in range(2)]
                b = wait(c, run_batch(c, lines, "/v1/chat/completions").id)
                assert b.status == "completed", srv.tail()
                (got,) = wait_until(lambda: rx.ok(), 60, "the batch's webhook")
                ev = OpenAI(api_key="unused").webhooks.unwrap(got.body, got.headers, secret=secret)
                assert (ev.type, ev.data.id) == ("batch.completed", b.id)
                out = c.batches.retrieve(ev.data.id).output_file_id
                assert len(lines_of(c, out)) == len(lines)
    finally:
        server.start()


def _admitted(r: Any, keys: Keys, shards: int) -> int:
    """Requests the deployment's live workers handed to their engines, as their heartbeats say."""
    total = 0
    for k in range(shards):
        for name in r.zrange(keys.workers(k), 0, -1):
            total += int(r.hget(keys.heartbeat(k, name.decode()), "admitted") or 0)
    return total


def test_two_servers_run_a_batch_uploaded_through_one_and_created_through_the_other_once(
    engines: Any, server: Server, client: OpenAI
) -> None:
    """Given a second server on the same Redis and files directory: a file uploaded through it
    and a batch created through the first from that file complete once on the real workers (one
    burst, and the engines admitted each request once, by their heartbeats' counters); the output
    reads the same through both servers and both list the same files."""
    import redis as blocking

    s = engines.settings
    keys = Keys(s.namespace)
    r = blocking.Redis.from_url(s.redis_url)
    lines = [completion_line(f"two-{i}", f"Count to {i}:", max_tokens=4) for i in range(4)]
    with Server(s, server.files_dir) as other:
        c2 = OpenAI(base_url=other.url, api_key="local", max_retries=0)
        bursts, admitted = r.zcard(keys.bursts), _admitted(r, keys, 2)
        f = c2.files.create(file=("two.jsonl", jsonl(lines)), purpose="batch")
        assert client.files.retrieve(f.id) == f
        b = client.batches.create(
            input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
        )
        b = wait(c2, b.id)
        assert b.status == "completed", server.tail() + other.tail()
        assert r.zcard(keys.bursts) == bursts + 1
        deadline = time.monotonic() + 30  # the counters reach Redis with the next heartbeat
        while _admitted(r, keys, 2) < admitted + 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2 * s.heartbeat_s)  # one more beat: nothing admitted twice
        assert _admitted(r, keys, 2) == admitted + 4
        out = client.files.content(b.output_file_id or "").content
        assert c2.files.content(b.output_file_id or "").content == out
        assert [json.loads(x)["custom_id"] for x in out.splitlines()] == [
            f"two-{i}" for i in range(4)
        ]
        assert [x.id for x in client.files.list()] == [x.id for x in c2.files.list()]
    r.close()
