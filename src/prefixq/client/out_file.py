"""The file a burst's results are written to (``submit --wait --out``, ``results --out``,
`run_burst(out=...)`): checked before the burst is submitted, written whole or not at all.

A regular file (or a new one) is written beside itself under a temporary name and renamed over
it once the last line is in, so a reader never sees half a file, and a write that fails (a full
disk, a burst that timed out) leaves what was there before. What is not a regular file (a FIFO,
``/dev/stdout``, a terminal) is written in place: renaming over it would replace the device or
pipe with a file. A symbolic link is followed: its target is replaced, the link stays.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from typing import IO

__all__ = ["out_path_problem", "writing"]


def _special(path: str) -> bool:
    """``path`` exists and is not a regular file (a FIFO, a device, a socket)."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def out_path_problem(path: str | os.PathLike[str]) -> str | None:
    """Why a burst's results could not be written to ``path`` (checked before the burst is
    submitted, not after it ran), as a phrase whose subject is the path; None when they can."""
    p = os.fspath(path)
    if os.path.isdir(p):
        return "is a folder, not a file path"
    if _special(p):
        return None if os.access(p, os.W_OK) else "is not writable"
    target = os.path.realpath(p)
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        return f"is in a folder that does not exist ({folder!r})"
    if os.path.exists(target) and not os.access(target, os.W_OK):
        return "is a file that is not writable"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"is in a folder that is not writable ({folder!r})"
    return None


@contextlib.contextmanager
def writing(path: str | os.PathLike[str]) -> Iterator[IO[str]]:
    """A text stream for ``path``, published when the block ends without an error (above)."""
    p = os.fspath(path)
    if _special(p):
        with open(p, "w", encoding="utf-8") as f:
            yield f
        return
    target = os.path.realpath(p)
    folder, name = os.path.split(target)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.partial")
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = None
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # the umask applies
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
