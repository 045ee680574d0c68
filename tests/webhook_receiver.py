"""A real HTTP webhook receiver on this machine for the webhook tests: `Receiver` records every
request it gets (headers and body) and answers what the test sets; it can be started late (a
receiver that is down: connections refused) and answer errors for a while."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType

from prefixq.cli.redis_server import free_port


@dataclass(frozen=True, slots=True)
class Got:
    """One request the receiver got, and the status it answered."""

    headers: dict[str, str]
    body: bytes
    status: int


class Receiver:
    """``with Receiver() as rx: ...`` listens on ``rx.url``; ``rx.fail_next = n`` answers the
    next n requests with 503; ``rx.delay_s`` holds each answer back (a slow receiver);
    ``Receiver(start=False)`` keeps the port closed until `start`."""

    def __init__(self, *, start: bool = True) -> None:
        self.port = free_port()
        self.got: list[Got] = []
        self.fail_next = 0
        self.delay_s = 0.0
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        if start:
            self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks?token=abc"

    def ok(self) -> list[Got]:
        """The requests answered 2xx."""
        with self._lock:
            return [g for g in self.got if g.status < 300]

    def start(self) -> Receiver:
        rx = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                time.sleep(rx.delay_s)
                with rx._lock:
                    status = 503 if rx.fail_next > 0 else 200
                    rx.fail_next = max(0, rx.fail_next - 1)
                    headers = {k.lower(): v for k, v in self.headers.items()}
                    rx.got.append(Got(headers, body, status))
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> Receiver:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
