"""The file a burst's results are written to (``submit --wait --out``, ``results --out``,
`run_burst(out=...)`): checked before the burst is submitted, written whole or not at all.

A regular file (or a new one) is written beside itself under a temporary name of its own and
renamed over it once the last line is in, so a reader never sees half a file, and a write that
fails (a full disk, a burst that timed out) leaves what was there before. Written in place
instead (a rename would replace the device, the pipe or the caller's redirection, or is not
allowed): appending, what is not a regular file (a FIFO, a terminal) and any path under ``/dev``
or ``/proc`` (``/dev/stdout`` redirected to a file is that file: ``>> all.jsonl`` keeps what it
held); from its start, another user's file in a sticky folder such as ``/tmp``. A symbolic link
is followed: its target is replaced, the link stays.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import sys
from collections.abc import Iterator
from typing import IO

__all__ = ["out_path_problem", "writing"]

#: paths written in place whatever they lead to (the process's own descriptors, devices)
_IN_PLACE_ROOTS = ("/dev/", "/proc/")


def _in_place(path: str) -> str | None:
    """How ``path`` is opened when it is written in place rather than replaced (above): ``"a"``
    for a device, a pipe or a path under /dev or /proc, ``"w"`` for another user's file in a
    sticky folder; None when it is replaced."""
    if os.path.abspath(path).startswith(_IN_PLACE_ROOTS):
        return "a"
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return "a"
    folder = os.stat(os.path.dirname(os.path.realpath(path)))
    me = os.geteuid()
    # a sticky folder lets only the file's or the folder's owner (or root) rename over a file
    foreign = bool(folder.st_mode & stat.S_ISVTX) and me not in (0, st.st_uid, folder.st_uid)
    return "w" if foreign else None


def _is_stdout(path: str) -> bool:
    """Whether ``path`` is this process's standard output (``/dev/stdout``, or the file it was
    redirected to): written through it, not a second file position that the lines printed after
    them would overwrite."""
    try:
        a, b = os.stat(path), os.fstat(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def out_path_problem(path: str | os.PathLike[str]) -> str | None:
    """Why a burst's results could not be written to ``path`` (checked before the burst is
    submitted, not after it ran), as a phrase whose subject is the path; None when they can."""
    p = os.fspath(path)
    try:
        os.stat(p)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a loop of symbolic links"
    if os.path.isdir(p):
        return "is a folder, not a file path"
    if _in_place(p) is not None:
        return None if os.access(p, os.W_OK) else "is a file that is not writable"
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
    mode_in_place = _in_place(p)
    if mode_in_place is not None and _is_stdout(p):  # one offset with what else goes there
        yield sys.stdout
        sys.stdout.flush()
        return
    if mode_in_place is not None:
        with open(p, mode_in_place, encoding="utf-8") as f:
            yield f
        return
    target = os.path.realpath(p)
    folder, name = os.path.split(target)
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = None
    # a name of its own per write: two writers of one path (threads, processes with one pid in
    # two containers) never share a temporary file; the umask applies to a new file's mode
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{secrets.token_hex(6)}.partial")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
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
