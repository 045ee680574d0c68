"""SIGTERM and SIGINT for a worker process, handled from its first line.

Until the worker serves (its engine up and warm: `Worker.engine_up`) it holds no work: no entry
is read, no heartbeat written; only the hold on its shard (cli/fleet_commands.py), which its exit
releases. A stop then ends the process at once with exit code 0: the signal raises
``SystemExit(0)`` wherever the main thread is — preparing the model, importing vLLM, building
the engine (which blocks the event loop for a minute or more), waiting for Redis — so the start
unwinds (inside an import it exits at once instead: `start_stop.leave_now`, as raising there can
abort the process; the shard's hold is released first: `start_stop.on_leave`); the engine's
processes end with it (their exit handlers, and the reaper: prefixq.engine.reaper), and if
unwinding hangs, the process exits after `EXIT_S` anyway, the shard's hold released first
(`start_stop.exit_released`: it would otherwise stay until it lapses, ``join_hold_s``). Once the
worker serves, a signal calls `Worker.stop()` on the worker's event loop: it stops reading and
drains within ``grace_s`` (docs/delivery.md, "SIGTERM and SIGINT"); if the stop has not ended
`STOP_SPARE_S` after its bound (`stop_bound_s`: an engine whose shutdown hangs, an event loop
something blocks), the process exits 0 anyway (3 if its engine died: that stop, the worker's own,
is watched too), its heartbeat dropped first if it is still there and this process's
(`heartbeat.drop_own`: a live peer then takes its entries at once).

The first handler comes before this module's (`prefixq.cli`, before any slow import);
`start_worker` starts a worker with both signals blocked until then, so that not even its
interpreter's start is a moment a stop kills it.
"""

from __future__ import annotations

import functools
import logging
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

from prefixq.cli.start_stop import exit_released, inside_import, leave_now, unwinding

if TYPE_CHECKING:  # imported at the process's first line (prefixq.cli): nothing slow
    import asyncio

    from prefixq.core.settings import Settings

log = logging.getLogger(__name__)

__all__ = ["EXIT_S", "STOP_SPARE_S", "WorkerSignals", "start_worker"]

#: seconds a stop during start-up may take to unwind before the process exits regardless
EXIT_S = 5.0
#: seconds past its bound (`prefixq.worker.lifecycle.stop_bound_s`, which leaves out the engine's
#: own shutdown: vLLM's ends its core processes within some 5 s, then kills them) that a stop of a
#: serving worker may take before the process exits regardless
STOP_SPARE_S = 30.0
#: the signals that stop a worker
STOPS = frozenset({signal.SIGTERM, signal.SIGINT})


def start_worker(
    cmd: Sequence[str],
    *,
    started: Callable[[subprocess.Popen[bytes]], None] | None = None,
    **popen: Any,
) -> subprocess.Popen[bytes]:
    """Start the ``prefixq worker`` command ``cmd`` (`subprocess.Popen` with ``popen``) with
    SIGTERM and SIGINT blocked: one sent while its interpreter starts (~30 ms before any prefixq
    code runs) then waits for its first handlers (prefixq.cli, which unblocks them) instead of
    killing it (-15). The caller's own signal mask is restored at once, after ``started`` got the
    new process: a stop the caller got meanwhile (blocked until then: its handler runs as the mask
    is restored) finds the process where ``started`` recorded it, and passes it on."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
    try:
        proc = subprocess.Popen(cmd, **popen)
        if started is not None:
            started(proc)
        return proc
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


class Stoppable(Protocol):
    """What the handler needs of the worker: its stop, and for the stop's watchdog its bound and
    its heartbeat (the pid, host and start it beats with: `prefixq.worker.heartbeat.drop_own`)."""

    settings: Settings
    shard: int
    name: str
    started: float
    hand_over: bool
    #: called at its first stop, whatever the cause (the engine's death stops it too)
    on_stop: Callable[[], None] | None

    @property
    def engine_up(self) -> bool: ...

    @property
    def exit_code(self) -> int: ...

    def stop(self) -> None: ...


class WorkerSignals:
    """``WorkerSignals().install()`` first; `serve(worker, loop)` once the worker is built."""

    def __init__(self) -> None:
        self._worker: Stoppable | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._leaving = False
        #: the serving stop's watchdog: (after how many seconds, what it releases first)
        self._stop_watch: tuple[float, Callable[[], None]] | None = None

    def install(self) -> WorkerSignals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)  # blocked by `start_worker`
        return self

    def serve(self, worker: Stoppable, loop: asyncio.AbstractEventLoop) -> None:
        """From now on a signal stops ``worker`` (running on ``loop``) once it serves."""
        from prefixq.worker.heartbeat import drop_own
        from prefixq.worker.lifecycle import stop_bound_s

        s = worker.settings
        bound = stop_bound_s(s, hand_over=worker.hand_over) + STOP_SPARE_S
        drop = functools.partial(drop_own, s, worker.shard, worker.name, worker.started)
        hung = functools.partial(_stop_hung, bound, drop, lambda: worker.exit_code)
        self._stop_watch = (bound, hung)
        self._worker, self._loop = worker, loop
        worker.on_stop = self._watch_stop  # a stop of its own (its engine died) is watched too

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        worker, loop = self._worker, self._loop
        if worker is not None and loop is not None and worker.engine_up:
            self._watch_stop()
            if not loop.is_closed():  # closed: the worker has stopped, the process is ending
                loop.call_soon_threadsafe(worker.stop)
            return
        if self._leaving:  # a second signal while the start unwinds
            return
        self._leaving = True
        # ignored from now on, not only here: the interpreter's exit resets a Python handler to
        # the default action, and a second SIGTERM then would end the process with -15, not 0
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        log.info("%s during start-up: exiting (serving nothing yet)", signal.Signals(signum).name)
        if inside_import(frame):  # raising there can abort the process (prefixq.cli)
            leave_now()
        unwinding()  # whatever the unwinding raises, the process exits 0 (prefixq.cli), quietly
        _watchdog(EXIT_S, exit_released)  # the shard's hold released first (`on_leave`)
        raise SystemExit(0)

    def _watch_stop(self) -> None:
        """At the first stop of the serving worker: the process exits once the stop is past its
        bound, its heartbeat dropped first (`_stop_hung`)."""
        watch, self._stop_watch = self._stop_watch, None
        if watch is not None:
            _watchdog(*watch)


def _watchdog(after_s: float, leave: Callable[[], object]) -> None:
    """``leave()`` (an exit) on a daemon thread after ``after_s``, unless the process is gone."""
    watchdog = threading.Timer(after_s, leave)
    watchdog.daemon = True
    watchdog.start()


def _stop_hung(bound_s: float, drop: Callable[[], object], code: Callable[[], int]) -> None:
    """The serving stop's watchdog: what the worker holds released (its heartbeat: ``drop``),
    each best effort and bounded (`exit_released`), then exit with the worker's code (``code``:
    0, or 3 if its engine died, so that a supervisor restarts it as it would have)."""

    def release() -> None:
        log.warning("the stop did not end within %.1fs: exiting regardless", bound_s)
        if drop():
            log.info("dropped the heartbeat the stop had left")

    exit_released(release, code=code())
