"""`prefixq workers`, the supervisor (cli/worker_process.py `supervise`), as a process over
fake-engine worker processes (tests/fault_worker.py ``workers``): a stop that comes while a
worker starts or waits for its restart, the signals a terminal or an operator sends (SIGHUP,
SIGQUIT, the supervisor killed -9), and the exit status of a worker killed by a signal."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil

from helpers import TESTS, fault_worker, script_process, settings_flags, wait_until
from prefixq.core.settings import Settings


def _pids(log: Path) -> list[int]:
    return [
        int(x) for x in re.findall(r"started worker shard=\d+ gpu=\S+ pid=(\d+)", log.read_text())
    ]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _stop(sup: subprocess.Popen[bytes]) -> None:
    if sup.poll() is None:
        sup.kill()
        sup.wait(10)


def test_a_stop_while_a_worker_waits_for_its_restart_starts_nothing_more(
    settings: Settings, tmp_path: Path
) -> None:
    """Given a worker whose start fails every time (the supervisor waits longer before each
    restart), SIGTERM to the supervisor while it waits ends it within a second or two, exit 1 (the
    worker's), and no worker is started after the signal: the restart used to run anyway, and the
    new worker, which the signal never reached, kept the supervisor up for good."""
    log = tmp_path / "sup.log"
    sup = fault_worker(settings, log, "--cpu", "1", "--fail-start", mode="workers")
    try:
        wait_until(lambda: "restarting in" in log.read_text(), 30, "the first restart's wait")
        started = len(_pids(log))
        sup.send_signal(signal.SIGTERM)
        rc = sup.wait(10)
        time.sleep(1.5)  # past the restart that was due
    finally:
        _stop(sup)
    assert rc == 1, log.read_text()[-3000:]
    assert len(_pids(log)) == started and all(_gone(p) for p in _pids(log))


#: the supervisor of tests/fault_worker.py ``workers``, with SIGTERM sent to itself from inside
#: the first worker's Popen (in `start_worker`, where the supervisor's stops are blocked: it is
#: handled as they are unblocked)
STOP_IN_SPAWN = f"""
import os, signal, subprocess, sys
sys.path.insert(0, {str(TESTS)!r})
import fault_worker

real = subprocess.Popen
spawned = []

def popen(*a, **kw):
    p = real(*a, **kw)
    spawned.append(p)
    if len(spawned) == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    return p

subprocess.Popen = popen
sys.exit(fault_worker.workers(sys.argv[1:]))
"""


def test_a_stop_while_a_worker_is_spawned_reaches_it(settings: Settings, tmp_path: Path) -> None:
    """SIGTERM that reaches the supervisor while it starts a worker (inside `start_worker`) stops
    that worker too: the supervisor exits 0 and no worker is left. It was handled before the new
    worker was recorded, so that worker never got it, and the supervisor waited for it for good
    while it served."""
    script = tmp_path / "stop_in_spawn.py"
    script.write_text(STOP_IN_SPAWN)
    log = tmp_path / "sup.log"
    sup = script_process(script, log, "--cpu", "1", *settings_flags(settings))
    try:
        wait_until(lambda: _pids(log), 30, "the worker's start")
        rc = sup.wait(20)
    finally:
        _stop(sup)
    assert rc == 0, log.read_text()[-3000:]
    (pid,) = _pids(log)
    wait_until(lambda: _gone(pid), 10, "the worker's exit")
    assert "warm in" not in log.read_text(), log.read_text()[-3000:]  # it never served


def test_sighup_and_sigquit_stop_the_workers_gracefully(settings: Settings, tmp_path: Path) -> None:
    """SIGHUP (a closed terminal) or SIGQUIT to the supervisor stops its worker as SIGTERM does
    (exit 0, no worker left running): by default they killed the supervisor alone and left its
    workers serving with no parent, holding their names."""
    for sig in (signal.SIGHUP, signal.SIGQUIT):
        log = tmp_path / f"sup-{sig.name}.log"
        sup = fault_worker(settings, log, "--cpu", "1", mode="workers")
        try:
            wait_until(lambda log=log: "warm in" in log.read_text(), 30, "the worker's start")
            (pid,) = _pids(log)
            sup.send_signal(sig)
            rc = sup.wait(30)
        finally:
            _stop(sup)
        assert rc == 0, (sig.name, log.read_text()[-3000:])
        wait_until(lambda pid=pid: _gone(pid), 10, f"the worker's exit after {sig.name}")


def test_a_supervisor_killed_9_takes_its_workers_with_it_and_a_killed_worker_is_128_plus_n(
    settings: Settings, tmp_path: Path
) -> None:
    """The supervisor killed -9: its worker gets SIGTERM and exits (it served on with no parent).
    A worker killed -9 while the supervisor stops makes the supervisor exit 137 (128 + 9), not 0."""
    log = tmp_path / "sup.log"
    sup = fault_worker(settings, log, "--cpu", "1", mode="workers")
    try:
        wait_until(lambda: "warm in" in log.read_text(), 30, "the worker's start")
        (pid,) = _pids(log)
        os.kill(sup.pid, signal.SIGKILL)
        sup.wait(10)
        wait_until(lambda: _gone(pid), 15, "the orphaned worker's exit")
    finally:
        _stop(sup)
    log = tmp_path / "sup2.log"
    sup = fault_worker(settings.replace(grace_s=30.0), log, "--cpu", "1", mode="workers")
    try:
        wait_until(lambda: "warm in" in log.read_text(), 30, "the worker's start")
        (pid,) = _pids(log)
        sup.send_signal(signal.SIGTERM)
        os.kill(pid, signal.SIGKILL)
        rc = sup.wait(30)
    finally:
        _stop(sup)
    assert rc == 137, log.read_text()[-3000:]
    assert "was killed by signal 9" in log.read_text()
