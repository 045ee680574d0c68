"""The order a burst's requests are enqueued in (`Producer.asubmit(order=...)`).

Workers admit entries in stream order, so the enqueue order is the admission order:
``input`` (the burst as given), ``leaders-first`` (the first request of every shared prefix — a
document, a system prompt — first, then the requests that can reuse its KV cache) and ``grouped``
(each prefix's first request followed at once by the rest of its group). Requests without a long
shared prefix are their own group. Results are read back in input order whatever the order;
docs/BENCHMARKS.md measures the orders against each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ORDERS = ("input", "leaders-first", "grouped")


def enqueue_order(order: str, parts: Sequence[tuple[dict[str, Any] | None, Any]]) -> list[int]:
    """A permutation of ``range(len(parts))`` for ``order``; ``parts`` are the requests'
    (prefix object, own part) pairs (`entries.split_prefix`)."""
    from prefixq.producer.encoding import _fingerprint

    n = len(parts)
    if order == "input":
        return list(range(n))
    groups: dict[Any, list[int]] = {}
    fp_by_id: dict[int, Any] = {}
    for i, (prefix, _) in enumerate(parts):
        if prefix is None:
            groups[("own", i)] = [i]
            continue
        ((_, value),) = prefix.items()
        fp = fp_by_id.get(id(value))
        if fp is None:
            fp = fp_by_id[id(value)] = _fingerprint(value)
        groups.setdefault(fp, []).append(i)
    members = sorted(groups.values(), key=lambda g: g[0])
    if order == "leaders-first":
        return [g[0] for g in members] + sorted(i for g in members for i in g[1:])
    if order == "grouped":
        return [i for g in members for i in g]
    raise ValueError(f"unknown order {order!r}")
