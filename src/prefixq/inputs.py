"""Requests in: a JSONL file's lines, or Python objects, into validated `Request` records.

A bad line is refused with its 1-based line number before anything is enqueued.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from prefixq.errors import ValidationError
from prefixq.records import Request
from prefixq.settings import Settings

__all__ = ["normalize", "read_requests"]


def read_requests(path: str, settings: Settings | None = None) -> list[Request]:
    """Requests from a JSONL file, validated against the settings' limits; the error names the
    first bad line (its number in the file)."""
    s = settings or Settings()
    f = sys.stdin if path == "-" else open(path, encoding="utf-8")  # noqa: SIM115
    out: list[Request] = []
    with f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValidationError(f"{path}: line {n + 1} is not JSON: {e.msg}") from None
            out.append(
                Request.from_json(
                    obj, index=n, max_chars=s.max_prompt_chars, max_messages=s.max_messages
                )
            )
    return out


def normalize(requests: Iterable[Request | Mapping[str, Any]], settings: Settings) -> list[Request]:
    """Requests from dicts (plain or OpenAI batch lines), validated; duplicate ids refused."""
    out: list[Request] = []
    limits = {"max_chars": settings.max_prompt_chars, "max_messages": settings.max_messages}
    for i, r in enumerate(requests):
        if isinstance(r, Request):
            r.validate(where=f"request {i} ({r.id!r})", **limits)
            out.append(r)
        else:  # parsed and validated once, against the settings' limits
            out.append(Request.from_json(r, index=i, **limits))
    if not out:
        raise ValidationError("the burst is empty")
    dupes = [k for k, n in Counter(r.id for r in out).items() if n > 1]
    if dupes:
        raise ValidationError(f"duplicate request ids: {', '.join(map(repr, dupes[:5]))}")
    return out
