"""Requests in: a JSONL file's lines, or Python objects, into validated `Request` records.

A bad line is refused with its 1-based line number before anything is enqueued: bytes that are
not UTF-8, text that is not JSON (or nests too deeply to read), a request that does not validate
(`Request.validate`: shapes, sizes, sampling, valid Unicode), an empty id, or an id that an earlier
line already has. Python objects get the same checks, named by their position (``requests[7]``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prefixq.core.entry_size import check_size
from prefixq.core.errors import ValidationError
from prefixq.core.records import Request
from prefixq.core.settings import Settings

__all__ = ["BLANK", "IdCheck", "normalize", "normalize_one", "read_json_line", "read_requests"]

#: what `read_json_line` returns for a blank line (JSON ``null`` is a value: the line's error)
BLANK: Any = object()


def read_requests(path: str, settings: Settings | None = None) -> list[Request]:
    """Requests from a JSONL file ('-': stdin), validated against the settings' limits; the error
    names the first bad line (its number in the file)."""
    s = settings or Settings()
    name = "stdin" if path == "-" else path
    try:
        f = sys.stdin.buffer if path == "-" else open(path, "rb")  # noqa: SIM115
    except FileNotFoundError:
        raise
    except OSError as e:  # a directory, no permission
        raise ValidationError(f"{path}: cannot read it: {e.strerror}") from None
    out: list[Request] = []
    lines: list[int] = []
    with f:
        for n, raw in enumerate(f, 1):
            obj = read_json_line(raw, n, name)
            if obj is BLANK:
                continue
            try:
                req = Request.from_json(
                    obj, index=n - 1, max_chars=s.max_prompt_chars, max_messages=s.max_messages
                )
                check_size(req, s, f"line {n}")
            except ValidationError as e:  # it names the line; add the file
                raise ValidationError(f"{name}: {e}") from None
            out.append(req)
            lines.append(n)
    _check_ids([r.id for r in out], lambda i: f"line {lines[i]}", f"{name}: ")
    return out


def read_json_line(raw: bytes, n: int, name: str = "input") -> Any:
    """The JSON value of line ``n`` (1-based) of ``name``, or `BLANK` for a blank line (a
    ``null`` line is JSON null, refused by its reader as any value that is not an object);
    ValidationError naming the line for bytes that are not UTF-8 or text that is not JSON."""
    where = f"{name}: line {n}"
    if n == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark
        raw = raw[3:]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValidationError(
            f"{where} is not valid UTF-8 (byte {e.start + 1} of the line is "
            f"{raw[e.start : e.start + 1]!r})"
        ) from None
    if not text.strip():
        return BLANK
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValidationError(f"{where} is not JSON: {e.msg} (column {e.colno})") from None
    except RecursionError:
        raise ValidationError(f"{where} nests too deeply to read as JSON") from None
    except ValueError:  # an integer of more than sys.get_int_max_str_digits() digits
        raise ValidationError(
            f"{where} holds a number of more than {sys.get_int_max_str_digits()} digits"
        ) from None


def normalize(requests: Iterable[Request | Mapping[str, Any]], settings: Settings) -> list[Request]:
    """Requests from dicts (plain or OpenAI batch lines), validated; empty and duplicate ids
    refused, naming positions as ``requests[i]``."""
    out = [normalize_one(r, i, settings) for i, r in enumerate(requests)]
    if not out:
        raise ValidationError("the burst is empty")
    _check_ids([r.id for r in out], lambda i: f"requests[{i}]")
    return out


def normalize_one(r: Request | Mapping[str, Any], i: int, settings: Settings) -> Request:
    """Request ``i`` of a burst (a `Request` or a dict), validated against the settings'
    limits; the error names it as ``requests[i]``. Ids are checked across the burst by
    `IdCheck` (or `normalize`, which does both)."""
    limits = {"max_chars": settings.max_prompt_chars, "max_messages": settings.max_messages}
    if isinstance(r, Request):
        where = f"requests[{i}] ({r.id!r})"
        r.validate(where=where, **limits)
    else:
        where = f"requests[{i}]"
        r = Request.from_json(r, index=i, where=where, **limits)  # parsed and validated once
    check_size(r, settings, where)
    return r


class IdCheck:
    """Empty and duplicate ids across a burst, checked piece by piece (a burst is validated in
    chunks as it is sent); errors name requests by ``label(i)``, after ``head``."""

    def __init__(
        self, label: Callable[[int], str] = lambda i: f"requests[{i}]", head: str = ""
    ) -> None:
        self.label, self.head = label, head
        self._first: dict[str, int] = {}

    def add(self, start: int, ids: list[str]) -> None:
        """Ids of requests ``start``, ``start + 1``, ...: ValidationError for an empty one, or
        one seen before (naming both)."""
        first, label, head = self._first, self.label, self.head
        for k, rid in enumerate(ids):
            i = start + k
            if rid == "":
                raise ValidationError(f"{head}{label(i)}: the id is empty")
            j = first.setdefault(rid, i)
            if j != i:
                raise ValidationError(
                    f"{head}duplicate request ids: {label(i)} and {label(j)} both have id {rid!r}"
                )


def _check_ids(ids: list[str], label: Callable[[int], str], head: str = "") -> None:
    """ValidationError for the first empty id, or the first id seen twice (naming both)."""
    IdCheck(label, head).add(0, ids)
