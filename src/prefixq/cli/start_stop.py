"""A worker stopped while it starts (prefixq.cli, prefixq.cli.worker_signals): it serves nothing
yet, so it exits 0, at once where unwinding is not safe (`inside_import`, `leave_now`: what it
holds meanwhile, its shard's hold, is released first: `on_leave`), and
whatever the unwinding raises (`STOPPING`), quietly, and at once where Python swallows the stop
(`unwinding`). A watchdog that ends a stop whose unwinding hangs releases the same first, within
`LEAVE_S` (`exit_released`). Standard library only: imported at the process's
first line.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import NoReturn

__all__ = [
    "LEAVE_S",
    "STOPPING",
    "exit_released",
    "inside_import",
    "leave_now",
    "off_leave",
    "on_leave",
    "unwinding",
]

#: set by a stop signal that came while a worker started (prefixq.cli, or its worker_signals)
STOPPING = threading.Event()
#: what `leave_now` and `exit_released` run before the exit (`on_leave`)
_ON_LEAVE: list[Callable[[], None]] = []
#: seconds `exit_released` gives the releases of what the worker holds before it exits regardless
LEAVE_S = 1.5


def on_leave(release: Callable[[], None]) -> None:
    """Run ``release`` in `leave_now` and `exit_released`, before the process exits (they skip
    the unwinding that would have released what the worker holds: the hold on its shard,
    cli/fleet_commands.py).
    ``release`` runs in the handler of a stop inside an import: it must import nothing on the
    calling thread, and return within a bounded time (a Redis that is down included)."""
    _ON_LEAVE.append(release)


def off_leave(release: Callable[[], None]) -> None:
    """Forget ``release`` (`on_leave`): what it releases was released otherwise."""
    try:
        _ON_LEAVE.remove(release)
    except ValueError:  # not there, or taken meanwhile by an exit's releases
        return


def inside_import(frame: FrameType | None) -> bool:
    """Whether ``frame`` (a signal handler's) runs inside an import."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def leave_now() -> None:
    """Exit 0 at once, the log flushed: for a stop that cannot unwind safely (inside an import),
    before the worker serves; what it holds meanwhile is released first (`on_leave`: its shard's
    hold); an engine it started dies with it (the reaper).
    It imports nothing: called inside an import, a module this one loads could find the module
    being imported half-built (``logging`` imports ``re``: a stop inside ``import re`` made
    ``import logging`` fail with "partially initialized module 're'", and the process exit 1)."""
    _release_held()
    shutdown = getattr(sys.modules.get("logging"), "shutdown", None)  # only a logging in use
    if shutdown is not None:
        shutdown()
    _flush()
    os._exit(0)


def exit_released(*more: Callable[[], None], code: int = 0) -> NoReturn:
    """Exit ``code`` (0 unless said) now, what the worker holds released first (`on_leave`'s
    releases, then ``more``, each best effort), all within `LEAVE_S` whatever they do: for a
    watchdog ending a stop whose unwinding hangs (cli/worker_signals.py), which would otherwise
    leave the hold on the worker's shard to its TTL. The releases and the flush of the output
    run on a thread of their own, waited for `LEAVE_S` at most: the hung main thread may hold
    what they need (a log handler's lock, writing to a full pipe), and the exit never waits for
    it. Never raises."""

    def release() -> None:
        _release_held()
        for call in more:
            try:
                call()
            except BaseException:  # never a reason not to exit 0
                continue
        _flush()

    try:
        t = threading.Thread(target=release, name="prefixq-leave", daemon=True)
        t.start()
        t.join(LEAVE_S)
    finally:
        os._exit(code)


def _release_held() -> None:
    """Run what `on_leave` registered (what the worker holds), each once, none raising."""
    while _ON_LEAVE:
        try:
            _ON_LEAVE.pop()()
        except BaseException:  # IndexError (taken meanwhile) included: never a reason not to exit
            continue


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # None without a console
            continue


def unwinding() -> None:
    """A stop came while the worker starts, and the handler is about to raise ``SystemExit(0)``
    wherever the main thread is: `STOPPING` set; from now on, what the unwinding leaves behind is
    not reported (asyncio's "Task exception was never retrieved" for a task the SystemExit went
    through, "Task was destroyed but it is pending!", a coroutine never awaited: ERROR lines and
    tracebacks of a process that exits 0 holding nothing); and a ``SystemExit`` that Python
    swallows (raised inside a finalizer, ``__del__`` or a weakref callback, which the garbage
    collector runs anywhere: "Exception ignored in") leaves at once (`leave_now`), where the
    start would otherwise have gone on to serve until the watchdog ended it. Call it outside an
    import only (`inside_import`: there, `leave_now`): it imports ``logging``."""
    import logging
    import warnings

    STOPPING.set()
    logging.getLogger("asyncio").disabled = True
    warnings.simplefilter("ignore")
    previous = sys.unraisablehook

    def swallowed(unraisable: sys.UnraisableHookArgs) -> None:
        if unraisable.exc_type is SystemExit:
            leave_now()
        previous(unraisable)

    sys.unraisablehook = swallowed
