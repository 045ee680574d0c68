"""Keys vanishing under a live worker: its stream deleted or the database flushed while it blocks
in XREADGROUP; and a worker that cannot know the deployment's shard count.

Real worker processes (tests/fault_worker.py: the real `Worker` loop over the FakeEngine) on a
private redis-server; each fault is checked to have landed while the worker was blocked reading.
"""

from __future__ import annotations

import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from helpers import fault_worker, wait_until
from ledger import LEDGER, account
from prefixq.cli.redis_server import RedisServer
from prefixq.client import Producer
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings

pytestmark = pytest.mark.slow


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer(appendonly=False) as srv:
        yield srv


def blocked_reader(r: redis.Redis) -> bool:
    """A client is blocked in XREADGROUP right now."""
    return any(c.get("cmd") == "xreadgroup" and "b" in c.get("flags", "") for c in r.client_list())


def serve_one_burst(r: redis.Redis, s: Settings, what: str) -> None:
    burst = Producer(s).submit([{"id": f"q{i}", "prompt": f"a b {i}"} for i in range(10)])
    wait_until(lambda: r.hlen(Keys(s.namespace).results(burst)) == 10, 30, what)
    out = account(r, s, burst, 10, what=what)
    assert out.lost == 0 and out.duplicated == 0


@pytest.mark.parametrize("fault", ["DEL of the stream", "FLUSHALL"])
def test_stream_gone_while_the_worker_blocks_it_rejoins_and_serves(
    server: RedisServer, tmp_path: Path, fault: str
) -> None:
    """Given a worker blocked in XREADGROUP on its shard's stream, when the stream is deleted
    (or the whole database flushed), then the worker does not exit: it joins the group again and
    serves the next burst."""
    r = redis.Redis.from_url(server.url)
    s = Settings(redis_url=server.url, namespace=f"gone{secrets.token_hex(3)}", shards=1)
    log = tmp_path / "w.log"
    w = fault_worker(s, log, "--name", "w0")
    try:
        serve_one_burst(r, s, "before the fault")
        wait_until(lambda: blocked_reader(r), 30, "the worker blocked in XREADGROUP")
        marker = f"{s.namespace}:marker"
        r.set(marker, "1")
        if fault == "FLUSHALL":
            r.flushall()
            assert not r.exists(marker), "FLUSHALL did not land"
        else:
            assert r.delete(Keys(s.namespace).stream(0)) == 1, "the stream was not there to delete"
        LEDGER.fault(f"{fault} while the worker blocked reading its stream")
        time.sleep(1.5)
        assert w.poll() is None, f"worker exited {w.returncode}:\n{log.read_text()[-2000:]}"
        serve_one_burst(r, s, f"after {fault}")
    finally:
        w.send_signal(signal.SIGTERM)
        assert w.wait(60) == 0
    assert "Traceback" not in log.read_text()


def test_worker_without_a_shard_count_refuses_to_start(server: RedisServer, tmp_path: Path) -> None:
    """Given a fresh Redis with no deployment recorded, when a worker starts without --shards,
    then it exits 2 saying how to give the count, instead of serving a deployment that producers
    and `check` cannot see."""
    s = Settings(redis_url=server.url, namespace=f"noshards{secrets.token_hex(3)}", shards=0)
    log = tmp_path / "w.log"
    w = fault_worker(s, log, "--name", "w0")
    assert w.wait(30) == 2
    text = log.read_text()
    assert "--shards" in text and "Traceback" not in text
    r = redis.Redis.from_url(server.url)
    assert not r.exists(Keys(s.namespace).heartbeat(0, "w0"))


@pytest.mark.parametrize(
    ("shards", "args", "says"),
    [
        (1, ("--shard", "1"), "shard 1 does not exist"),
        (2, ("--shard", "1"), "--shards 2 but namespace"),
    ],
)
def test_worker_outside_the_recorded_deployment_refuses_to_start(
    server: RedisServer, tmp_path: Path, shards: int, args: tuple[str, ...], says: str
) -> None:
    """Given a deployment of 1 shard recorded in Redis, a worker for shard 1, or one started with
    --shards 2 (whose shard 1 no producer would ever send to, while producers keep using 1 shard),
    exits 2 saying why, before it joins any stream, instead of serving nothing forever."""
    ns = f"outside{secrets.token_hex(3)}"
    r = redis.Redis.from_url(server.url)
    keys = Keys(ns)
    r.hset(keys.config, "shards", 1)
    s = Settings(redis_url=server.url, namespace=ns, shards=shards)
    log = tmp_path / "w.log"
    w = fault_worker(s, log, "--name", "w1", *args)
    try:
        assert w.wait(30) == 2
    finally:
        w.kill()
        w.wait()
    text = log.read_text()
    assert says in text and "Traceback" not in text, text
    assert r.hget(keys.config, "shards") == b"1"
    assert not r.exists(keys.heartbeat(1, "w1"))
    assert not [k for k in r.scan_iter(match=f"{ns}:*") if k != keys.config.encode()]
