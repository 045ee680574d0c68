"""Engine processes die with the process that started them, even after kill -9 (`start_reaper`,
`stop_reaper`).

vLLM's engine core runs in a process of its own, which a SIGKILL of its worker leaves alive with
its memory and its GPU. `start_reaper` starts a watcher process that notes the owner's
descendants and, once the owner's end of a pipe closes (however the owner ended), kills those
still alive. Linux only (/proc); elsewhere it does nothing. The watcher runs this file itself
(``python .../reaper.py OWNER_PID``), so this module must import nothing but the standard
library. docs/engine.md, "Engine processes after a kill -9", has the design.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
from typing import IO

log = logging.getLogger(__name__)

#: seconds between two looks at the owner's process tree, at first and at most
EVERY_S = 1.0
MAX_EVERY_S = 10.0
#: seconds `start_reaper` waits for the watcher's first look at most
READY_S = 30.0


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2 :].split()  # the command name may hold spaces or parens
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """Every live descendant of ``root``: pid -> start time."""
    children: dict[int, list[int]] = {}
    start: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        st = _stat(int(name))
        if st is not None:
            children.setdefault(st[0], []).append(int(name))
            start[int(name)] = st[1]
    out: dict[int, int] = {}
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        if pid in out or pid not in start:
            continue
        out[pid] = start[pid]
        todo.extend(children.get(pid, ()))
    return out


def watch(
    owner: int, lifeline: IO[bytes], every_s: float = EVERY_S, looked: IO[bytes] | None = None
) -> list[int]:
    """Note ``owner``'s descendants until ``lifeline`` reaches end of file; kill those still
    alive; returns the pids killed. Looks every ``every_s`` at first (the engine starts its
    processes then), then less and less often, up to every `MAX_EVERY_S`. After the first look
    it writes a line to ``looked`` (`start_reaper` waits for that line)."""
    me = os.getpid()
    noted: dict[int, int] = {}
    wait = every_s
    while True:
        noted.update({p: t for p, t in descendants(owner).items() if p != me})
        if looked is not None:
            try:
                looked.write(b"watching\n")
                looked.flush()
            except OSError:  # the owner stopped waiting (or is gone): the lifeline says which
                pass
            looked = None
        ready, _, _ = select.select([lifeline], [], [], wait)
        if ready and not os.read(lifeline.fileno(), 4096):
            break
        wait = min(wait * 1.2, MAX_EVERY_S)
    killed = []
    for pid, started in noted.items():
        st = _stat(pid)
        if st is not None and st[1] == started:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except OSError:
                pass
    return killed


def start_reaper(ready_s: float = READY_S) -> subprocess.Popen[bytes] | None:
    """Start the watcher for this process and wait (up to ``ready_s``) until it has taken its
    first look, so a child started after this returns is seen by its next look (a watcher still
    starting on a loaded machine missed an engine started and killed within its start-up); keep
    the returned handle for the process's life (its stdin is the lifeline; `stop_reaper` closes
    it). None where there is no /proc."""
    if not os.path.isdir("/proc/self"):
        log.debug("no /proc: engine processes are not reaped after a kill -9")
        return None
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None
    with proc.stdout:
        ready, _, _ = select.select([proc.stdout], [], [], ready_s)
        if not ready or not proc.stdout.readline():
            log.warning(
                "the engine processes' watcher (pid %d) did not start within %.0f s: an engine "
                "started before its first look is not reaped after a kill -9",
                proc.pid,
                ready_s,
            )
    return proc


def stop_reaper(proc: subprocess.Popen[bytes] | None, timeout: float = 10.0) -> None:
    """Close the lifeline (the watcher kills what is left of the engine) and wait for it."""
    if proc is None:
        return
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> int:
    owner = int(sys.argv[1])
    killed = watch(owner, sys.stdin.buffer, looked=sys.stdout.buffer)
    if killed:
        print(
            f"prefixq reaper: killed {len(killed)} process(es) left by pid {owner}", file=sys.stderr
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
