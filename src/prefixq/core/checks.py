"""What the values of a request may hold: valid Unicode (no lone surrogates), integers that fit in
64 bits, only the types JSON has, bounded nesting, and nothing over the caps a worker decodes an
entry within (`wire.Limits`: strings, lists, maps); and the shape of a burst's ``on_complete``
(`callback_path`).

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
from prefixq.core.wire import MAX_ARRAY_LEN, MAX_MAP_LEN, MAX_STR_BYTES

__all__ = ["MAX_DEPTH", "callback_path", "check_nested", "check_text", "too_long"]

#: deepest nesting of lists and maps inside one chat message (the wire format allows 32 in all)
MAX_DEPTH = 16
_SURROGATE = re.compile("[\ud800-\udfff]")
#: strings this long that passed `check_text` are remembered (by identity, the object held so its
#: id stays its own); a handful is enough for the documents of the bursts being submitted
_REMEMBER_CHARS = 4096
_REMEMBERED = 8
_clean: dict[int, str] = {}
#: strings longer than this many characters may be over the wire's string cap in UTF-8 (at most 4
#: bytes a character): only they are measured
_MEASURE_FROM = MAX_STR_BYTES // 4
#: map keys the wire carries back as they were (a tuple would come back a list, no key)
_KEY_TYPES = (str, int, float, type(None))


def check_text(s: str, what: str, w: str) -> None:
    """ValidationError ``w + what ...`` if ``s`` holds a lone surrogate, or is longer in UTF-8
    than the wire's string cap (`wire.MAX_STR_BYTES`).

    Cheap by design: an ASCII string is accepted in O(1) (``str.isascii``); others are searched
    once with a regular expression; and a long string already found clean is remembered by
    identity, so a document shared by every request of a burst (the same ``str`` object) is
    searched once, not once per request. Only a string of over 4 Mi characters is measured."""
    if len(s) > _MEASURE_FROM:
        _check_str_bytes(s, what, w)
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


def _check_str_bytes(s: str, what: str, w: str) -> None:
    n = len(s) if s.isascii() else len(s.encode("utf-8", "surrogatepass"))
    if n > MAX_STR_BYTES:
        raise ValidationError(
            w + f"{what} is {n} bytes of UTF-8, over {MAX_STR_BYTES}, the longest string the "
            "wire format carries (a worker could not decode it)"
        )


def check_nested(value: Any, what: str, w: str, depth: int = 0) -> None:
    """`check_text` on every string inside ``value`` (map keys too); ValidationError for a value
    that is not a str, int, float, bool, None, list, tuple or dict (what JSON holds: a set, bytes
    or a datetime would fail deep in the encoder, or come back changed), a map key that is not a
    str, number or None, an integer outside 64 bits, a list of over `MAX_ARRAY_LEN` items or a
    map of over `MAX_MAP_LEN` pairs (a worker could not decode it), or lists and maps nested
    deeper than `MAX_DEPTH`."""
    if isinstance(value, str):
        check_text(value, what, w)
    elif isinstance(value, int):
        if not -(1 << 63) <= value < 1 << 64:
            raise ValidationError(w + f"{what} is out of range (at most 64 bits)")
    elif isinstance(value, float) or value is None:
        return
    elif not isinstance(value, dict | list | tuple):
        raise ValidationError(
            w + f"{what} is a {type(value).__name__}: a value must be a string, number, "
            "boolean, null, list or object (as in JSON)"
        )
    elif depth >= MAX_DEPTH:
        raise ValidationError(w + f"{what} is nested more than {MAX_DEPTH} levels deep")
    elif isinstance(value, dict):
        if len(value) > MAX_MAP_LEN:
            raise ValidationError(w + too_long(what, len(value), "keys", MAX_MAP_LEN, "map"))
        for k, v in value.items():
            if isinstance(k, str):
                check_text(k, f"{what} key", w)
                check_nested(v, f"{what} {k}", w, depth + 1)
                continue
            if not isinstance(k, _KEY_TYPES):
                raise ValidationError(
                    w + f"{what} has a key of type {type(k).__name__}: keys must be strings "
                    "(or numbers)"
                )
            check_nested(k, f"{what} key {k!r}", w, depth + 1)
            check_nested(v, f"{what}[{k!r}]", w, depth + 1)
    else:
        if len(value) > MAX_ARRAY_LEN:
            raise ValidationError(w + too_long(what, len(value), "items", MAX_ARRAY_LEN, "list"))
        for i, v in enumerate(value):
            check_nested(v, f"{what}[{i}]", w, depth + 1)


def too_long(what: str, n: int, unit: str, cap: int, kind: str) -> str:
    """The refusal of a ``kind`` (list, map) of ``n`` ``unit`` over the wire's ``cap``."""
    return (
        f"{what} has {n} {unit}, over {cap}, the longest {kind} the wire format carries (a worker "
        "could not decode it)"
    )


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
