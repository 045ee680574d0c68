"""Redis out of memory (``maxmemory`` reached, ``noeviction``): nothing acked without a result.

Each test runs a private redis-server and real worker processes (tests/fault_worker.py: the
real `Worker` loop over the deterministic FakeEngine), sets ``maxmemory`` so low that Redis
refuses every write that needs memory — checked with a write of the test's own before the fault
is counted — and measures every burst's results in Redis (tests/ledger.py).
"""

from __future__ import annotations

import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from helpers import fault_worker, queue_empty, wait_until
from ledger import LEDGER, account
from prefixq.cli.redis_server import RedisServer
from prefixq.client import Producer
from prefixq.core.keys import LANE, Keys
from prefixq.core.settings import Settings

pytestmark = pytest.mark.slow


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer(appendonly=False) as srv:
        yield srv


def settings_for(srv: RedisServer, **kw: Any) -> Settings:
    base: dict[str, Any] = {
        "redis_url": srv.url,
        "namespace": f"oom{secrets.token_hex(3)}",
        "shards": 1,
        "heartbeat_s": 0.5,
        "claim_idle_s": 2.0,
        "max_inflight": 8,
    }
    return Settings(**(base | kw))


def results(r: redis.Redis, s: Settings, burst: str) -> int:
    return int(r.hlen(Keys(s.namespace).results(burst)))


def out_of_memory(r: redis.Redis) -> str:
    """Make Redis refuse every write that needs memory; returns the refusal, seen on a write of
    our own (so the fault is known to have landed)."""
    r.config_set("maxmemory", 1)
    with pytest.raises(redis.exceptions.OutOfMemoryError, match="maxmemory") as err:
        r.set(f"probe-{secrets.token_hex(3)}", "x")
    return str(err.value)


def sleepy(n: int, secs: float) -> list[dict[str, Any]]:
    return [{"id": f"q{i}", "prompt": f"sleep:{secs} q {i}", "max_tokens": 4} for i in range(n)]


def test_writes_refused_mid_burst_then_kill_9_loses_nothing(
    server: RedisServer, tmp_path: Path
) -> None:
    """Given a worker draining 200 slow requests, when Redis runs out of memory for 3 s and the
    worker is killed -9 meanwhile, then no entry was acked without its result, the reader stopped
    reading (pending stays within the in-flight window, plus the doorbells a worker may hold
    while it reads the lane entries sent before them), and a restarted worker finishes the burst
    with every result exactly once."""
    r = redis.Redis.from_url(server.url)
    s = settings_for(server)
    burst = Producer(s).submit(sleepy(200, 0.2))
    log = tmp_path / "w.log"
    w = fault_worker(s, log, "--name", "w0")
    try:
        wait_until(lambda: results(r, s, burst) >= 20, 60, "20 results before the fault")
        said = out_of_memory(r)
        before = results(r, s, burst)
        assert before < 200, "the burst finished before the fault landed"
        LEDGER.fault(f"Redis out of memory mid-burst ({before}/200 recorded): {said[:40]}")
        time.sleep(3)
        length, pending = queue_empty(r, s)  # over the shard's intakes and the burst's lane
        recorded = results(r, s, burst)
        acked = 200 - length  # an entry is deleted when it is acked
        assert recorded == before, "a result was recorded while Redis refused writes"
        assert acked <= recorded, f"{acked} entries acked but only {recorded} results recorded"
        bells = sum(1 for _, f in r.xrange(Keys(s.namespace).stream(0)) if LANE in f)
        assert pending <= s.max_inflight + bells, (
            f"the reader kept reading: {pending} pending (window {s.max_inflight}, "
            f"doorbells {bells})"
        )
        w.send_signal(signal.SIGKILL)
        w.wait(10)
        LEDGER.fault("kill -9 of the worker while its results could not be written")
    finally:
        if w.poll() is None:
            w.kill()
    r.config_set("maxmemory", 0)
    w2 = fault_worker(s, tmp_path / "w2.log", "--name", "w0")  # its backlog is replayed first
    try:
        wait_until(lambda: results(r, s, burst) == 200, 120, "all 200 results after the restart")
    finally:
        w2.send_signal(signal.SIGTERM)
        w2.wait(60)
    out = account(r, s, burst, 200, what="out of memory + kill -9")
    assert out.lost == 0 and out.duplicated == 0


def test_worker_started_while_redis_is_out_of_memory_waits_then_serves(
    server: RedisServer, tmp_path: Path
) -> None:
    """Given Redis out of memory, when a worker starts, then it keeps retrying to join its group
    (no traceback, no exit) and serves a burst once memory is back."""
    r = redis.Redis.from_url(server.url)
    s = settings_for(server)
    r.hset(Keys(s.namespace).config, "shards", 1)  # the deployment exists; its stream does not
    said = out_of_memory(r)
    LEDGER.fault(f"worker started while Redis is out of memory ({said[:40]})")
    log = tmp_path / "w.log"
    w = fault_worker(s, log, "--name", "w0")
    try:
        # a worker's start (imports) takes seconds on a loaded machine: wait for its first retry
        wait_until(lambda: "retrying in" in log.read_text() or w.poll() is not None, 60, "a retry")
        time.sleep(1)  # and one more try
        assert w.poll() is None, f"worker exited {w.returncode}:\n{log.read_text()[-2000:]}"
        text = log.read_text()
        assert "failed (OOM command not allowed" in text and "retrying in" in text, text
        assert "Traceback" not in text
        r.config_set("maxmemory", 0)
        burst = Producer(s).submit(sleepy(20, 0.0))
        wait_until(lambda: results(r, s, burst) == 20, 60, "the burst after memory came back")
    finally:
        w.send_signal(signal.SIGTERM)
        assert w.wait(60) == 0
    out = account(r, s, burst, 20, what="worker started under OOM")
    assert out.lost == 0 and out.duplicated == 0
