"""An elastic fleet under faults, on real worker processes over the FakeEngine
(tests/fault_worker.py) and a real redis-server: a worker stopped (SIGSTOP) long enough for its
shard's queue to move comes back as a zombie; every request still ends with exactly one result."""

from __future__ import annotations

import secrets
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import redis

from helpers import doc_burst, fault_worker, wait_until
from ledger import account
from prefixq.client import Producer
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings


def _start(s: Settings, log: Path, shard: int, name: str) -> subprocess.Popen[bytes]:
    return fault_worker(
        s,
        log,
        "--shard",
        str(shard),
        "--name",
        name,
        "--heartbeat-ttl-s",
        "1.5",
        "--orphan-after-s",
        "2",
    )


def test_a_zombie_whose_queue_moved_doubles_no_result(
    redis_server: Any, r: redis.Redis, tmp_path: Path
) -> None:
    """Given two workers serving a burst, when worker 1 is stopped (SIGSTOP) with requests in
    flight until its shard's queue (and its in-flight entries) moved to worker 0, and then comes
    back, then the burst ends with every request's result exactly once, none failed."""
    s = Settings(
        redis_url=redis_server.url,
        namespace=f"zombie{secrets.token_hex(3)}",
        shards=2,
        heartbeat_s=0.3,
        claim_idle_s=60.0,
        grace_s=5.0,
        max_inflight=4,
    )
    keys = Keys(s.namespace)
    ws = [_start(s, tmp_path / f"w{k}.log", k, f"w{k}") for k in range(2)]
    try:
        for k in range(2):
            hb = keys.heartbeat(k, f"w{k}")
            wait_until(lambda hb=hb: r.hget(hb, "engine_up") == b"1", 60, f"worker {k} up")
        total = 160
        burst = Producer(s).submit(doc_burst(20, 8))
        wait_until(lambda: r.hlen(keys.results(burst.id)) >= 20, 60, "20 results")
        ws[1].send_signal(signal.SIGSTOP)
        wait_until(
            lambda: any(f.get(b"from") == b"1" for _, f in r.xrange(keys.moves)), 30, "a move"
        )
        time.sleep(1.0)
        ws[1].send_signal(signal.SIGCONT)
        wait_until(lambda: r.hlen(keys.results(burst.id)) >= total, 90, "every result")
        time.sleep(2.0)  # the zombie's own writes land
        out = account(r, s, burst.id, total, what="zombie")
        assert (out.lost, out.duplicated, out.failed) == (0, 0, 0)
    finally:
        for w in ws:
            w.send_signal(signal.SIGCONT)
            w.send_signal(signal.SIGTERM)
        codes = [w.wait(60) for w in ws]
    assert codes == [0, 0]
