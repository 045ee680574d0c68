"""A stop whose unwinding hangs: the watchdog that ends the process releases what the worker holds
first (cli/start_stop.py `exit_released`), rather than leaving it to its TTL.

Real worker processes (tests/fault_worker.py over the FakeEngine) against the session's private
redis-server, each made to hang a real way: an engine whose build runs in a thread that outlives
the stop (``asyncio.run`` waits for it as the start unwinds), an engine whose shutdown blocks
the process (vLLM's is a blocking call), a request that blocks the event loop.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from helpers import TESTS, script_process, settings_flags, wait_until
from ledger import LEDGER
from prefixq.cli.start_stop import LEAVE_S
from prefixq.cli.worker_signals import EXIT_S
from prefixq.client import Producer
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.worker.lifecycle import stop_bound_s

pytestmark = pytest.mark.slow

#: seconds past a serving stop's bound before its watchdog acts, in these workers (the
#: default leaves the engine's own shutdown far more)
SPARE_S = 1.0
#: seconds a process may take past its watchdog's moment: the releases before the exit (up to
#: LEAVE_S) and a loaded machine's scheduling (8.3 s after SIGTERM seen with EXIT_S 5, the suite
#: on 3 processes on 2 cores; a watchdog that never acts is killed after 10 s more)
SLACK_S = LEAVE_S + 2.5

#: tests/fault_worker.py with one way to hang: ``start``, ``close`` or ``loop`` (its first argument)
HUNG = f"""
import asyncio, sys, time
sys.path.insert(0, {str(TESTS)!r})
import fake_engine, fault_worker
from prefixq.cli import worker_signals

mode, *argv = sys.argv[1:]
if mode == "start":  # the engine's build runs in a thread that outlives a stop
    async def start(self):
        print("building the engine", flush=True)
        await asyncio.to_thread(time.sleep, 120)
    fake_engine.FakeEngine.start = start
elif mode == "close":  # the engine's shutdown blocks the process
    async def close(self):
        print("closing the engine", flush=True)
        time.sleep(120)
    fake_engine.FakeEngine.close = close
elif mode == "loop":  # a request blocks the event loop
    generate = fake_engine.FakeEngine.generate
    async def blocking(self, request):
        if (request.prompt or "").startswith("block"):
            print("blocking the loop", flush=True)
            time.sleep(120)
        return await generate(self, request)
    fake_engine.FakeEngine.generate = blocking
worker_signals.STOP_SPARE_S = {SPARE_S}
sys.exit(fault_worker.worker(argv))
"""

#: the settings the workers here get as flags
FLAGS = (
    "redis_url",
    "namespace",
    "shards",
    "grace_s",
    "heartbeat_s",
    "heartbeat_ttl_s",
    "join_hold_s",
)


Hung = Callable[..., tuple[subprocess.Popen[bytes], Path]]


@pytest.fixture
def hung(tmp_path: Path) -> Iterator[Hung]:
    """``hung(settings, mode, *args)``: a `HUNG` worker process and its log; killed at the end."""
    script = tmp_path / "hung_worker.py"
    script.write_text(HUNG)
    procs: list[subprocess.Popen[bytes]] = []

    def start(s: Settings, mode: str, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
        log = tmp_path / f"{mode}.log"
        procs.append(script_process(script, log, mode, *args, *settings_flags(s, FLAGS)))
        return procs[-1], log

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def _exited(proc: subprocess.Popen[bytes], within: float) -> tuple[int, float]:
    """``proc``'s exit code and the seconds until it exited (killed after ``within`` + 10)."""
    t0 = time.monotonic()
    try:
        rc = proc.wait(within + 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return rc, time.monotonic() - t0


def _stopped(proc: subprocess.Popen[bytes], within: float) -> tuple[int, float]:
    """SIGTERM ``proc``; its exit code and the seconds it took (`_exited`)."""
    proc.send_signal(signal.SIGTERM)
    return _exited(proc, within)


def test_a_start_whose_unwinding_hangs_releases_its_shards_hold_before_the_watchdog_exit(
    make_settings: Callable[..., Settings], r: redis.Redis, hung: Hung
) -> None:
    """Given a worker holding its shard while its engine builds in a thread that outlives a stop
    (the unwinding then waits for it: ``asyncio.run`` joins its executor), when it gets SIGTERM,
    the watchdog ends it with exit 0 after EXIT_S, and the hold is gone by then (before: left
    for ``join_hold_s``, here 600 s, and a ``--join`` meanwhile grew the deployment)."""
    s = make_settings(join_hold_s=600.0)
    proc, log = hung(s, "start", "--shard", "0", "--name", "w")
    wait_until(lambda: "building the engine" in log.read_text(), 30, "the engine's build")
    assert r.hkeys(s.keys.joins) == [b"0"], log.read_text()
    rc, took = _stopped(proc, EXIT_S + 3)
    text = log.read_text()
    print(f"  exit {rc} {took:.2f}s after SIGTERM; joins {r.hgetall(s.keys.joins)}")
    assert rc == 0 and "SIGTERM during start-up: exiting" in text, text[-3000:]
    assert EXIT_S - 0.5 < took < EXIT_S + SLACK_S, (took, text[-3000:])  # the watchdog ended it
    assert r.hgetall(s.keys.joins) == {}, text[-3000:]
    assert "released the hold on shard 0" in text, text[-3000:]
    LEDGER.fault("SIGTERM to a worker whose start hangs as it unwinds, its shard held")


def test_a_serving_stop_whose_engine_shutdown_hangs_exits_0_after_its_bound(
    make_settings: Callable[..., Settings], r: redis.Redis, hung: Hung
) -> None:
    """Given a serving worker whose engine's shutdown blocks the process, when it gets SIGTERM
    it drains, unregisters and exits 0 by its watchdog, `stop_bound_s` + `STOP_SPARE_S` after
    the signal (before: it never exited, and `prefixq workers` waited for it for good)."""
    s = make_settings(grace_s=0.5, heartbeat_s=0.2)
    proc, log = hung(s, "close", "--shard", "0", "--name", "w")
    hb = Keys(s.namespace).heartbeat(0, "w")
    wait_until(lambda: r.hget(hb, "engine_up") == b"1", 30, "the worker serving")
    bound = stop_bound_s(s) + SPARE_S
    rc, took = _stopped(proc, bound + 3)
    text = log.read_text()
    print(f"  exit {rc} {took:.2f}s after SIGTERM (bound {bound:.1f}s)")
    assert rc == 0 and "closing the engine" in text, text[-3000:]
    assert took < bound + SLACK_S, (took, text[-3000:])
    assert "did not end" in text, text[-3000:]
    assert not r.exists(hb)
    LEDGER.fault("SIGTERM to a serving worker whose engine's shutdown hangs")


def test_an_engine_death_whose_shutdown_hangs_exits_3_after_its_bound(
    make_settings: Callable[..., Settings], r: redis.Redis, hung: Hung
) -> None:
    """Given a serving worker whose engine's shutdown blocks the process, when its engine dies
    (no signal: the worker stops itself), it exits with code 3 (engine dead: a supervisor
    restarts it) by its watchdog, `stop_bound_s` + `STOP_SPARE_S` after the death, its heartbeat
    gone (before: only a signal armed the watchdog, and the process never exited)."""
    s = make_settings(grace_s=0.5, heartbeat_s=0.2)
    proc, log = hung(s, "close", "--shard", "0", "--name", "w")
    hb = Keys(s.namespace).heartbeat(0, "w")
    wait_until(lambda: r.hget(hb, "engine_up") == b"1", 30, "the worker serving")
    bound = stop_bound_s(s) + SPARE_S
    Producer(s).submit([{"id": "q", "prompt": "die: now", "max_tokens": 2}])
    wait_until(lambda: "engine died" in log.read_text(), 30, "the engine's death")
    rc, took = _exited(proc, bound)
    text = log.read_text()
    print(f"  exit {rc} {took:.2f}s after the engine's death (bound {bound:.1f}s)")
    assert rc == 3 and "closing the engine" in text, (rc, text[-3000:])
    assert took < bound + SLACK_S and "did not end" in text, (took, text[-3000:])
    assert not r.exists(hb)
    LEDGER.fault("an engine death in a worker whose engine's shutdown hangs")


def test_a_serving_stop_on_a_blocked_loop_drops_its_own_heartbeat_before_the_watchdog_exit(
    make_settings: Callable[..., Settings], r: redis.Redis, hung: Hung
) -> None:
    """Given a serving worker whose event loop a request blocks (no drain, no unregister, no
    beat), when it gets SIGTERM, its watchdog drops its heartbeat and leaves the shard's
    workers, then exits 0 (before: it never exited, and its heartbeat stayed until its TTL kept
    its in-flight entries from live peers)."""
    s = make_settings(grace_s=0.5, heartbeat_s=0.2, heartbeat_ttl_s=120.0)
    proc, log = hung(s, "loop", "--shard", "0", "--name", "w")
    keys = Keys(s.namespace)
    hb = keys.heartbeat(0, "w")
    wait_until(lambda: r.hget(hb, "engine_up") == b"1", 30, "the worker serving")
    Producer(s).submit([{"id": "q", "prompt": "block the loop", "max_tokens": 2}])
    wait_until(lambda: "blocking the loop" in log.read_text(), 30, "the loop blocked")
    assert r.hget(hb, "pid") == str(proc.pid).encode()
    bound = stop_bound_s(s) + SPARE_S
    rc, took = _stopped(proc, bound + 3)
    text = log.read_text()
    print(f"  exit {rc} {took:.2f}s after SIGTERM (bound {bound:.1f}s)")
    assert rc == 0 and took < bound + SLACK_S, (rc, took, text[-3000:])
    assert not r.exists(hb), text[-3000:]
    assert r.zscore(keys.workers(0), "w") is None, text[-3000:]
    LEDGER.fault("SIGTERM to a serving worker whose event loop is blocked")


def test_the_watchdog_drops_no_heartbeat_but_its_own_process_s(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Given the heartbeat of worker w written by another process (a replacement under the same
    name), the watchdog's release leaves it, and the shard's workers with it; its own (this
    pid, host and start) it drops."""
    from prefixq.worker.heartbeat import drop_own

    s = make_settings()
    keys = Keys(s.namespace)
    hb, workers = keys.heartbeat(0, "w"), keys.workers(0)
    host, started = socket.gethostname(), 1234.5
    r.hset(hb, mapping={"pid": os.getpid() + 1, "host": host, "started": repr(started)})
    r.zadd(workers, {"w": 1.0})
    assert not drop_own(s, 0, "w", started)
    assert r.exists(hb) and r.zscore(workers, "w") == 1.0
    r.hset(hb, mapping={"pid": os.getpid(), "started": repr(started + 1)})  # an earlier run's
    assert not drop_own(s, 0, "w", started)
    assert r.exists(hb)
    r.hset(hb, "started", repr(started))
    assert drop_own(s, 0, "w", started)
    assert not r.exists(hb) and r.zscore(workers, "w") is None


def test_a_release_that_hangs_delays_the_watchdogs_exit_by_leave_s_at_most(tmp_path: Path) -> None:
    """Given a release of what the worker holds that never returns (a Redis that does not
    answer), the watchdog's exit still comes `LEAVE_S` after it began, with exit 0."""
    script = tmp_path / "leave.py"
    script.write_text(
        textwrap.dedent("""
        import time
        from prefixq.cli.start_stop import exit_released, on_leave
        on_leave(lambda: time.sleep(60))
        print("leaving", time.monotonic(), flush=True)
        exit_released(lambda: print("the second release ran", flush=True))
        """)
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30)
    took = time.monotonic() - float(done.stdout.split()[1])
    assert done.returncode == 0, done.stderr
    assert LEAVE_S - 0.1 < took < LEAVE_S + 1.0, took
    assert "the second release ran" not in done.stdout  # the first one held the thread
