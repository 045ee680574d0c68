"""A JSONL file's requests, checked once and read again as they are enqueued (`RequestFile`).

A 50,000-line OpenAI batch file parsed whole is several times its size in Python objects. A
`RequestFile` keeps per request only where its line is in the file, its line number, its id and
what enqueue ordering and prefix counting need (`prefixq.client.order.Peek`: a fingerprint of its
shared prefix and a few counts); the `Producer` reads each line again when it encodes the chunk it
belongs to (`os.pread`: one system call a line, in any order), so a submit holds one chunk of
parsed requests at a time. The file must not change while it is enqueued.

`read_request_file` is `prefixq submit`'s pass over a file (the rules of
`prefixq.core.inputs.read_requests`: the first bad line is refused, naming it); the OpenAI batch
server's check of an input file (prefixq.openai.validate) fills one line by line with `add`.
"""

from __future__ import annotations

import os
import sys
import tempfile
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Protocol, overload

from prefixq.client.order import Peek, peek, peeks
from prefixq.core.entry_size import check_size
from prefixq.core.errors import ValidationError
from prefixq.core.inputs import BLANK, IdCheck, read_json_line
from prefixq.core.records import Request
from prefixq.core.settings import Settings

__all__ = ["RequestFile", "read_request_file"]


class RequestFile(Sequence[Request]):
    """Requests of the file at ``path``, in file order, each read again on access."""

    def __init__(self, path: str | Path, settings: Settings, *, name: str = "") -> None:
        self.path, self.s = Path(path), settings
        self.name = name or str(path)
        self._fd: int | None = None
        self._offsets = array("q")
        self._lengths = array("l")
        self._lines = array("l")
        #: request ids in file order
        self.ids: list[str] = []
        self._peeks: list[Peek] = []
        #: requests refused per line (`Request.refused`, from the OpenAI server's check), by
        #: index: their line cannot be read again into them, and they are small
        self._refused: dict[int, Request] = {}

    # ---- building ----------------------------------------------------------------------------
    def add(self, offset: int, length: int, line: int, req: Request) -> None:
        """A checked request whose line (1-based ``line``) is ``length`` bytes at ``offset``."""
        self._offsets.append(offset)
        self._lengths.append(length)
        self._lines.append(line)
        if req.refusal is not None:
            self._refused[len(self.ids)] = req
        self.ids.append(req.id)
        self._peeks.append(peek(req, "decode-first"))  # group and counts; no path

    def clear(self) -> None:
        """Forget every request (a file with errors is not enqueued)."""
        for a in (self._offsets, self._lengths, self._lines):
            del a[:]
        self.ids.clear()
        self._peeks.clear()
        self._refused.clear()

    # ---- reading -----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, i: int) -> Request: ...
    @overload
    def __getitem__(self, i: slice) -> list[Request]: ...
    def __getitem__(self, i: int | slice) -> Request | list[Request]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        if i in self._refused:
            return self._refused[i]
        raw = os.pread(self.open(), self._lengths[i], self._offsets[i])
        n = self._lines[i]
        obj = read_json_line(raw, n, self.name)
        s = self.s
        return Request.from_json(
            obj, index=n - 1, max_chars=s.max_prompt_chars, max_messages=s.max_messages
        )

    def __iter__(self) -> Iterator[Request]:
        return (self[i] for i in range(len(self)))

    def line(self, i: int) -> int:
        """The 1-based line number of request ``i``."""
        return self._lines[i]

    def peeks(self, order: str) -> list[Peek]:
        """What `prefixq.client.order.enqueue_order` needs for ``order``: kept from the check,
        except the depth-first paths, which are read from the file again."""
        if order != "depth-first":
            return self._peeks
        walked = peeks(self, order)
        return [
            Peek(w.group, w.path, p.output, p.size, p.lead)
            for w, p in zip(walked, self._peeks, strict=True)
        ]

    def open(self) -> int:
        """The file's descriptor (opened on first use)."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()


def line_limit(s: Settings) -> int:
    """The longest line a request file may hold: twice the largest decoded entry, plus the
    longest prompt with every character written as a JSON surrogate pair (12 bytes)."""
    return 2 * s.max_decoded_bytes + 12 * s.max_prompt_chars


def read_request_file(path: str, settings: Settings | None = None) -> RequestFile:
    """The requests of a JSONL file ('-': stdin, copied to a temporary file line by line),
    checked as `prefixq.core.inputs.read_requests` checks them: ValidationError names the first
    bad line."""
    s = settings or Settings()
    if path == "-":
        return _from_stdin(s)
    try:
        f = open(path, "rb")  # noqa: SIM115
    except FileNotFoundError:
        raise
    except OSError as e:  # a directory, no permission
        raise ValidationError(f"{path}: cannot read it: {e.strerror}") from None
    with f:
        return _check(f, path, path, s)


class _Lines(Protocol):
    def readline(self, size: int = -1, /) -> bytes: ...


class _Copying:
    """Lines read from ``src``, each written to ``dst`` as it is read."""

    def __init__(self, src: IO[bytes], dst: IO[bytes]) -> None:
        self.src, self.dst = src, dst

    def readline(self, size: int = -1, /) -> bytes:
        line = self.src.readline(size)
        self.dst.write(line)
        return line


def _from_stdin(s: Settings) -> RequestFile:
    """stdin's requests, copied to a temporary file line by line as they are checked: a stream
    that is not request lines stops at its first bad line instead of filling the disk first."""
    tmp = tempfile.NamedTemporaryFile(prefix="prefixq-stdin-", suffix=".jsonl", delete=False)  # noqa: SIM115
    try:
        with tmp:
            out = _check(_Copying(sys.stdin.buffer, tmp), tmp.name, "stdin", s)
        out.open()  # before the unlink below
        return out
    finally:
        os.unlink(tmp.name)  # the descriptor kept open reads it (POSIX) until it is closed


def _check(f: _Lines, path: str, name: str, s: Settings) -> RequestFile:
    out = RequestFile(path, s, name=name)
    ids = IdCheck(lambda i: f"line {out.line(i)}", f"{name}: ")
    offset, limit = 0, line_limit(s)
    for n, raw in enumerate(iter(lambda: f.readline(limit + 1), b""), 1):
        if len(raw) > limit:  # no request this deployment takes is that long: not read whole
            raise ValidationError(
                f"{name}: line {n} is longer than {limit:,} bytes, more than any request "
                "can take (max_decoded_bytes, max_prompt_chars): not a file of request lines?"
            )
        obj = read_json_line(raw, n, name)
        if obj is not BLANK:
            try:
                req = Request.from_json(
                    obj, index=n - 1, max_chars=s.max_prompt_chars, max_messages=s.max_messages
                )
                check_size(req, s, f"line {n}")
            except ValidationError as e:  # it names the line; add the file
                raise ValidationError(f"{name}: {e}") from None
            out.add(offset, len(raw), n, req)
            ids.add(len(out) - 1, [req.id])
        offset += len(raw)
    return out
