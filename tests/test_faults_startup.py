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
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from conftest import WorkerProc
from helpers import fault_worker, wait_until
from ledger import LEDGER
from prefixq.cli.redis_server import free_port
from prefixq.cli.worker_signals import EXIT_S, start_worker
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


def test_signals_that_keep_coming_while_a_stopped_start_unwinds_still_end_it_with_0(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    """Given a held start stopped by SIGTERM, then SIGTERM and SIGINT sent again every
    millisecond until it is gone (a supervisor or an operator repeating the stop; the soak's
    fault sends two in a row), it still exits 0: the interpreter's exit resets a Python handler
    to the default action, so a signal that landed then ended it with -15."""
    s = make_settings()
    log = tmp_path / "held.log"
    proc = fault_worker(s, log, "--name", "held2", "--hold-start", "120")
    try:
        wait_until(lambda: "starting (pid" in log.read_text(), 30, "its start under way")
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + EXIT_S + 10
        sent = 1
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                proc.send_signal(signal.SIGTERM if sent % 2 else signal.SIGINT)
            except ProcessLookupError:
                break
            sent += 1
            time.sleep(0.001)
        rc = proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    print(f"  exit {rc} after {sent} signals")
    assert sent > 1 and rc == 0, (rc, text)
    assert "Traceback" not in text, text
    LEDGER.fault("repeated SIGTERM/SIGINT while a stopped start unwinds")


#: seconds after the start at which a test stops a worker: while its interpreter starts (~30 ms
#: idle, several times that on a loaded machine), then through the imports of its command (~0.6 s
#: before its handlers, once) and of vLLM, torch and numpy (C extensions: a stop raised inside
#: their initialisation aborted the process, -6, or left numpy half-built, exit 1)
AT_ONCE = (0.0, 0.01, 0.02, 0.03, 0.05, 0.1, 0.15, 0.2)
THROUGH_IMPORTS = (0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.8, 1.0, 1.3)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_at_any_moment_of_the_start_exits_0(sig: int) -> None:
    """Given ``python -m prefixq worker`` started by `start_worker` (as `prefixq workers` and the
    demo start theirs: the stop signals blocked until its first handler), when SIGTERM or SIGINT
    comes at any moment of its start, 0 to 0.5 s, it exits 0; started plainly, it does so once
    its interpreter runs (a signal before that takes the default action: not tested here, where
    load may stretch it); never killed by the signal (-15, -2: the handlers came after ~0.6 s
    of imports) or with a traceback (a KeyboardInterrupt inside an import)."""
    cmd = [sys.executable, "-m", "prefixq", "worker", "--shard", "0"]
    cmd += ["--redis-url", f"redis://127.0.0.1:{free_port()}/0"]  # nothing there: it writes none

    errs: dict[tuple[float, bool], str] = {}

    def stop_after(delay: float, *, shielded: bool) -> int:
        start = start_worker if shielded else subprocess.Popen
        proc = start(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            time.sleep(delay)
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=EXIT_S + 10)
            errs[(delay, shielded)] = err.decode(errors="replace")[-1500:]
            return proc.returncode
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    got = {(d, True): stop_after(d, shielded=True) for d in AT_ONCE + THROUGH_IMPORTS}
    got |= {(d, False): stop_after(d, shielded=False) for d in THROUGH_IMPORTS}
    print(f"  exit codes after {signal.Signals(sig).name}: {sorted(set(got.values()))}")
    bad = {k: (rc, errs.get(k)) for k, rc in got.items() if rc != 0}
    assert not bad, bad
    assert not any("Traceback" in e for e in errs.values()), errs
    LEDGER.fault(f"{signal.Signals(sig).name} 0-0.5 s after a worker's start", len(got))


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


def _run_stopped(tmp_path: Path, body: str) -> tuple[int, str, float]:
    """Run ``body`` after `WorkerSignals().install()` (what `prefixq worker` does first) in a
    process of its own; its exit code, its output and how long it took."""
    script = tmp_path / "stopped.py"
    script.write_text(
        "import asyncio, gc, logging, os, signal, sys, time\n"
        "from prefixq.cli.worker_signals import WorkerSignals\n"
        "logging.basicConfig(level='INFO', format='%(levelname)s %(name)s: %(message)s')\n"
        "WorkerSignals().install()\n" + textwrap.dedent(body)
    )
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=EXIT_S + 30
    )
    return done.returncode, done.stdout + done.stderr, time.monotonic() - t0


def test_a_stop_that_lands_in_a_finalizer_still_ends_the_start_at_once(tmp_path: Path) -> None:
    """Given a stop whose signal handler runs inside a finalizer (``__del__``, a weakref
    callback: the garbage collector runs them wherever the start is), where Python swallows the
    ``SystemExit`` it raises ("Exception ignored in"), the process still exits 0 at once and the
    start goes no further. Before: the start went on (a FakeEngine worker stopped 0.5-0.8 s
    after its start logged "exiting" and then "serving", reading its shard) until the watchdog
    ended it after EXIT_S."""
    rc, out, took = _run_stopped(
        tmp_path,
        """
        class Finalized:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGTERM)  # the handler runs in here
                time.sleep(0.05)
        Finalized()
        print("the start went on", flush=True)
        time.sleep(30)
        """,
    )
    assert rc == 0 and "SIGTERM during start-up: exiting" in out, out
    assert "the start went on" not in out and took < EXIT_S, (took, out)
    assert "Traceback" not in out, out


def test_a_stop_that_lands_in_a_task_of_the_start_unwinds_without_errors(tmp_path: Path) -> None:
    """Given a stop whose handler runs inside an asyncio task of the start that is not the one
    ``asyncio.run`` awaits (the worker's own start tasks), the process exits 0 with no ERROR
    line and no traceback (before: asyncio logged "Task exception was never retrieved" with the
    SystemExit's traceback, and "Task was destroyed but it is pending!")."""
    rc, out, _ = _run_stopped(
        tmp_path,
        """
        async def side():
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.sleep(0)
        async def main():
            tasks = [asyncio.create_task(side()), asyncio.create_task(asyncio.sleep(30))]
            await asyncio.sleep(30)
        asyncio.run(main())
        """,
    )
    assert rc == 0 and "SIGINT during start-up: exiting" in out, out
    assert "ERROR" not in out and "Traceback" not in out, out


def test_a_stop_inside_an_import_that_logging_needs_exits_0_without_a_traceback(
    tmp_path: Path,
) -> None:
    """Given `prefixq worker`'s first handler (prefixq.cli, installed before logging is loaded)
    and a stop whose handler runs while ``re`` is half-built in `sys.modules` (its module body
    about to run: an import under way), the process exits 0 with no traceback. Before: the
    handler imported ``logging`` first, whose ``import re`` found the half-built module, and the
    process exited 1 ("partially initialized module 're' has no attribute 'compile'": 1 of the
    CI's 18 stops 0.03 s into a start)."""
    script = tmp_path / "inside_import.py"
    script.write_text(
        textwrap.dedent(
            """
            import importlib.abc, importlib.util, os, signal, sys
            from prefixq.cli import _exit_during_start
            signal.signal(signal.SIGTERM, _exit_during_start)
            for name in ("re", "logging"):
                sys.modules.pop(name, None)
            class StopInside(importlib.abc.Loader):
                def __init__(self, real):
                    self.real = real
                def create_module(self, spec):
                    return self.real.create_module(spec)
                def exec_module(self, module):
                    os.kill(os.getpid(), signal.SIGTERM)  # handled here, `re` half-built
                    self.real.exec_module(module)
            class Finder(importlib.abc.MetaPathFinder):
                def find_spec(self, name, path, target=None):
                    if name != "re":
                        return None
                    sys.meta_path.remove(self)
                    spec = importlib.util.find_spec("re")
                    spec.loader = StopInside(spec.loader)
                    return spec
            sys.meta_path.insert(0, Finder())
            import re
            print("the stop was not handled")
            sys.exit(3)
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=EXIT_S + 30
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "Traceback" not in out, (done.returncode, out)
