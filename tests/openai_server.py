"""`prefixq serve` (or `prefixq dashboard`) as a real process on a free port, and OpenAI batch
input lines, for the OpenAI Batch API and dashboard tests; the `server` and `client` fixtures
(conftest.py makes them every module's) and `wait_batch`, which the test_openai_* modules share."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import pytest

from prefixq.cli.redis_server import free_port
from prefixq.core.settings import Settings

if TYPE_CHECKING:
    from openai import OpenAI
    from openai.types import Batch

TESTS = Path(__file__).resolve().parent
PY = sys.executable


def flags(s: Settings, *names: str) -> list[str]:
    """``--name value`` flags for the given settings fields."""
    out: list[str] = []
    for name in ("redis_url", "namespace", *names):
        out += ["--" + name.replace("_", "-"), str(getattr(s, name))]
    return out


class Server:
    """``with Server(settings, files_dir) as srv: OpenAI(base_url=srv.url, ...)``; `restart()`
    kills it (SIGKILL) and starts it again on the same port."""

    def __init__(
        self,
        settings: Settings,
        files_dir: Path,
        *,
        api_keys: str = "",
        host: str = "127.0.0.1",
        extra: list[str] | None = None,
        command: str = "serve",
    ) -> None:
        self.settings, self.files_dir, self.host = settings, files_dir, host
        self.port = free_port()
        self.log = files_dir.parent / f"serve-{self.port}.log"
        self.cmd = [
            PY,
            "-m",
            "prefixq",
            command,
            "--host",
            host,
            "--port",
            str(self.port),
            "--files-dir",
            str(files_dir),
            *flags(settings, "shards"),
            *(["--api-keys", api_keys] if api_keys else []),
            *(extra or []),
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def root(self) -> str:
        """The dashboard's address (``/``)."""
        return f"http://127.0.0.1:{self.port}/"

    def start(self, timeout: float = 60) -> Server:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited {self.proc.returncode}:\n{self.tail()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"serve not listening after {timeout}s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def restart(self) -> Server:
        self.kill()
        return self.start()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def chat_line(cid: str, content: str, max_tokens: int = 8, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "smollm2",
            "max_tokens": max_tokens,
            "temperature": 0,
            "messages": [{"role": "user", "content": content}],
            **body,
        },
    }


def completion_line(cid: str, prompt: str, max_tokens: int = 8, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/completions",
        "body": {
            "model": "smollm2",
            "max_tokens": max_tokens,
            "temperature": 0,
            "prompt": prompt,
            **body,
        },
    }


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


@pytest.fixture
def server(settings: Settings, tmp_path: Path) -> Iterator[Server]:
    with Server(settings, tmp_path / "files", extra=["--max-file-lines", "20"]) as srv:
        yield srv


@pytest.fixture
def client(server: Server) -> OpenAI:
    from openai import OpenAI

    return OpenAI(base_url=server.url, api_key="anything", max_retries=0)


def wait_batch(c: OpenAI, batch_id: str, until: set[str], timeout: float = 60) -> Batch:
    deadline = time.monotonic() + timeout
    while True:
        b = c.batches.retrieve(batch_id)
        if b.status in until or time.monotonic() > deadline:
            return b
        time.sleep(0.2)
