"""`prefixq serve` itself as a process, on a real Redis, without the engine: OpenAI-shaped 404s,
API keys and the namespaces they give, the hosts it answers without keys, and how it starts and
stops (a port in use, the sweeper's cancel). Files: test_openai_files.py; batches:
test_openai_batches.py."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis
from openai import OpenAI

from openai_server import Server, chat_line, jsonl
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings


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


# ---- auth and namespaces -------------------------------------------------------------------------
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


def test_health_answers_without_a_key(keyed: Server) -> None:
    r = httpx.get(keyed.url.removesuffix("/v1") + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    # HEAD too (load balancers' and uptime checkers' probes; it was a 405)
    r = httpx.head(keyed.url.removesuffix("/v1") + "/health")
    assert r.status_code == 200 and r.content == b""


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


def test_without_keys_the_server_says_so_at_start(server: Server) -> None:
    deadline = time.monotonic() + 10
    while "no API keys" not in server.tail() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "no API keys configured" in server.tail() and "127.0.0.1 only" in server.tail()


def test_without_keys_the_batch_api_answers_only_a_loopback_host(server: Server) -> None:
    """Given no API keys, /v1 requests naming another Host (a DNS-rebinding page whose name
    points at 127.0.0.1) get a 403 and reach no file or batch; localhost is served."""
    for method, path in (("GET", "/v1/files"), ("GET", "/v1/batches"), ("POST", "/v1/batches")):
        resp = httpx.request(method, server.url + path[3:], headers={"Host": "evil.example"})
        assert (resp.status_code, resp.json()["error"]["code"]) == (403, "host_not_allowed")
    ok = httpx.get(server.url + "/files", headers={"Host": f"localhost:{server.port}"})
    assert ok.status_code == 200 and ok.json()["object"] == "list"


# ---- start and stop ------------------------------------------------------------------------------
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


def test_a_webhooks_file_or_files_dir_that_cannot_be_used_is_one_line_and_exit_2(
    settings: Settings, tmp_path: Path
) -> None:
    """`serve --webhooks @missing` and `--webhooks @file-of-not-json`, and a `--files-dir` that is
    a regular file, exit 2 with one line naming the problem (before: the webhooks file failed in
    the app's start-up, a uvicorn traceback and exit 1; the folder a bare 'File exists', exit 1)."""
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    plain = tmp_path / "plain"
    plain.write_text("")
    for extra, says in (
        (("--webhooks", f"@{tmp_path / 'missing.json'}"), "webhooks: cannot read"),
        (("--webhooks", f"@{bad}"), "webhooks: not JSON"),
        (("--files-dir", str(plain)), f"files_dir {plain}: cannot be a folder here"),
    ):
        p = subprocess.run(
            [
                *(sys.executable, "-m", "prefixq", "serve", "--port", "0"),
                *("--redis-url", settings.redis_url, "--files-dir", str(tmp_path / "files")),
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert p.returncode == 2 and says in p.stderr, (extra, p.stderr)
        assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
