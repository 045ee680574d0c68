"""`prefixq serve` as a process, driven by the official `openai` client, on a real Redis, without
the engine: files, limits, auth and namespaces, batch parameters, input-file validation, list
pagination, and — with a FakeEngine worker — the batch lifecycle across restarts and two servers.
The real engine's end to end runs are in test_openai_engine.py."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from openai import OpenAI
from openai.types import Batch

from helpers import wait_until
from openai_server import Server, chat_line, completion_line
from prefixq.core.errors import PrefixqError
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


@pytest.fixture
def server(settings: Settings, tmp_path: Path) -> Iterator[Server]:
    with Server(settings, tmp_path / "files", extra=["--max-file-lines", "20"]) as srv:
        yield srv


@pytest.fixture
def client(server: Server) -> OpenAI:
    return OpenAI(base_url=server.url, api_key="anything", max_retries=0)


def wait_batch(c: OpenAI, batch_id: str, until: set[str], timeout: float = 60) -> Batch:
    deadline = time.monotonic() + timeout
    while True:
        b = c.batches.retrieve(batch_id)
        if b.status in until or time.monotonic() > deadline:
            return b
        time.sleep(0.2)


def test_file_upload_get_list_content_and_delete(client: OpenAI, server: Server) -> None:
    """A file comes back byte for byte, is listed newest first, and is gone once deleted."""
    data = jsonl([chat_line(f"r{i}", "hi") for i in range(3)])
    f = client.files.create(file=("in.jsonl", data), purpose="batch")
    assert f.bytes == len(data) and f.filename == "in.jsonl" and f.purpose == "batch"
    assert f.id.startswith("file-") and f.status == "processed"
    assert client.files.retrieve(f.id) == f
    assert client.files.content(f.id).content == data
    g = client.files.create(file=("b.jsonl", b'{"x": 1}'), purpose="batch")
    listed = client.files.list()
    assert [x.id for x in listed.data] == [g.id, f.id] and listed.has_more is False
    assert [x.id for x in client.files.list(order="asc")] == [f.id, g.id]
    deleted = client.files.delete(f.id)
    assert deleted.deleted and deleted.id == f.id
    with pytest.raises(openai.NotFoundError) as e:
        client.files.retrieve(f.id)
    assert e.value.body["message"] and e.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.files.content(f.id)
    assert not (server.files_dir / server.settings.namespace / f.id).exists()


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"x" * (4096 + 1), "file_too_large"),
        (b"{}\n" * 21, "too_many_lines"),
        (b"{}\n" * 20 + b"{}", "too_many_lines"),
    ],
)
def test_upload_over_a_limit_is_a_400_and_leaves_no_file(
    settings: Settings, tmp_path: Path, data: bytes, code: str
) -> None:
    """Given limits of 4096 bytes and 20 lines, a file over either is refused with an OpenAI
    error and nothing is left on disk or in Redis."""
    extra = ["--max-file-bytes", "4096", "--max-file-lines", "20"]
    with Server(settings, tmp_path / "files", extra=extra) as srv:
        c = OpenAI(base_url=srv.url, api_key="k", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            c.files.create(file=("big.jsonl", data), purpose="batch")
        assert e.value.status_code == 400 and e.value.code == code
        assert e.value.body["param"] == "file"  # type: ignore[index]
        assert list((tmp_path / "files" / settings.namespace).iterdir()) == []
        assert c.files.list().data == []
        ok = c.files.create(file=("ok.jsonl", b"{}\n" * 20), purpose="batch")
        assert ok.bytes == 60


def test_an_upload_redis_cannot_record_leaves_no_content_behind(
    settings: Settings, tmp_path: Path
) -> None:
    """Given Redis unreachable, an upload fails and its content does not stay in files_dir
    without an object (nothing could ever list or delete it)."""
    from prefixq.cli.redis_server import free_port
    from prefixq.openai.files import FileStore
    from prefixq.store.connection import async_client

    dead = settings.replace(
        redis_url=f"redis://127.0.0.1:{free_port()}", files_dir=str(tmp_path / "files")
    )
    body = b"--b\r\n" + (
        b'Content-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--b\r\n'
        b'Content-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'
        b'{"x": 1}\n\r\n--b--\r\n'
    )

    async def chunks() -> Any:
        yield body

    async def go() -> None:
        r = async_client(dead)
        try:
            await FileStore(r, dead, dead.namespace).upload(
                chunks(), "multipart/form-data; boundary=b"
            )
        finally:
            await r.aclose()

    with pytest.raises((redis.ConnectionError, PrefixqError)):
        asyncio.run(go())
    assert (tmp_path / "files" / dead.namespace).is_dir()  # the upload got that far
    assert list((tmp_path / "files" / dead.namespace).iterdir()) == []


def test_declared_upload_size_over_the_limit_is_413(settings: Settings, tmp_path: Path) -> None:
    with Server(settings, tmp_path / "files", extra=["--max-file-bytes", "100"]) as srv:
        r = httpx.post(
            f"{srv.url}/files",
            content=b"x" * (200 << 10),
            headers={"content-type": "multipart/form-data; boundary=b"},
        )
        assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"purpose": "fine-tune"}, "purpose"),
        ({"purpose": "assistants"}, "purpose"),
    ],
)
def test_upload_with_another_purpose_is_refused(
    client: OpenAI, kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("a.jsonl", b"{}"), **kwargs)
    assert e.value.body["param"] == param  # type: ignore[index]


def test_malformed_multipart_and_missing_fields_are_400(server: Server) -> None:
    r = httpx.post(f"{server.url}/files", content=b"{}", headers={"content-type": "text/plain"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(f"{server.url}/files", data={"purpose": "batch"}, files={"other": b"x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    r = httpx.post(f"{server.url}/files", files={"file": ("a.jsonl", b"{}")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"
    # a body cut before its closing boundary is refused, not stored as a truncated file
    cut = (
        b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--b\r\n'
        b'Content-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n{"x": 1}\n{"y'
    )
    r = httpx.post(
        f"{server.url}/files",
        content=cut,
        headers={"content-type": "multipart/form-data; boundary=b"},
    )
    assert r.status_code == 400 and "closing boundary" in r.json()["error"]["message"]
    assert list(httpx.get(f"{server.url}/files").json()["data"]) == []


def test_unknown_routes_and_objects_are_openai_shaped_404s(server: Server, client: OpenAI) -> None:
    r = httpx.get(f"{server.url}/models")
    assert r.status_code == 404 and r.json()["error"]["message"] == "Invalid URL (GET /v1/models)"
    for bad in ("..", "%2e%2e", "file-..", "..%2F..%2Fetc%2Fpasswd"):
        r = httpx.get(f"{server.url}/files/{bad}/content")
        assert r.status_code == 404, bad
        assert httpx.delete(f"{server.url}/files/{bad}").status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    with pytest.raises(openai.NotFoundError):
        client.batches.cancel("batch_nope")


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"completion_window": "1 day"}, "completion_window"),
        ({"completion_window": "0h"}, "completion_window"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"input_file_id": "file-missing"}, "input_file_id"),
    ],
)
def test_bad_batch_parameters_are_400s_naming_the_param(
    client: OpenAI, change: dict[str, Any], param: str
) -> None:
    f = client.files.create(file=("a.jsonl", jsonl([chat_line("a", "hi")])), purpose="batch")
    args: dict[str, Any] = {
        "input_file_id": f.id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    } | change
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(**args)
    assert e.value.body["param"] == param  # type: ignore[index]
    assert client.batches.list().data == []


def test_malformed_input_file_fails_the_batch_with_line_errors(client: OpenAI) -> None:
    """Given a file with a bad line 2 and a duplicate id on line 3, the batch ends `failed` with
    one error per bad line (code, line, param) and runs nothing."""
    lines = [
        json.dumps(chat_line("a", "hi")),
        "not json",
        json.dumps(chat_line("a", "again")),
        json.dumps(completion_line("c", "x")),
    ]
    f = client.files.create(file=("bad.jsonl", "\n".join(lines).encode()), purpose="batch")
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert b.status == "validating" and b.request_counts is not None
    b = wait_batch(client, b.id, {"failed"})
    assert b.status == "failed" and b.failed_at is not None and b.in_progress_at is None
    assert b.errors is not None and b.errors.data is not None
    got = [(e.line, e.code, e.param) for e in b.errors.data]
    assert got == [
        (2, "invalid_json_line", None),
        (3, "duplicate_custom_id", "custom_id"),
        (4, "url_mismatch", "url"),
    ]
    assert b.output_file_id is None and b.error_file_id is None


def test_batches_list_pages_newest_first_with_cursors(client: OpenAI) -> None:
    """Five batches, pages of two: first_id/last_id/has_more as OpenAI pages, and the client's
    auto-pagination walks all five newest first."""
    f = client.files.create(file=("e.jsonl", b"\n"), purpose="batch")
    ids = []
    for _ in range(5):
        b = client.batches.create(
            input_file_id=f.id, endpoint="/v1/completions", completion_window="1h"
        )
        ids.append(b.id)
        time.sleep(0.002)
    newest = ids[::-1]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == newest[:2] and first.has_more is True
    raw = httpx.get(f"{client.base_url}batches", params={"limit": 2, "after": newest[1]}).json()
    assert raw["object"] == "list" and raw["first_id"] == newest[2]
    assert raw["last_id"] == newest[3] and raw["has_more"] is True
    last = client.batches.list(limit=2, after=newest[3])
    assert [b.id for b in last.data] == newest[4:] and last.has_more is False
    assert [b.id for b in client.batches.list(limit=2)] == newest  # follows the cursors
    with pytest.raises(openai.BadRequestError):
        client.batches.list(limit=101)
    with pytest.raises(openai.BadRequestError):
        client.batches.list(after="batch_unknown")


# ---- auth and namespaces ---------------------------------------------------------------------
@pytest.fixture
def keyed(make_settings: Callable[..., Settings], tmp_path: Path) -> Iterator[Server]:
    s = make_settings()
    keys = f"key-a,key-b={s.namespace}-b"
    with Server(s, tmp_path / "files", api_keys=keys) as srv:
        yield srv


def test_wrong_or_missing_api_key_is_401(keyed: Server) -> None:
    bad = OpenAI(base_url=keyed.url, api_key="sk-wrong-key-000", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.files.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    assert "sk-wrong-key-000" not in str(e.value)
    r = httpx.get(f"{keyed.url}/batches")
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
    assert OpenAI(base_url=keyed.url, api_key="key-a").files.list().data == []


def test_a_key_sees_only_its_namespaces_objects(keyed: Server, r: redis.Redis) -> None:
    """key-b works in its own namespace: key-a's file and batch do not exist for it."""
    a = OpenAI(base_url=keyed.url, api_key="key-a", max_retries=0)
    b = OpenAI(base_url=keyed.url, api_key="key-b", max_retries=0)
    fa = a.files.create(file=("a.jsonl", jsonl([chat_line("x", "hi")])), purpose="batch")
    ba = a.batches.create(
        input_file_id=fa.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    with pytest.raises(openai.NotFoundError):
        b.files.retrieve(fa.id)
    with pytest.raises(openai.NotFoundError):
        b.batches.retrieve(ba.id)
    with pytest.raises(openai.BadRequestError):  # nor can it run a batch on that file
        b.batches.create(
            input_file_id=fa.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert b.files.list().data == [] and b.batches.list().data == []
    fb = b.files.create(file=("b.jsonl", b"{}"), purpose="batch")
    assert [f.id for f in a.files.list()] == [fa.id]
    ns = keyed.settings.namespace
    assert r.exists(Keys(ns).oai_file(fa.id)) and r.exists(Keys(f"{ns}-b").oai_file(fb.id))
    assert (keyed.files_dir / f"{ns}-b" / fb.id).is_file()


def test_without_keys_the_server_refuses_a_non_loopback_host(
    settings: Settings, tmp_path: Path
) -> None:
    p = subprocess.run(
        [
            *(sys.executable, "-m", "prefixq", "serve", "--host", "0.0.0.0", "--port", "0"),
            *("--redis-url", settings.redis_url, "--files-dir", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert p.returncode == 2 and "PREFIXQ_API_KEYS" in p.stderr


def test_a_port_in_use_exits_1_instead_of_hanging(settings: Settings, tmp_path: Path) -> None:
    """Given a port another process listens on, `prefixq serve` says so and exits 1. (It used to
    hang for ever: the app's shutdown waited on a sweeper whose cancel redis-py had swallowed
    while it opened its first connection.)"""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = subprocess.run(
            [
                *(sys.executable, "-m", "prefixq", "serve", "--port", str(port)),
                *("--redis-url", settings.redis_url, "--files-dir", str(tmp_path)),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert p.returncode == 1, p.stderr
    assert "address already in use" in p.stderr


def test_the_sweeper_stops_when_a_redis_call_swallowed_its_cancel(settings: Settings) -> None:
    """Given a sweep that swallows the cancel (as redis-py's asyncio client does when the cancel
    lands while it connects), the sweeper's loop still ends, cancelled, after that sweep."""
    from prefixq.openai.runner import Sweeper
    from prefixq.store.connection import async_client

    async def go() -> bool:
        r = async_client(settings)
        sweeper = Sweeper(r, settings, [settings.namespace])
        swallowed = asyncio.Event()

        async def sweep() -> None:
            if swallowed.is_set():
                return
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:  # once
                swallowed.set()

        sweeper.sweep = sweep  # type: ignore[method-assign]
        task = asyncio.create_task(sweeper.run(0.01))
        await asyncio.sleep(0.1)
        task.cancel()
        try:
            await asyncio.wait_for(asyncio.shield(task), 10)
        except (asyncio.CancelledError, TimeoutError):
            pass
        finally:
            await r.aclose()
        assert swallowed.is_set()  # the fault landed
        stopped = task.cancelled()
        task.cancel()
        return stopped

    assert asyncio.run(go())


def test_without_keys_the_server_says_so_at_start(server: Server) -> None:
    deadline = time.monotonic() + 10
    while "no API keys" not in server.tail() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "no API keys configured" in server.tail() and "127.0.0.1 only" in server.tail()


# ---- the lifecycle with a FakeEngine worker -----------------------------------------------------
def test_batch_survives_a_server_restart_and_finalizes_without_polling(
    settings: Settings, tmp_path: Path, r: redis.Redis, fake_worker: Callable[..., Any]
) -> None:
    """Given a batch created while no worker runs, when the server is killed (SIGKILL) and started
    again and a worker appears, the batch completes and its files are written although no client
    asks for it in the meantime; output and error lines follow the input order."""
    lines = [completion_line(f"r{i}", f"one two three {i}") for i in range(6)]
    lines[3] = completion_line("r3", "fail: on purpose")
    with Server(settings, tmp_path / "files") as srv:
        c = OpenAI(base_url=srv.url, api_key="k", max_retries=0)
        f = c.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        b = c.batches.create(
            input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
        )
        b = wait_batch(c, b.id, {"in_progress"})
        assert b.status == "in_progress" and b.request_counts.total == 6  # type: ignore[union-attr]
        srv.restart()
        assert c.batches.retrieve(b.id).status == "in_progress"
        with fake_worker(settings):
            key = Keys(settings.namespace).oai_batch(b.id)
            deadline = time.monotonic() + 60
            while r.hget(key, "status") != b"completed" and time.monotonic() < deadline:
                time.sleep(0.2)  # Redis only: no client polls the server
            done = c.batches.retrieve(b.id)
    assert done.status == "completed", srv.tail()
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (6, 5)
    assert done.request_counts.failed == 1
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    assert done.usage is not None and done.usage.output_tokens > 0
    with Server(settings, tmp_path / "files") as srv:
        c = OpenAI(base_url=srv.url, api_key="k", max_retries=0)
        out = [json.loads(x) for x in c.files.content(done.output_file_id or "").text.splitlines()]
        err = [json.loads(x) for x in c.files.content(done.error_file_id or "").text.splitlines()]
        assert [x["custom_id"] for x in out] == ["r0", "r1", "r2", "r4", "r5"]
        assert out[0]["response"]["body"]["choices"][0]["text"] == "0 three two one"
        assert [x["custom_id"] for x in err] == ["r3"]
        assert err[0]["response"]["status_code"] == 500 and err[0]["error"] is None
        names = {x.filename for x in c.files.list(purpose="batch_output")}
        assert names == {f"{b.id}_output.jsonl", f"{b.id}_error.jsonl"}


def test_two_servers_finalize_each_batch_once(
    settings: Settings, tmp_path: Path, fake_worker: Callable[..., Any]
) -> None:
    """Given two servers on one Redis and one files directory, every batch gets exactly one output
    file: each step runs under a lease."""
    files = tmp_path / "files"
    with Server(settings, files) as one, Server(settings, files) as two:
        with fake_worker(settings):
            c1 = OpenAI(base_url=one.url, api_key="k", max_retries=0)
            c2 = OpenAI(base_url=two.url, api_key="k", max_retries=0)
            ids = []
            for i in range(6):
                c = (c1, c2)[i % 2]
                f = c.files.create(
                    file=(
                        "in.jsonl",
                        jsonl([completion_line(f"q{j}", f"a b {i} {j}") for j in range(3)]),
                    ),
                    purpose="batch",
                )
                ids.append(
                    c.batches.create(
                        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
                    ).id
                )
            done = [wait_batch((c2, c1)[i % 2], b, {"completed"}) for i, b in enumerate(ids)]
        assert [b.status for b in done] == ["completed"] * 6
        outputs = list(c1.files.list(purpose="batch_output"))
        assert sorted(f.id for f in outputs) == sorted(b.output_file_id or "" for b in done)
        assert len({f.filename for f in outputs}) == 6
        on_disk = [p.name for p in (files / settings.namespace).iterdir()]
        assert len(on_disk) == 12 and not [n for n in on_disk if n.startswith(".")]


def test_short_completion_window_expires_what_had_no_result(
    settings: Settings, tmp_path: Path, fake_worker: Callable[..., Any]
) -> None:
    """Given a 3 s window, two quick requests and ten that take 8 s each (eight of them in the
    engine, two queued), the batch ends `expired` at the deadline, without waiting for the slow
    ones: the quick ones are in the output file, the ten have batch_expired lines, in order."""
    quick = [completion_line(f"q{i}", "a b c") for i in range(2)]
    slow = [completion_line(f"s{i}", "sleep:8 a b") for i in range(10)]
    with Server(settings, tmp_path / "files") as srv, fake_worker(settings):
        c = OpenAI(base_url=srv.url, api_key="k", max_retries=0)
        f = c.files.create(file=("in.jsonl", jsonl(quick + slow)), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="3s")
        assert b.expires_at == b.created_at + 3
        b = wait_batch(c, b.id, {"expired", "completed", "failed", "cancelled"}, timeout=15)
        assert b.status == "expired" and b.expired_at is not None, srv.tail()
        assert b.expired_at - b.created_at < 10
        assert b.request_counts is not None
        assert (b.request_counts.completed, b.request_counts.failed) == (2, 10)
        out = [json.loads(x) for x in c.files.content(b.output_file_id or "").text.splitlines()]
        err = [json.loads(x) for x in c.files.content(b.error_file_id or "").text.splitlines()]
    assert [x["custom_id"] for x in out] == ["q0", "q1"]
    assert [x["custom_id"] for x in err] == [f"s{i}" for i in range(10)]
    assert all(x["error"]["code"] == "batch_expired" and x["response"] is None for x in err)


def test_cancel_mid_way_keeps_finished_lines_and_cancels_the_rest(
    settings: Settings, tmp_path: Path, fake_worker: Callable[..., Any]
) -> None:
    """Given two quick requests and ten slow ones, a cancel once the quick ones are done ends
    `cancelled` without waiting for the slow ones: output has the quick ones, every other request
    a batch_cancelled line; a second cancel returns the batch unchanged."""
    quick = [completion_line(f"q{i}", "a b c") for i in range(2)]
    slow = [completion_line(f"s{i}", "sleep:8 a b") for i in range(10)]
    with Server(settings, tmp_path / "files") as srv, fake_worker(settings):
        c = OpenAI(base_url=srv.url, api_key="k", max_retries=0)
        f = c.files.create(file=("in.jsonl", jsonl(quick + slow)), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="1h")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            counts = c.batches.retrieve(b.id).request_counts
            if counts is not None and counts.completed >= 2:
                break
            time.sleep(0.1)
        cancelling = c.batches.cancel(b.id)
        assert cancelling.status in ("cancelling", "cancelled")
        assert cancelling.cancelling_at is not None
        b = wait_batch(c, b.id, {"cancelled", "completed", "failed", "expired"}, timeout=15)
        assert b.status == "cancelled" and b.cancelled_at is not None, srv.tail()
        assert c.batches.cancel(b.id).status == "cancelled"
        out = [json.loads(x) for x in c.files.content(b.output_file_id or "").text.splitlines()]
        err = [json.loads(x) for x in c.files.content(b.error_file_id or "").text.splitlines()]
    assert [x["custom_id"] for x in out] == ["q0", "q1"]
    assert [x["custom_id"] for x in err] == [f"s{i}" for i in range(10)]
    assert all(x["error"]["code"] == "batch_cancelled" and x["response"] is None for x in err)


def test_cancel_of_a_finished_batch_is_a_409(client: OpenAI) -> None:
    f = client.files.create(file=("bad.jsonl", b"not json\n"), purpose="batch")
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="1h"
    )
    assert wait_batch(client, b.id, {"failed"}).status == "failed"
    with pytest.raises(openai.ConflictError) as e:
        client.batches.cancel(b.id)
    assert "failed" in e.value.message


def test_health_answers_without_a_key(keyed: Server) -> None:
    r = httpx.get(keyed.url.removesuffix("/v1") + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def _orphan_batch(settings: Settings, tmp_path: Path, lines: list[dict[str, Any]]) -> str:
    """A batch as a server that died right after creating it leaves it: record written, status
    `validating`, its lease gone (expired). Returns the batch id."""
    from prefixq.openai.batches import BatchStore
    from prefixq.openai.files import new_file_id
    from prefixq.store.connection import async_client

    async def go() -> str:
        r = async_client(settings.replace(files_dir=str(tmp_path / "files")))
        try:
            st = BatchStore(
                r, settings.replace(files_dir=str(tmp_path / "files")), settings.namespace
            )
            st.files.dir.mkdir(parents=True, exist_ok=True)
            fid = new_file_id()
            data = jsonl(lines)
            st.files.path(fid).write_bytes(data)
            await st.files.record(fid, "in.jsonl", "batch", len(data), len(lines))
            obj, _ = await st.create(
                {"input_file_id": fid, "endpoint": "/v1/completions", "completion_window": "24h"}
            )
            await r.delete(st.keys.oai_lease(obj["id"]))
            return str(obj["id"])
        finally:
            await r.aclose()

    return asyncio.run(go())


def test_a_batch_left_validating_by_a_dead_server_is_taken_over(
    settings: Settings, tmp_path: Path, r: redis.Redis, fake_worker: Callable[..., Any]
) -> None:
    """Given a batch whose server died while it was `validating`, another server's sweeper takes it
    over once the lease is gone, queues it once, and it completes."""
    batch_id = _orphan_batch(
        settings, tmp_path, [completion_line(f"o{i}", "x y") for i in range(3)]
    )
    with fake_worker(settings), Server(settings, tmp_path / "files") as srv:
        c = OpenAI(base_url=srv.url, api_key="k", max_retries=0)
        b = wait_batch(c, batch_id, {"completed", "failed"})
    assert b.status == "completed" and b.request_counts is not None
    assert b.request_counts.completed == 3
    assert r.hget(Keys(settings.namespace).burst(batch_id), "total") == b"3"


def test_a_burst_queued_by_a_dead_server_is_not_queued_twice(
    settings: Settings, tmp_path: Path, r: redis.Redis
) -> None:
    """Given a dead server that had queued the whole burst but not recorded it, the server that
    takes the batch over finds the burst complete and moves on without queueing it again."""
    from prefixq.client import Producer

    lines = [completion_line(f"d{i}", "x y") for i in range(3)]
    batch_id = _orphan_batch(settings, tmp_path, lines)
    Producer(settings).submit(lines, burst_id=batch_id)
    keys = Keys(settings.namespace)
    queued = r.xlen(keys.stream(0))
    with Server(settings, tmp_path / "files") as srv:
        c = OpenAI(base_url=srv.url, api_key="k", max_retries=0)
        b = wait_batch(c, batch_id, {"in_progress", "failed"})
        assert b.status == "in_progress" and b.request_counts is not None
        assert b.request_counts.total == 3
        assert r.xlen(keys.stream(0)) == queued == 3
        assert r.hget(keys.oai_batch(batch_id), "burst") == batch_id.encode()


def test_a_cancel_while_the_input_file_is_checked_queues_nothing(
    settings: Settings, tmp_path: Path, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a batch cancelled while its input file is being checked (a big file takes seconds),
    it ends `cancelled` and none of its requests is queued. The cancel used to be applied only
    once the whole burst was queued, and workers ran thousands of its requests meanwhile."""
    from prefixq.openai import lease, runner
    from prefixq.store.connection import async_client

    batch_id = _orphan_batch(
        settings, tmp_path, [completion_line(f"v{i}", "x y") for i in range(5)]
    )
    s = settings.replace(files_dir=str(tmp_path / "files"))
    keys = Keys(settings.namespace)
    check = runner.check_input
    cancelled: list[bool] = []

    def check_then_cancel(*args: Any) -> Any:
        out = check(*args)
        # what POST /v1/batches/{id}/cancel does meanwhile (no burst yet, so nothing to cancel)
        r.hset(keys.oai_batch(batch_id), mapping={"status": "cancelling", "cancelling_at": 1})
        cancelled.append(True)
        return out

    monkeypatch.setattr(runner, "check_input", check_then_cancel)

    async def go() -> dict[str, Any]:
        ar = async_client(s)
        try:
            sweeper = runner.Sweeper(ar, s, [s.namespace])
            store = sweeper.stores[s.namespace]
            token = await lease.acquire(ar, keys.oai_lease(batch_id))
            assert token is not None
            await sweeper.start(store, batch_id, token)
            return await store.get(batch_id)
        finally:
            await ar.aclose()

    b = asyncio.run(go())
    assert cancelled  # the cancel landed while the file was checked
    assert b["status"] == "cancelled" and b["cancelled_at"] is not None
    assert b["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert not r.exists(keys.burst(batch_id))


def test_a_result_that_does_not_decode_becomes_an_error_line(
    client: OpenAI, settings: Settings, r: redis.Redis
) -> None:
    """Given a finished burst whose second result is garbage (anything with write access to Redis
    could put it there), the batch still completes: the good result in the output file, a 500
    internal_error line for the garbage one, instead of a finalizer failing for ever."""
    from prefixq.core import wire
    from prefixq.core.records import Result

    lines = [completion_line("good", "a b"), completion_line("bad", "c d")]
    f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="1h"
    )
    assert wait_batch(client, b.id, {"in_progress"}).status == "in_progress"
    keys = Keys(settings.namespace)
    ok = Result(id="good", index=0, text="b a", finish_reason="stop", output_tokens=2)
    r.hset(keys.results(b.id), mapping={0: wire.encode(ok.to_wire()), 1: b"\x07garbage"})
    r.hset(keys.burst(b.id), mapping={"done": 1, "failed": 1})
    b = wait_batch(client, b.id, {"completed", "failed"})
    assert b.status == "completed"
    (good,) = [
        json.loads(x) for x in client.files.content(b.output_file_id or "").text.splitlines()
    ]
    (bad,) = [json.loads(x) for x in client.files.content(b.error_file_id or "").text.splitlines()]
    assert good["custom_id"] == "good" and good["response"]["body"]["choices"][0]["text"] == "b a"
    assert bad["custom_id"] == "bad" and bad["response"]["status_code"] == 500
    assert "does not decode" in bad["response"]["body"]["error"]["message"]


def test_finalizing_removes_what_a_killed_finalizer_left_half_written(
    client: OpenAI, server: Server, settings: Settings, r: redis.Redis
) -> None:
    """Given the half-written output of a finalizer killed mid-way (its temporary file), the
    finalizer that takes over removes it: nothing but the published files stays in files_dir."""
    from prefixq.core import wire
    from prefixq.core.records import Result

    f = client.files.create(
        file=("in.jsonl", jsonl([completion_line("a", "x y")])), purpose="batch"
    )
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="1h"
    )
    assert wait_batch(client, b.id, {"in_progress"}).status == "in_progress"
    folder = server.files_dir / settings.namespace
    stale = folder / f".final-{b.id}-file-{'0' * 24}"
    stale.write_text('{"custom_id": "a", "half written')
    keys = Keys(settings.namespace)
    ok = Result(id="a", index=0, text="y x", finish_reason="stop", output_tokens=2)
    r.hset(keys.results(b.id), mapping={0: wire.encode(ok.to_wire())})
    r.hset(keys.burst(b.id), mapping={"done": 1})
    b = wait_batch(client, b.id, {"completed", "failed"})
    assert b.status == "completed" and b.request_counts is not None
    assert b.request_counts.completed == 1
    assert sorted(p.name for p in folder.iterdir()) == sorted([f.id, b.output_file_id or ""])


def test_finalizing_removes_files_a_killed_finalizer_published_but_never_gave_the_batch(
    client: OpenAI, server: Server, settings: Settings, r: redis.Redis
) -> None:
    """Given a finalizer killed after it published an output file and before the batch pointed
    at it, the finalizer that takes over removes that file: the batch has one output file, and no
    second `<batch>_output.jsonl` is listed for ever."""
    from prefixq.core import wire
    from prefixq.core.records import Result
    from prefixq.openai.files import new_file_id

    f = client.files.create(
        file=("in.jsonl", jsonl([completion_line("a", "x y")])), purpose="batch"
    )
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="1h"
    )
    assert wait_batch(client, b.id, {"in_progress"}).status == "in_progress"
    keys = Keys(settings.namespace)
    orphan = new_file_id()  # what the killed finalizer had published
    (server.files_dir / settings.namespace / orphan).write_text("{}\n")
    r.hset(
        keys.oai_file(orphan),
        mapping={
            "id": orphan,
            "bytes": 3,
            "lines": 1,
            "created_at": 1,
            "filename": f"{b.id}_output.jsonl",
            "purpose": "batch_output",
        },
    )
    r.zadd(keys.oai_files, {orphan: 1})
    r.hset(keys.oai_batch(b.id), "publishing", orphan)
    assert client.files.retrieve(orphan).filename == f"{b.id}_output.jsonl"
    ok = Result(id="a", index=0, text="y x", finish_reason="stop", output_tokens=2)
    r.hset(keys.results(b.id), mapping={0: wire.encode(ok.to_wire())})
    r.hset(keys.burst(b.id), mapping={"done": 1})
    b = wait_batch(client, b.id, {"completed", "failed"})
    assert b.status == "completed" and b.output_file_id not in (None, orphan)
    outputs = [x.id for x in client.files.list(purpose="batch_output")]
    assert outputs == [b.output_file_id]
    assert not (server.files_dir / settings.namespace / orphan).exists()


def test_a_started_server_removes_partial_uploads_a_killed_one_left(
    settings: Settings, tmp_path: Path
) -> None:
    """A `.upload-*` file that nothing has written to for over an hour (a server killed mid-
    upload) is removed when a server starts; a fresh one (an upload in progress) and the stored
    files stay."""
    folder = tmp_path / "files" / settings.namespace
    folder.mkdir(parents=True)
    stale, fresh = folder / ".upload-file-0", folder / ".upload-file-1"
    kept = folder / ("file-" + "0" * 24)
    for f in (stale, fresh, kept):
        f.write_bytes(b'{"x": 1}\n')
    two_hours_ago = time.time() - 7200
    os.utime(stale, (two_hours_ago, two_hours_ago))
    os.utime(kept, (two_hours_ago, two_hours_ago))
    with Server(settings, tmp_path / "files"):
        wait_until(lambda: not stale.exists(), 30, "the stale partial upload removed")
        assert fresh.exists() and kept.exists()


def test_without_keys_the_batch_api_answers_only_a_loopback_host(server: Server) -> None:
    """Given no API keys, /v1 requests naming another Host (a DNS-rebinding page whose name
    points at 127.0.0.1) get a 403 and reach no file or batch; localhost is served."""
    for method, path in (("GET", "/v1/files"), ("GET", "/v1/batches"), ("POST", "/v1/batches")):
        resp = httpx.request(method, server.url + path[3:], headers={"Host": "evil.example"})
        assert (resp.status_code, resp.json()["error"]["code"]) == (403, "host_not_allowed")
    ok = httpx.get(server.url + "/files", headers={"Host": f"localhost:{server.port}"})
    assert ok.status_code == 200 and ok.json()["object"] == "list"
