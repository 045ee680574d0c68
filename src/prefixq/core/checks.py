"""What the values of a request may hold: valid Unicode (no lone surrogates), integers that fit in
64 bits, bounded nesting; and the shape of a burst's ``on_complete`` (`callback_path`).

A Python ``str`` may hold a lone surrogate (``"\\ud800"``, which ``json.loads`` makes from that
escape); it cannot be encoded as UTF-8, so msgpack, the engine and the JSON output would fail on
it deep inside the producer. `check_text` and `check_nested` refuse it at validation, naming the
field. They run on every string of every request, twice (producer and worker): keep them cheap
(`check_text` says how). docs/delivery.md, "Bad input never stops a worker", lists every check.
"""

from __future__ import annotations

import re
from typing import Any

from prefixq.core.errors import ValidationError

__all__ = ["MAX_DEPTH", "callback_path", "check_nested", "check_text"]

#: deepest nesting of lists and maps inside one chat message (the wire format allows 32 in all)
MAX_DEPTH = 16
_SURROGATE = re.compile("[\ud800-\udfff]")
#: strings this long that passed `check_text` are remembered (by identity, the object held so its
#: id stays its own); a handful is enough for the documents of the bursts being submitted
_REMEMBER_CHARS = 4096
_REMEMBERED = 8
_clean: dict[int, str] = {}


def check_text(s: str, what: str, w: str) -> None:
    """ValidationError ``w + what ...`` if ``s`` holds a lone surrogate.

    Cheap by design: an ASCII string is accepted in O(1) (``str.isascii``); others are searched
    once with a regular expression; and a long string already found clean is remembered by
    identity, so a document shared by every request of a burst (the same ``str`` object) is
    searched once, not once per request."""
    if s.isascii():
        return
    long = len(s) >= _REMEMBER_CHARS
    if long and _clean.get(id(s)) is s:
        return
    m = _SURROGATE.search(s)
    if m:
        raise ValidationError(
            w + f"{what} holds a lone surrogate {m.group()!r} at character {m.start()}: not valid "
            "Unicode (it cannot be encoded as UTF-8)"
        )
    if long:
        if len(_clean) >= _REMEMBERED:
            _clean.clear()
        _clean[id(s)] = s


def check_nested(value: Any, what: str, w: str, depth: int = 0) -> None:
    """`check_text` on every string inside ``value`` (map keys too); ValidationError for an
    integer outside 64 bits or lists and maps nested deeper than `MAX_DEPTH`."""
    if isinstance(value, str):
        check_text(value, what, w)
    elif isinstance(value, int) and not -(1 << 63) <= value < 1 << 64:
        raise ValidationError(w + f"{what} is out of range (at most 64 bits)")
    elif isinstance(value, dict | list | tuple):
        if depth >= MAX_DEPTH:
            raise ValidationError(w + f"{what} is nested more than {MAX_DEPTH} levels deep")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            if isinstance(k, str):
                check_text(k, f"{what} key", w)
            check_nested(v, f"{what} {k}" if isinstance(k, str) else f"{what}[{k}]", w, depth + 1)


_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_SPEC = re.compile(rf"({_IDENT}(?:\.{_IDENT})*):({_IDENT}(?:\.{_IDENT})*)")


def callback_path(spec: str) -> str:
    """A burst's ``on_complete``: ``"pkg.module:func"`` -> ``"pkg.module.func"``, the dotted path
    RQ imports (prefixq.integrations.rq_callbacks).

    Raises ValidationError unless both sides are dotted Python identifiers.
    """
    m = _SPEC.fullmatch(spec.strip())
    if m is None:
        raise ValidationError(f"on_complete {spec!r} must look like 'package.module:function'")
    return f"{m[1]}.{m[2]}"
