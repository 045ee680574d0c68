"""Webhooks against hostile receivers and addresses, on real `prefixq serve` processes and a real
Redis: a receiver that trickles its answer (the attempt must end at ``webhook_timeout_s``, not
when the receiver stops), and URLs no attempt can reach (a port that is no number, control
characters, an unclosed IPv6 host): refused where they are given, and an outbox record holding
one is a failed attempt, retried and given up as any other. docs/operations.md, "Receiving
webhooks"."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest
import redis
from openai import OpenAI

from helpers import requests, wait_until
from openai_server import Server
from prefixq.cli.redis_server import free_port
from prefixq.client import Producer
from prefixq.core.errors import ConfigError, ValidationError
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.store.webhook_outbox import Delivery
from test_webhooks import _config, _flags, _secret
from webhook_receiver import Receiver

BAD_URLS = ["http://h:abc/x", "http://h:99999/x", "http://[::1/x", "http://a\nb/x", "http://h/\x00"]


class Trickler:
    """A receiver that reads a request, answers ``200 OK`` and then one header byte every
    ``every`` seconds for ``for_s`` seconds: each read is quick, the answer never ends. Records
    how long each connection stayed open."""

    def __init__(self, every: float = 0.2, for_s: float = 15.0) -> None:
        self.port, self.every, self.for_s = free_port(), every, for_s
        self.held: list[float] = []
        self._sock = socket.create_server(("127.0.0.1", self.port))
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks"

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        t0 = time.monotonic()
        try:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\n")
            while time.monotonic() - t0 < self.for_s:
                conn.sendall(b"x")  # an endless header line, a byte at a time
                time.sleep(self.every)
        except OSError:  # the sender hung up
            pass
        finally:
            self.held.append(time.monotonic() - t0)
            conn.close()

    def close(self) -> None:
        self._stop = True
        self._sock.close()


class Flooder(Trickler):
    """A receiver that answers ``200 OK`` with a 4 GiB body and sends it as fast as the sender
    takes it; counts the bytes it got rid of."""

    def __init__(self) -> None:
        self.sent = 0
        super().__init__(every=0.0, for_s=20.0)

    def _one(self, conn: socket.socket) -> None:
        t0, chunk = time.monotonic(), b"x" * (1 << 20)
        try:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 4294967296\r\n\r\n")
            while time.monotonic() - t0 < self.for_s:
                conn.sendall(chunk)
                self.sent += len(chunk)
        except OSError:
            pass
        finally:
            self.held.append(time.monotonic() - t0)
            conn.close()


def test_a_receiver_answering_gigabytes_is_delivered_by_its_status_without_reading_them(
    settings: Settings, tmp_path: Path, r: redis.Redis
) -> None:
    """The answer's body was read whole: a receiver answering 4 GiB took the server from 85 MB
    to 2 GB (and the worker's memory too, for on_complete_url), never given back. The status
    decides; the body is never read, so the event is delivered at the first attempt."""
    rx = Flooder()
    flags = _flags(_config(settings.namespace, _secret(), rx.url), webhook_timeout_s=5.0)
    keys = Keys(settings.namespace)
    try:
        with Server(settings, tmp_path / "files", extra=flags) as srv:
            c = OpenAI(base_url=srv.url, api_key="k", max_retries=0)
            f = c.files.create(file=("e.jsonl", b"\n"), purpose="batch")  # empty: fails
            c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="1h")
            wait_until(lambda: r.hget(keys.hooks_stats, "delivered") == b"1", 20, "delivered")
            wait_until(lambda: len(rx.held) == 1, 10, "the receiver's connection closed")
    finally:
        rx.close()
    assert rx.sent < 64 << 20, rx.sent  # what the sockets' buffers took, not the body
    assert r.hget(keys.hooks_stats, "retried") is None


def test_a_webhook_urls_password_and_query_are_in_no_log_line(
    settings: Settings, tmp_path: Path
) -> None:
    """httpx's own INFO line ("HTTP Request: POST <url>") wrote the URL whole into the server's
    (and a worker's) log: a receiver's password and query token in cleartext."""
    with Receiver() as rx:
        url = rx.url.replace("http://", "http://alice:PASSW0RD@") + "?token=SUPERSECRET123"
        flags = _flags(_config(settings.namespace, _secret(), url))
        with Server(settings, tmp_path / "files", extra=flags) as srv:
            c = OpenAI(base_url=srv.url, api_key="k", max_retries=0)
            f = c.files.create(file=("e.jsonl", b"\n"), purpose="batch")  # empty: fails
            c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="1h")
            wait_until(lambda: rx.ok(), 20, "the batch's event")
            wait_until(lambda: "delivered" in srv.tail(20_000), 10, "the delivery's log line")
            log = srv.tail(100_000)
    assert "PASSW0RD" not in log and "SUPERSECRET123" not in log


def test_a_receiver_that_trickles_its_answer_is_cut_off_at_the_timeout(
    settings: Settings, tmp_path: Path
) -> None:
    """Given a receiver that sends a byte of its answer every 0.2 s for 15 s and a 1 s
    ``webhook_timeout_s``, each attempt of the failed batch's event ends after about 1 s (and is
    retried), instead of lasting as long as the receiver trickles."""
    rx = Trickler()
    flags = _flags(_config(settings.namespace, _secret(), rx.url), webhook_timeout_s=1.0)
    try:
        with Server(settings, tmp_path / "files", extra=flags) as srv:
            c = OpenAI(base_url=srv.url, api_key="k", max_retries=0)
            f = c.files.create(file=("e.jsonl", b"\n"), purpose="batch")  # empty: fails
            c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="1h")
            wait_until(lambda: len(rx.held) >= 2, 12, "two attempts ended")
            assert "no answer within webhook_timeout_s" in srv.tail(20_000)
    finally:
        rx.close()
    assert max(rx.held[:2]) < 4.0, rx.held


@pytest.mark.parametrize("url", BAD_URLS)
def test_a_url_no_attempt_can_reach_is_refused_where_it_is_given(
    settings: Settings, r: redis.Redis, url: str
) -> None:
    with pytest.raises(ValidationError, match="on_complete_url"):
        Producer(settings).submit(requests(1), on_complete_url=url)
    assert r.zcard(Keys(settings.namespace).bursts) == 0
    spec = {"ns": {"secret": _secret(), "endpoints": [{"url": url}]}}
    with pytest.raises(ConfigError, match="http"):
        Settings(webhooks=json.dumps(spec))


def test_an_outbox_delivery_to_a_malformed_url_is_retried_then_given_up(
    settings: Settings, tmp_path: Path, r: redis.Redis
) -> None:
    """Given an outbox record whose URL httpx cannot post to (queued before such URLs were
    refused), each attempt is a failed attempt, retried with backoff and given up after the
    retry window: counted and logged, not an exception every time its claim runs out."""
    keys = Keys(settings.namespace)
    flags = _flags(_config(settings.namespace, _secret()), webhook_retry_window_s=2)
    with Server(settings, tmp_path / "files", extra=flags) as srv:
        # queued once the server is up: its retry window (2 s from the record's time) is not
        # spent by a slow start (on a loaded machine the first attempt then gave up at once)
        d = Delivery("wh_badurl", "http://h:abc/x", '{"id":"evt_x"}', time.time(), 0, "")
        r.hset(keys.hooks, d.id, d.dumps())
        r.zadd(keys.hooks_due, {d.id: 0})
        wait_until(lambda: r.hget(keys.hooks_stats, "gave_up") == b"1", 20, "giving up")
        # the counter is set in Redis before the server writes its log line
        wait_until(lambda: "gave up after" in srv.tail(20_000), 10, "the give-up log line")
        log = srv.tail(20_000)
    assert r.hlen(keys.hooks) == 0 and int(r.hget(keys.hooks_stats, "retried") or 0) >= 1
    assert "gave up after" in log and "Traceback" not in log
