"""`prefixq serve`'s Files API as a process, driven by the official `openai` client, on a real
Redis, without the engine: upload, get, list, content and delete; the upload limits and what a
refused or failed upload leaves (nothing); partial uploads a killed server left. The Batch API:
test_openai_batches.py; the server itself (routes, keys, hosts): test_openai_serve.py."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from openai import OpenAI

from helpers import wait_until
from openai_server import Server, chat_line, jsonl
from prefixq.core.errors import PrefixqError
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings


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


def test_a_boundary_too_long_for_the_parser_is_a_400_not_a_500(server: Server) -> None:
    """python-multipart refuses a boundary over 256 bytes in its constructor, which was outside
    the error handling: a plain-text 500 and a reset connection."""
    r = httpx.post(
        f"{server.url}/files",
        content=b"--" + b"a" * 5000 + b"--\r\n",
        headers={"content-type": "multipart/form-data; boundary=" + "a" * 5000},
    )
    assert r.status_code == 400 and "Malformed multipart body" in r.json()["error"]["message"]


def test_a_file_named_with_filename_star_is_taken_with_its_name(server: Server) -> None:
    """RFC 7578's ``filename*=UTF-8''...`` (what some clients send for a name that is not ASCII)
    was taken for no file at all: 400 "Missing required parameter: 'file'"."""
    body = (
        b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--b\r\n'
        b"Content-Disposition: form-data; name=\"file\"; filename*=UTF-8''%e2%82%ac.jsonl\r\n"
        b"\r\n" + jsonl([chat_line("a", "hi")]) + b"\r\n--b--\r\n"
    )
    r = httpx.post(
        f"{server.url}/files",
        content=body,
        headers={"content-type": "multipart/form-data; boundary=b"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["filename"] == "\u20ac.jsonl" and r.json()["bytes"] > 0


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


@pytest.mark.parametrize("order", ["desc", "asc"])
def test_deleting_each_listed_file_pages_through_all_of_them(client: OpenAI, order: str) -> None:
    """Given 7 files listed 2 a page by the client's auto-pagination, deleting each one as it
    comes asks for every next page after a file already deleted: all 7 come exactly once, in
    order, and all are deleted (the cursor goes on from where the deleted file was)."""
    made = [client.files.create(file=(f"{i}.jsonl", b"{}\n"), purpose="batch").id for i in range(7)]
    seen = []
    for f in client.files.list(limit=2, order=order):  # type: ignore[arg-type]
        seen.append(f.id)
        client.files.delete(f.id)
    assert seen == (made[::-1] if order == "desc" else made)
    assert client.files.list().data == []


def test_a_cursor_of_a_removed_file_keeps_its_place_among_files_of_the_same_millisecond(
    server: Server,
) -> None:
    """Given files listed under one score (created in the same millisecond: ordered by id), a
    page after one of them that was then deleted starts right after where it stood, both ways;
    an id that never existed is still a 400."""
    r = redis.Redis.from_url(server.settings.redis_url)
    keys = Keys(server.settings.namespace)
    c = OpenAI(base_url=server.url, api_key="k", max_retries=0)
    ids = [c.files.create(file=(f"{i}.jsonl", b"{}\n"), purpose="batch").id for i in range(5)]
    r.zadd(keys.oai_files, dict.fromkeys(ids, 1_000))  # one millisecond for all: ids' order
    ordered = sorted(ids)
    c.files.delete(ordered[2])
    assert [f.id for f in c.files.list(order="asc", after=ordered[2]).data] == ordered[3:]
    assert [f.id for f in c.files.list(order="desc", after=ordered[2]).data] == ordered[1::-1]
    with pytest.raises(openai.BadRequestError) as e:
        c.files.list(after="file-" + "0" * 24)
    assert e.value.body["param"] == "after"  # type: ignore[index]
