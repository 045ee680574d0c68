"""A stop during a worker's start-up: SIGTERM or SIGINT before the worker serves exits 0 at once,
wherever its start is (prefixq.cli.worker_signals; docs/delivery.md, "SIGTERM and SIGINT").

The fast tests hold the start of a tests/fault_worker.py process (the real `Worker` over the
FakeEngine, with the handlers `prefixq worker` installs) with ``--hold-start``, which blocks the
thread as building a vLLM engine does; the test marked ``engine`` signals a real `prefixq worker`
while it builds its vLLM CPU engine (its own module, so that it never overlaps the two engines
of test_faults_worker.py). Faults go to the ledger (tests/ledger.py).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from conftest import WorkerProc
from helpers import fault_worker, wait_until
from ledger import LEDGER
from prefixq.cli.worker_signals import EXIT_S
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_during_a_start_that_blocks_its_thread_exits_0_at_once(
    make_settings: Callable[..., Settings], r: redis.Redis, tmp_path: Path, sig: int
) -> None:
    """Given a worker process whose start blocks its thread (``--hold-start``: what building a
    vLLM engine does for a minute or more), when it gets SIGTERM or SIGINT it exits 0 within a
    second or two, having written nothing (the handlers came after the engine: a signal before
    them killed the process, one after them waited for the whole start)."""
    s = make_settings()
    log = tmp_path / "held.log"
    proc = fault_worker(s, log, "--name", "held", "--hold-start", "120")
    try:
        wait_until(lambda: "starting (pid" in log.read_text(), 30, "its start under way")
        time.sleep(0.3)  # inside the held start
        t0 = time.monotonic()
        proc.send_signal(sig)
        rc = proc.wait(EXIT_S + 10)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    print(f"  exit {rc} {took:.2f}s after {signal.Signals(sig).name} mid-start")
    assert rc == 0 and f"{signal.Signals(sig).name} during start-up: exiting" in text, text
    assert took < EXIT_S and "Traceback" not in text, text  # the watchdog did not end it
    assert not r.exists(Keys(s.namespace).heartbeat(0, "held"))
    LEDGER.fault(f"{signal.Signals(sig).name} to a worker whose start blocks its thread")


def _title(p: Any) -> str:
    """A process's name and first argument; "" once it is gone (a child that just forked has
    no command line yet, one that just ended none any more)."""
    import psutil

    try:
        return p.name() + " " + " ".join(p.cmdline()[:1])
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


@pytest.mark.engine
def test_sigterm_while_prefixq_worker_builds_its_vllm_engine_exits_0_at_once(
    make_settings: Callable[..., Settings], r: redis.Redis, start_worker: Callable[..., WorkerProc]
) -> None:
    """Given a `prefixq worker` building its vLLM CPU engine (its engine core process is up, the
    engine not yet), when it gets SIGTERM it exits 0 within seconds, its engine's processes
    end with it and it wrote no heartbeat (it waited for the whole start, a minute or more, and
    a SIGTERM before its handlers killed it with -15)."""
    import psutil

    s = make_settings()
    w = start_worker(s, name="stopped-mid-start")

    def engine_core() -> list[psutil.Process]:
        if w.proc.poll() is not None:
            raise AssertionError(f"worker exited {w.proc.returncode}:\n{w.tail()}")
        kids = psutil.Process(w.proc.pid).children(recursive=True)
        return [p for p in kids if "EngineCore" in _title(p)]

    cores = wait_until(engine_core, 600, "vLLM's engine core process", 0.1)
    kids = psutil.Process(w.proc.pid).children(recursive=True)
    hb = Keys(s.namespace).heartbeat(0, w.name)
    assert r.hget(hb, "engine_up") is None, "the engine was up already"
    t0 = time.monotonic()
    w.signal(signal.SIGTERM)
    rc = w.proc.wait(60)
    took = time.monotonic() - t0
    _, alive = psutil.wait_procs(kids, timeout=15)
    print(f"  exit {rc} {took:.1f}s after SIGTERM mid-start; {len(cores)} engine core(s)")
    # the whole log: the engine core's own start-up lines (a config line of thousands of
    # characters) can follow the worker's line before the reaper ends it
    logged = w.log.read_text(errors="replace")
    assert rc == 0 and "SIGTERM during start-up: exiting" in logged, w.tail()
    assert took < EXIT_S + 3, w.tail()
    assert not alive, f"engine processes left: {alive}"
    assert not r.exists(hb)
    LEDGER.fault("SIGTERM to `prefixq worker` while it builds its vLLM engine")
