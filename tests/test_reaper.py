"""Engine processes die with their worker, even after kill -9 (engine/reaper.py)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from ledger import LEDGER
from prefixq.core.settings import Settings
from prefixq.engine.reaper import descendants

SRC = Path(__file__).resolve().parents[1] / "src"


def gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        if not alive:
            return True
        time.sleep(0.1)
    return False


def test_descendants_of_a_process_tree() -> None:
    """`descendants` finds children and grandchildren, not the process itself."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import subprocess,time; subprocess.Popen(['sleep','30']); "
         "time.sleep(30)"]
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while len(descendants(os.getpid())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        found = descendants(os.getpid())
        assert child.pid in found and len(found) >= 2 and os.getpid() not in found
    finally:
        for p in psutil.Process(child.pid).children(recursive=True):
            p.kill()
        child.kill()
        child.wait()


#: a process that starts the reaper, then a child (as a worker starts its engine core), prints
#: both pids and sleeps
OWNER = """
import subprocess, time
from prefixq.engine.reaper import start_reaper
reaper = start_reaper()
child = subprocess.Popen(["sleep", "300"])
print(reaper.pid, child.pid, flush=True)
time.sleep(300)
"""


def kill_owner_after(tmp_path: Path, delay: float, *path: Path) -> tuple[int, int]:
    """Start `OWNER` (``path`` ahead of the package on its PYTHONPATH), kill it -9 ``delay`` s
    after its child started; (the reaper's pid, the child's pid)."""
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    pythonpath = os.pathsep.join(str(p) for p in (*path, SRC))
    owner = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": pythonpath},
    )
    assert owner.stdout is not None
    with owner.stdout:
        reaper_pid, child_pid = map(int, owner.stdout.readline().split())
    time.sleep(delay)
    owner.send_signal(signal.SIGKILL)
    owner.wait(10)
    return reaper_pid, child_pid


def test_kill_9_of_the_owner_kills_its_children(tmp_path: Path) -> None:
    """Given a process that started the reaper and then a child (as a worker starts its engine
    core), when the process is killed with SIGKILL, then the child dies within a few seconds
    instead of living on re-parented."""
    reaper_pid, child_pid = kill_owner_after(tmp_path, 2.0)  # it looks once a second
    assert psutil.pid_exists(child_pid), "the child died with its parent anyway: nothing tested"
    LEDGER.fault("kill -9 of a process whose child must not outlive it")
    assert gone([child_pid, reaper_pid], 10), "the child outlived its killed parent"


def test_a_child_started_while_the_watcher_starts_slowly_is_reaped(tmp_path: Path) -> None:
    """Given a watcher whose start takes 3 s (a loaded machine: it failed the test above in a
    suite run), when its owner starts a child the moment `start_reaper` returns and is killed
    -9 1.5 s later, then the child dies all the same: `start_reaper` returns once the watcher
    has taken its first look (before, the owner went on at once and its child was never seen)."""
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(
        "import sys, time\nif sys.argv[0].endswith('reaper.py'):\n    time.sleep(3)\n"
    )
    # the watcher's next look is a second after its first
    reaper_pid, child_pid = kill_owner_after(tmp_path, 1.5, slow)
    LEDGER.fault("kill -9 of a process whose watcher started slowly")
    assert gone([child_pid, reaper_pid], 10), "the child outlived its killed parent"


@pytest.mark.engine
def test_kill_9_of_a_worker_leaves_no_engine_and_a_restart_serves(
    make_settings: Callable[..., Settings], start_worker: Callable[..., object]
) -> None:
    """Given a real `prefixq worker` with its vLLM engine core up, when the worker process alone
    is killed with SIGKILL, then none of its engine processes survives more than a few seconds,
    and a worker restarted with the same name starts."""
    s = make_settings(namespace=f"reap{secrets.token_hex(3)}")
    w = start_worker(s, name="reaped").wait_up()  # type: ignore[attr-defined]
    tree = [p.pid for p in psutil.Process(w.proc.pid).children(recursive=True)]
    assert tree, "the worker has no child processes: no engine core to orphan"
    w.proc.send_signal(signal.SIGKILL)
    w.proc.wait(30)
    LEDGER.fault(f"kill -9 of a worker process alone ({len(tree)} engine processes left)")
    assert gone(tree, 15), "engine processes outlived their worker"
    start_worker(s, name="reaped").wait_up()  # type: ignore[attr-defined]
