"""`prefixq serve`'s Batch API against hostile input files, through the official `openai` client
on a real Redis: a line that is JSON but not a request object (``null``) fails the batch naming
its line, as every other bad line does, instead of being skipped as if it were blank; the CLI's
readers refuse it the same way. docs/openai.md, "Input file errors"."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from openai_server import Server, chat_line, jsonl, wait_batch
from prefixq.client.request_file import read_request_file
from prefixq.core.errors import ValidationError
from prefixq.core.inputs import read_requests


@pytest.mark.parametrize("value", ["null", " null \r", "5", '"x"', "[]"])
def test_a_json_line_that_is_no_object_fails_the_batch_naming_its_line(
    client: OpenAI, value: str
) -> None:
    lines = [json.dumps(chat_line("a", "hi")), value, "", json.dumps(chat_line("b", "yo"))]
    f = client.files.create(file=("n.jsonl", "\n".join(lines).encode()), purpose="batch")
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    b = wait_batch(client, b.id, {"failed", "in_progress", "completed"})
    assert b.status == "failed", b
    assert b.errors is not None and b.errors.data is not None
    assert [(e.line, e.code) for e in b.errors.data] == [(2, "invalid_request")]
    assert b.request_counts is not None and b.request_counts.total == 0


def test_the_cli_readers_refuse_a_null_line_and_skip_blank_ones(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "a", "prompt": "x"}\n\n  \nnull\n')
    for read in (read_requests, read_request_file):
        with pytest.raises(ValidationError, match="line 4"):
            read(str(path))
    path.write_text('{"id": "a", "prompt": "x"}\n\n  \r\n{"id": "b", "prompt": "y"}\n')
    assert [r.id for r in read_requests(str(path))] == ["a", "b"]
    assert [r.id for r in read_request_file(str(path))] == ["a", "b"]


@pytest.mark.parametrize("metadata", [r'{"a": "\ud800"}', r'{"\udc00": "v"}'])
def test_a_create_body_with_a_lone_surrogate_is_a_400_not_a_500(
    client: OpenAI, metadata: str
) -> None:
    """JSON escapes that decode to no text (a lone surrogate) are refused as an unparseable body
    in OpenAI's shape; nothing is created."""
    f = client.files.create(file=("a.jsonl", jsonl([chat_line("a", "hi")])), purpose="batch")
    body = (
        f'{{"input_file_id": "{f.id}", "endpoint": "/v1/chat/completions", '
        f'"completion_window": "24h", "metadata": {metadata}}}'
    )
    r = httpx.post(f"{client.base_url}batches", content=body.encode())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert client.batches.list().data == []


@pytest.mark.parametrize(
    "body",
    [
        b'{"input_file_id": ' + b"1" * 5000 + b"}",  # past Python's 4,300 digits
        b'{"metadata": {"k": ' + b"9" * 4301 + b"}}",
        b"[" * 100_000 + b"]" * 100_000,  # deeper than the parser goes (within the body limit)
    ],
)
def test_a_create_body_python_cannot_read_is_a_400_not_a_500(client: OpenAI, body: bytes) -> None:
    """A number longer than Python reads (a ValueError from json.loads, not a JSONDecodeError)
    was a 500 and a traceback in the server's log; now the unparseable-body 400 in OpenAI's
    shape, and the next request on the same connection is answered."""
    with httpx.Client(base_url=str(client.base_url)) as http:
        r = http.post("batches", content=body)
        assert r.status_code == 400, r.text
        assert "could not parse the JSON body" in r.json()["error"]["message"]
        assert http.get("batches").status_code == 200
    assert client.batches.list().data == []


@pytest.mark.parametrize("limit", [" 5", "+5", "1_0", "\u0665", "5\n", "99999999999999999999"])
def test_a_limit_that_is_no_plain_number_is_a_400(client: OpenAI, limit: str) -> None:
    """``limit`` is ASCII digits only (Python's int() also reads spaces, a sign, underscores and
    other scripts' digits); ``?limit=5`` still pages."""
    f = client.files.create(file=("a.jsonl", jsonl([chat_line("a", "hi")])), purpose="batch")
    for path in ("batches", "files"):
        r = httpx.get(f"{client.base_url}{path}", params={"limit": limit})
        assert r.status_code == 400, (path, limit, r.text)
        assert r.json()["error"]["param"] == "limit"
        ok = httpx.get(f"{client.base_url}{path}", params={"limit": "5"})
        assert ok.status_code == 200, ok.text
    assert [x.id for x in client.files.list(limit=5)] == [f.id]


def test_an_unknown_long_after_is_a_short_400(client: OpenAI) -> None:
    """An ``after`` that names no object is a 400 whose message cuts what it echoes."""
    r = httpx.get(f"{client.base_url}batches", params={"after": "x" * 8_000})
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == "after"
    assert len(r.text) < 1_000, len(r.text)


@pytest.mark.parametrize("path", ["/v1/batches", "/v1/files", "/api/dead/requeue"])
def test_a_client_that_leaves_mid_body_is_no_server_error(server: Server, path: str) -> None:
    """A client that sends half its body and closes the connection got an "Exception in ASGI
    application" traceback in the server's log (ClientDisconnect); now nothing at ERROR, and the
    server answers the next request."""
    import socket
    import time

    host, port = "127.0.0.1", server.port
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        "X-Prefixq-Action: 1\r\nContent-Length: 100000\r\n\r\n"
    )
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(head.encode() + b'{"input_file_id": "file-')
        time.sleep(0.3)
    time.sleep(0.5)
    assert httpx.get(f"{server.url}/batches", timeout=10).status_code == 200
    log = server.tail(20_000)
    assert "Traceback" not in log and "Exception in ASGI" not in log, log
