"""A worker stopped while it starts (prefixq.cli, prefixq.cli.worker_signals): it holds nothing
yet, so it exits 0, at once where unwinding is not safe (`inside_import`, `leave_now`), and
whatever the unwinding raises (`STOPPING`). Standard library only: imported at the process's
first line.
"""

from __future__ import annotations

import sys
import threading
from types import FrameType

__all__ = ["STOPPING", "inside_import", "leave_now"]

#: set by a stop signal that came while a worker started (prefixq.cli, or its worker_signals)
STOPPING = threading.Event()


def inside_import(frame: FrameType | None) -> bool:
    """Whether ``frame`` (a signal handler's) runs inside an import."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


def leave_now() -> None:
    """Exit 0 at once, the log flushed: for a stop that cannot unwind safely (inside an import),
    at a moment the process holds nothing; an engine it started dies with it (the reaper)."""
    import logging
    import os

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            continue
    os._exit(0)
