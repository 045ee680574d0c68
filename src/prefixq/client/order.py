"""The order a burst's requests are enqueued in (`Producer.asubmit(order=...)`).

Workers admit entries in stream order, so the enqueue order is the admission order. Requests that
share a prefix (a document, a system prompt and a document, a chat's leading messages) form a
*group*; requests without one are groups of one. Orders (`ORDERS`):

- ``input``: the burst as given.
- ``leaders-first``: the first request of every group first, then the rest in input order.
- ``grouped``: groups in order of first appearance, each group's requests together (on two
  H200 it ran a 64-document reuse burst 3.4% faster than ``input`` and a 160-document burst
  that overflows the KV cache 1.88x faster: docs/BENCHMARKS.md).
- ``depth-first``: groups in the order of a depth-first walk of the prefix tree, so groups whose
  prefixes share a leading part (one system prompt before several documents) come one after
  another; siblings are ordered by content (hashes of the prefix's leading blocks, `PATH_BLOCK`
  bytes each), so two bursts over the same documents walk them in the same order. Requests
  without a shared prefix come first, in input order.
- ``decode-first`` (the default, ``enqueue_order``): groups that ask for long answers first,
  longest first, then the rest in the grouped order. A group asks for a long answer when one of
  its requests' output budget is at least `LONG_OUTPUT` times what the burst's shortest tenth
  asks (its 10th percentile: a few odd short ones do not count, and long answers are moved
  even where they are most of the burst, whose short ones would end up beside them): such a
  request's decode is a chain of that many engine steps, and started early it runs beside the
  other groups' prefill instead of alone at the end of the burst (BatchLLM's observation; the
  longest chain first, as in longest-processing-time scheduling). On one H200 this order ran a
  burst of 256 prefill-heavy and 64 decode-heavy requests 1.046-1.057x the burst sorted by
  document handed to vLLM alone (grouped: 0.999-1.015; docs/BENCHMARKS.md). Where no request
  asks for several times the burst's short answers it is exactly ``grouped``, so a burst's own
  requests keep their order and bursts that share the workers stay fair (an earlier rule that
  sorted every group by output per prompt token cost that: three tenants' bursts of 12-16
  output tokens completed 24 : 31 : 28 on the vLLM CPU engine while all had work, grouped
  27 : 29 : 27). Where long answers are asked, a burst's first results come later (after its
  long answers' first decode steps): ``grouped`` where time to the first result matters more.

Ordering looks at each request as given (`peek`, no validation: the burst's head still goes out
within milliseconds) and keeps a small `Peek` per request, never the request. Results are read
back in input order whatever the order.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from prefixq.core import wire
from prefixq.core.entries import split_prefix
from prefixq.core.records import Request
from prefixq.core.sampling import DEFAULT_MAX_TOKENS
from prefixq.core.settings import ORDERS

__all__ = [
    "LONG_OUTPUT",
    "ORDERS",
    "PATH_BLOCK",
    "Peek",
    "enqueue_order",
    "peek",
    "peek_prefix",
    "peeks",
]

#: bytes per block of a prefix's depth-first path (UTF-8 text, 8-byte token ids, packed messages)
PATH_BLOCK = 1024
#: an output budget this many times the burst's 10th percentile is a long answer (decode-first)
LONG_OUTPUT = 4


@dataclass(frozen=True, slots=True)
class Peek:
    """What ordering needs of one request: its group (a content key of its shared prefix; None:
    a group of its own), for ``depth-first`` its prefix's path, and for ``decode-first`` the
    output tokens it asks (0: not looked at); ``size`` is the prefix's
    `prefixq.core.entries.prefix_size` (whether it is long enough to store once: the producer
    counts each group's uses from these, client/encoding.py); ``lead`` the hash of its prefix's
    first block (the first of a depth-first path: the shared pass's content order of prefixes
    used once, client/shared_pass.py)."""

    group: Hashable | None = None
    path: tuple[int, ...] = ()
    output: int = 0
    size: int = 0
    lead: int = 0


def enqueue_order(
    order: str,
    items: Sequence[Peek],
    arrange: Callable[[list[list[int]]], list[list[int]]] | None = None,
) -> list[int]:
    """A permutation of ``range(len(items))`` for ``order`` (`peeks` makes ``items``);
    ``arrange`` reorders the groups of ``grouped`` and ``decode-first`` (those after the long
    answers) for the shared pass (client/shared_pass.py)."""
    n = len(items)
    if order == "input":
        return list(range(n))
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}")
    groups: dict[Hashable, list[int]] = {}
    for i, p in enumerate(items):
        groups.setdefault(("own", i) if p.group is None else p.group, []).append(i)
    members = list(groups.values())  # in order of first appearance (dicts keep insertion order)
    if order == "leaders-first":
        return [g[0] for g in members] + sorted(i for g in members for i in g[1:])
    if order == "depth-first":
        members.sort(key=lambda g: items[g[0]].path)  # stable: equal paths keep first appearance
    n = 0  # leading groups that keep their places (decode-first's long answers)
    if order == "decode-first":
        members, n = _long_answers_first(items, members)
    if arrange is not None and order in ("grouped", "decode-first"):
        members = members[:n] + arrange(members[n:])
    return [i for g in members for i in g]


def _long_answers_first(
    items: Sequence[Peek], members: list[list[int]]
) -> tuple[list[list[int]], int]:
    """The groups asking for a long answer (`LONG_OUTPUT`), longest first, then the rest as they
    are (ties and the rest keep their order: sorting is stable), and how many ask for one. A
    group asks for a long answer when one of its requests' output budget is at least
    `LONG_OUTPUT` times the burst's 10th percentile (the lower one)."""
    budgets = sorted(p.output for p in items if p.output > 0)
    if not budgets:
        return members, 0
    long = LONG_OUTPUT * budgets[(len(budgets) - 1) // 10]
    longest = [max(items[i].output for i in g) for g in members]
    ranked = sorted(range(len(members)), key=lambda k: -longest[k] if longest[k] >= long else 0)
    return [members[k] for k in ranked], sum(1 for x in longest if x >= long)


#: a prefix value and what was computed of it: group, path, size, lead
_Known = tuple[Any, Hashable, tuple[int, ...], int, int]


def peeks(raw: Sequence[Request | Mapping[str, Any]], order: str) -> list[Peek]:
    """One `Peek` per request for ``order`` (its group always; the rest only for the order that
    looks at it); a prefix object shared by many requests is looked at once."""
    memo: dict[int, _Known] = {}
    return [peek(x, order, memo) for x in raw]


def peek(
    raw: Request | Mapping[str, Any], order: str, memo: dict[int, _Known] | None = None
) -> Peek:
    """The `Peek` of one request as given, for ``order``. ``memo`` (by object identity, holding
    the object so that its id cannot be reused) spares hashing a prefix shared by many.

    Never raises: the burst is ordered before it is validated, so a request too odd to look at
    (a message whose content is a number, a prefix that is not packable) is a group of its own
    with no counts, and validation refuses it with its line number when its chunk comes."""
    try:
        return _peek(raw, order, memo)
    except Exception:
        return Peek()


def _peek(raw: Request | Mapping[str, Any], order: str, memo: dict[int, _Known] | None) -> Peek:
    from prefixq.client.encoding import _fingerprint

    prefix = peek_prefix(raw)
    group: Hashable | None = None
    path: tuple[int, ...] = ()
    size = lead = 0
    if prefix:
        ((_, value),) = prefix.items()
        known = memo.get(id(value)) if memo is not None else None
        if known is None or known[0] is not value:
            fp: Hashable = _fingerprint(value)
            walk = _path(value) if order == "depth-first" else ()
            known = (value, fp, walk, _size(value), walk[0] if walk else _lead(value))
            if memo is not None:
                memo[id(value)] = known
        _, group, path, size, lead = known
    output = _output(raw) if order == "decode-first" else 0
    return Peek(group, path, output, size, lead)


def _size(value: Any) -> int:
    """`prefixq.core.entries.prefix_size` of a prefix value: characters, 4 per token id."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list) and value and isinstance(value[0], Mapping):
        return sum(len(m.get("content") or "") for m in value)
    return 4 * len(value) if isinstance(value, list) else 0


def _lead(value: Any) -> int:
    """The first hash of `_path` (its first block's), without hashing the rest; 0 for a value
    that has no path (validation refuses it later)."""
    try:
        if isinstance(value, str):
            data = value[:PATH_BLOCK].encode("utf-8", "surrogatepass")
        elif isinstance(value, list) and all(isinstance(m, Mapping) for m in value):
            data = wire.pack(value[0]) if value else b""
        else:
            data = array("q", value[: PATH_BLOCK // 8]).tobytes()
    except Exception:  # a hint, like the rest of a Peek
        return 0
    return xxhash.xxh3_64_intdigest(data[:PATH_BLOCK], seed=0)


def _path(value: Any) -> tuple[int, ...]:
    """Chained hashes of a prefix's blocks: prefixes that share leading blocks share leading
    hashes, so sorting paths walks the prefix tree depth first."""
    if isinstance(value, str):
        parts = [value.encode("utf-8", "surrogatepass")]
    elif isinstance(value, list) and all(isinstance(m, Mapping) for m in value):
        parts = [wire.pack(m) for m in value]  # messages: one part each
    else:
        parts = [array("q", value).tobytes()]
    out: list[int] = []
    h = 0
    for data in parts:
        for start in range(0, max(1, len(data)), PATH_BLOCK):
            h = xxhash.xxh3_64_intdigest(data[start : start + PATH_BLOCK], seed=h)
            out.append(h)
    return tuple(out)


def _output(raw: Request | Mapping[str, Any]) -> int:
    """The output tokens a request asks for (the default when it names none)."""
    if isinstance(raw, Request):
        value: Any = raw.sampling.get("max_tokens")
    else:
        body = raw.get("body", raw)
        value = None
        if isinstance(body, Mapping):
            value = body.get("max_tokens", body.get("max_completion_tokens"))
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return DEFAULT_MAX_TOKENS


def peek_prefix(raw: Request | Mapping[str, Any]) -> dict[str, Any] | None:
    """The shared prefix of a request as given (a `Request` or a plain or OpenAI line), without
    validating it: enough to group a burst before it is validated chunk by chunk. Anything odd
    is its own group (validation refuses it later)."""
    try:
        if isinstance(raw, Request):
            return split_prefix(raw)[0]
        body = raw.get("body", raw)
        if not isinstance(body, Mapping):
            return None
        if isinstance(body.get("prefix"), str | list):
            return {"p": body["prefix"]}
        messages = body.get("messages")
        if isinstance(messages, list) and len(messages) > 1:
            return {"m": messages[:-1]}
    except (TypeError, ValueError, AttributeError, KeyError):
        return None
    return None
