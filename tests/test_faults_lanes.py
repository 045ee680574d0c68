"""Faults with several bursts, priorities and lanes on one shard (docs/delivery.md): a
worker killed -9 while it holds entries of several bursts and priorities loses and doubles
nothing, and what another worker reclaims runs even while a higher priority has a backlog."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from helpers import fault_worker, queue_empty, queue_keys, wait_burst, wait_until
from ledger import LEDGER, account
from prefixq.client import Producer
from prefixq.core.keys import GROUP, Keys
from prefixq.core.settings import Settings
from prefixq.store import burst_end

pytestmark = pytest.mark.slow


def sleepy(n: int, secs: float, tag: str) -> list[dict[str, Any]]:
    return [
        {"id": f"{tag}{i}", "prompt": f"sleep:{secs} {tag} {i}", "max_tokens": 4} for i in range(n)
    ]


def held_by(r: redis.Redis, s: Settings, consumer: str) -> dict[str, int]:
    """Entries pending on ``consumer``, per stream of the shard."""
    out = {}
    for key in queue_keys(r, s):
        try:
            n = len(r.xpending_range(key, GROUP, "-", "+", 1000, consumername=consumer))
        except redis.ResponseError:
            continue
        if n:
            out[key] = n
    return out


def test_kill_9_of_a_worker_holding_several_bursts_and_priorities_loses_nothing(
    make_settings: Callable[..., Settings], r: redis.Redis, tmp_path: Path
) -> None:
    """Given a worker serving a low-priority and a high-priority burst at once (a normal one
    waiting behind them), when it is killed -9, another worker reclaims what it held, and every
    request of the three bursts gets exactly one result."""
    s = make_settings(max_inflight=8, claim_idle_s=2.0, heartbeat_s=0.5)
    low = Producer(s).submit(sleepy(4, 3.0, "l"), priority="low", tenant="t1")
    w1 = fault_worker(s, tmp_path / "w1.log", "--name", "w1")
    try:
        wait_until(lambda: sum(held_by(r, s, "w1").values()) >= 4, 30, "the low burst in flight")
        high = Producer(s).submit(sleepy(40, 0.5, "h"), priority="high", tenant="t2")
        normal = Producer(s).submit(sleepy(40, 0.1, "n"), tenant="t1")
        wait_until(lambda: len(held_by(r, s, "w1")) >= 2, 30, "high entries in flight too")
        held = held_by(r, s, "w1")
        assert any("requests:low" in k for k in held), held
        assert any("requests:high" in k or high in k for k in held), held
        w1.send_signal(signal.SIGKILL)
        w1.wait(10)
        LEDGER.fault(f"kill -9 of a worker holding {sum(held.values())} entries of 2 priorities")
    finally:
        if w1.poll() is None:
            w1.kill()
    assert r.hlen(Keys(s.namespace).results(low)) == 0, "the low requests were still running"
    w2 = fault_worker(s, tmp_path / "w2.log", "--name", "w2")
    try:
        for burst, n in ((low, 4), (high, 40), (normal, 40)):
            wait_burst(r, s, burst, 120)
            out = account(r, s, burst, n, what="after kill -9 with several bursts")
            assert (out.lost, out.duplicated, out.failed) == (0, 0, 0)
    finally:
        w2.send_signal(signal.SIGTERM)
        assert w2.wait(60) == 0
    wait_until(lambda: queue_empty(r, s) == (0, 0), 10, "the queues empty")


def test_reclaimed_low_priority_work_runs_while_a_higher_priority_has_a_backlog(
    make_settings: Callable[..., Settings], r: redis.Redis, tmp_path: Path
) -> None:
    """Given low-priority requests stuck on a dead worker and a high-priority burst that keeps
    the live worker busy for far longer than ``claim_idle_s``, the live worker reclaims the low
    requests and runs them before the high burst is done: reclaiming never starves a priority."""
    s = make_settings(max_inflight=8, claim_idle_s=1.0, heartbeat_s=0.5)
    low = Producer(s).submit(sleepy(8, 1.0, "l"), priority="low")
    w1 = fault_worker(s, tmp_path / "w1.log", "--name", "w1")
    try:
        wait_until(lambda: sum(held_by(r, s, "w1").values()) >= 8, 30, "the low burst in flight")
        w1.send_signal(signal.SIGKILL)
        w1.wait(10)
        LEDGER.fault("kill -9 of a worker holding 8 low-priority requests")
    finally:
        if w1.poll() is None:
            w1.kill()
    high = Producer(s).submit(sleepy(800, 0.1, "h"), priority="high")
    w2 = fault_worker(s, tmp_path / "w2.log", "--name", "w2")
    try:
        got = wait_burst(r, s, low, 60)
        high_done = r.hlen(Keys(s.namespace).results(high))
        print(f"  low burst done by reclaim while the high one had {800 - high_done} left")
        assert high_done < 800, "the high burst was still running"
        assert {x.worker for x in got} == {"w2"}
        out = account(r, s, low, 8, what="reclaimed under a high-priority backlog")
        assert (out.lost, out.duplicated, out.failed) == (0, 0, 0)
        burst_end.cancel(high, s)
        wait_burst(r, s, high, 60)
        out = account(r, s, high, 800, what="the high burst, cancelled")
        assert out.lost == 0 and out.duplicated == 0
    finally:
        w2.send_signal(signal.SIGTERM)
        assert w2.wait(60) == 0
