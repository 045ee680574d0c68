"""The `prefixq` command (`prefixq.cli:main`, the console script, and ``python -m prefixq``).

`main` installs `prefixq worker`'s first SIGTERM and SIGINT handlers before it imports the
command (redis-py alone takes ~0.4 s to import, vLLM far longer), and unblocks both signals
(`prefixq.cli.worker_signals.start_worker` starts a worker with them blocked, so that one sent
right away waits for this handler): a stop before the worker serves exits 0 at once, from the
process's first line of prefixq code on. `prefixq.cli.worker_signals` takes over from there.
Such a stop unwinds the start by raising ``SystemExit(0)`` where the main thread is, except
inside an import: raised there, in a C extension's initialisation (numpy's, torch's, under
vLLM's), it can abort the process (pybind11 terminates on it) or leave the module half-built, to
fail again as the start unwinds ("CPU dispatcher tracer already initialized"); a worker that is
still importing serves nothing, so it leaves at once (`leave_now`: its shard's hold released,
logs flushed, exit 0). Whatever
else the unwinding raises, a worker stopped during its start exits 0 (`STOPPING`). This module
imports nothing that takes time.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

from prefixq.cli.start_stop import STOPPING, inside_import, leave_now, unwinding

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the ``prefixq`` command (``argv``: its arguments; default ``sys.argv[1:]``)."""
    # the worker, and the demo (started with SIGINT ignored, a background job's: its own
    # handlers come after its imports, and it starts nothing before them)
    if (sys.argv[1:] if argv is None else argv)[:1] in (["worker"], ["demo"]):
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _exit_during_start)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        # importing the command's module makes `prefixq.cli.main` name that module from here on
        from prefixq.cli.main import main as command

        return command(argv)
    except BaseException as e:
        if not STOPPING.is_set() or (isinstance(e, SystemExit) and e.code in (0, None)):
            raise
        print(f"prefixq: stopped during start-up ({type(e).__name__} while unwinding: {e})",
              file=sys.stderr)  # fmt: skip
        return 0


def _exit_during_start(signum: int, frame: FrameType | None) -> None:
    """A stop while the worker (or the demo) imports its command: it serves (or started)
    nothing yet; exit 0."""
    if inside_import(frame):  # before anything imports: the module being imported is half-built
        leave_now()
    unwinding()
    raise SystemExit(0)
