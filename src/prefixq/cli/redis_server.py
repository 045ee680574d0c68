"""A private `redis-server` on a free port in a temp dir: for the demo and the test suite.

It can be killed (``kill()``, SIGKILL) and started again on the same port and directory, so tests
can crash Redis mid-burst; with ``appendonly=True`` it keeps an AOF (fsync everysec) there.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from prefixq.core.errors import SetupError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """``with RedisServer() as srv: srv.url``: started on enter, stopped and removed on exit."""

    def __init__(
        self,
        *,
        port: int = 0,
        appendonly: bool = False,
        extra_args: list[str] | None = None,
        binary: str = "redis-server",
    ) -> None:
        self.binary = shutil.which(binary) or ""
        if not self.binary:
            raise SetupError(
                "redis-server is not on PATH: install it (Debian/Ubuntu: "
                "apt-get install redis-server; macOS: brew install redis) or set "
                "REDIS_URL to a running server"
            )
        self.port = port or free_port()
        self.appendonly = appendonly
        self.extra_args = extra_args or []
        self.dir = Path(tempfile.mkdtemp(prefix="prefixq-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.scheme = "redis"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
            "--logfile",
            str(self.dir / "redis.log"),
        ]
        if self.appendonly:
            args += ["--appendonly", "yes", "--appendfsync", "everysec"]
        self.proc = subprocess.Popen(
            [*args, *self.extra_args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.dir / "redis.log").read_text(errors="replace")[-2000:]
                raise SetupError(f"redis-server exited at start ({self.proc.returncode}): {log}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        raise SetupError(f"redis-server did not listen on port {self.port} within {timeout}s")

    def kill(self) -> None:
        """SIGKILL, as a crash would (the AOF keeps what was fsynced)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        try:
            return self.start()
        except BaseException:  # a failed or interrupted start leaves no server and no folder
            self.close()
            raise

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
