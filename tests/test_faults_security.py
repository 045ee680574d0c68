"""Untrusted peers: TLS and ACL users end to end, refused credentials and certificates
(docs/delivery.md, "Untrusted peers").
"""

from __future__ import annotations

import asyncio
import gc
import json
import signal
import subprocess
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from helpers import FakeWorker, cli, fault_worker, requests, wait_burst
from ledger import LEDGER, account
from prefixq.cli.redis_server import RedisServer, free_port
from prefixq.client import Producer
from prefixq.core.errors import ConfigError
from prefixq.core.settings import Settings
from prefixq.store.connection import async_client

pytestmark = pytest.mark.slow

MakeWorker = Callable[..., FakeWorker]


# ---- TLS and ACL -----------------------------------------------------------------------------
def make_certs(d: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it (openssl req -x509)."""
    ca_key, ca, key, csr, crt = (d / n for n in ("ca.key", "ca.crt", "s.key", "s.csr", "s.crt"))
    ext = d / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run = [
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca,
         "-days", "2", "-subj", "/CN=prefixq test CA"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
         "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-out", crt, "-days", "2", "-extfile", ext],
    ]  # fmt: skip
    for args in run:
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)
    return ca, crt, key


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, Path]]:
    """redis-server with TLS only (--port 0) and ACL users: alice may use keys tls:*, mallory
    only other:*, the default user is off."""
    ca, crt, key = make_certs(tmp_path_factory.mktemp("tls"))
    port = free_port()
    users = [
        ["--user", "default", "off"],
        ["--user", "alice", "on", ">s3cret-pw", "~tls:*", "+@all"],
        ["--user", "mallory", "on", ">mallory-pw", "~other:*", "+@all"],
    ]
    srv = RedisServer(
        port=port,
        extra_args=[
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--tls-cert-file",
            str(crt),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(ca),
            "--tls-auth-clients",
            "no",
            *(a for u in users for a in u),
        ],
    )
    srv.scheme = "rediss"
    with srv:
        yield srv, ca


def tls_url(srv: RedisServer, ca: Path, user: str, password: str) -> str:
    return (
        f"rediss://{user}:{password}@127.0.0.1:{srv.port}/0"
        f"?ssl_ca_certs={ca}&ssl_cert_reqs=required"
    )


def test_tls_and_acl_user_end_to_end(
    tls_server: tuple[RedisServer, Path], fake_worker: MakeWorker
) -> None:
    """Given redis-server speaking only TLS and an ACL user limited to the namespace's keys, a
    producer and a worker configured by a rediss:// URL (user, password, CA in the query) run a
    burst end to end, and the CLI reads it over the same URL."""
    srv, ca = tls_server
    s = Settings(redis_url=tls_url(srv, ca, "alice", "s3cret-pw"), namespace="tls", shards=1)
    rr = redis.Redis.from_url(s.redis_url)
    try:
        with fake_worker(s, name="tlsw"):
            burst = Producer(s).submit(requests(8))
            wait_burst(rr, s, burst, 30)
            out = account(rr, s, burst, 8, what="TLS burst")
        assert (out.lost, out.duplicated, out.done) == (0, 0, 8)
        p = cli(s, "inspect", "--json", "--burst", burst)
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["bursts"][0]["done"] == 8
        assert "s3cret-pw" not in p.stdout + p.stderr
    finally:
        rr.close()


@pytest.mark.parametrize(
    ("user", "password", "ca", "says"),
    [
        ("alice", "wrong-pw", True, "refused the credentials"),
        ("mallory", "mallory-pw", True, "refused the credentials or command"),
        ("alice", "s3cret-pw", False, "does not verify"),
    ],
    ids=["wrong-password", "no-access-to-the-namespace", "untrusted-certificate"],
)
def test_denied_user_gets_a_clear_error_at_once(
    tls_server: tuple[RedisServer, Path],
    tmp_path: Path,
    user: str,
    password: str,
    ca: bool,
    says: str,
) -> None:
    """Given credentials Redis refuses (or a server certificate the client cannot verify), the
    producer raises ConfigError at once (no retry can fix it), the CLI exits 2 with the hint and
    without the password, and a worker exits 2 instead of retrying for ever."""
    srv, ca_path = tls_server
    url = tls_url(srv, ca_path, user, password)
    if not ca:
        url = f"rediss://{user}:{password}@127.0.0.1:{srv.port}/0"
    s = Settings(redis_url=url, namespace="tls", shards=1)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=says) as err:
        Producer(s).submit(requests(1))
    took = time.monotonic() - t0
    print(f"  producer: ConfigError after {took:.2f}s: {err.value}")
    assert took < 3.0
    assert password not in str(err.value)

    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "prompt": "hi"}\n')
    p = cli(s, "submit", str(src))
    print(f"  prefixq submit: exit {p.returncode}: {p.stderr.strip()[-300:]}")
    assert p.returncode == 2 and says in p.stderr and password not in p.stderr

    proc = fault_worker(s, tmp_path / "denied.log", "--name", "denied")
    rc = proc.wait(30)
    print(f"  worker: exit {rc}")
    assert rc == 2 and says in (tmp_path / "denied.log").read_text()
    LEDGER.fault(f"denied connection: {says}")


def test_a_cancelled_command_over_tls_leaves_no_socket_open(
    tls_server: tuple[RedisServer, Path],
) -> None:
    """A blocking read cancelled on a TLS connection (what a worker's stop does to its readers)
    while Redis does not answer, the client closed and the event loop ended at once: no socket is
    left for the garbage collector (store/aio_connections.py: redis-py's forced close starts a TLS
    close whose answer the ended loop never reads)."""
    srv, ca = tls_server
    s = Settings(redis_url=tls_url(srv, ca, "alice", "s3cret-pw"), namespace="tls", shards=1)
    assert srv.proc is not None

    async def cancel_a_read() -> None:
        r = async_client(s)
        await r.ping()
        read = asyncio.create_task(r.xread({"tls:nothing": "$"}, block=5000))
        await asyncio.sleep(0.1)
        srv.proc.send_signal(signal.SIGSTOP)  # the close_notify goes unanswered
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read
        await r.aclose()

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ResourceWarning)
        try:
            for _ in range(3):
                asyncio.run(cancel_a_read())
                gc.collect()
                srv.proc.send_signal(signal.SIGCONT)
        finally:
            srv.proc.send_signal(signal.SIGCONT)
    unclosed = [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)]
    assert unclosed == []
