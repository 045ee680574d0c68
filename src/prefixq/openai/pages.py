"""Cursor pagination over a sorted set of object ids (scored by creation time), as OpenAI's list
endpoints page: ``after`` (the last id of the previous page), ``limit``, ``has_more``,
``first_id``, ``last_id``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aredis

from prefixq.openai.apierror import bad_request

__all__ = ["Page", "page", "parse_limit"]

_CHUNK = 1000
Fetch = Callable[[list[str]], Awaitable[list[dict[str, Any]]]]


@dataclass(slots=True)
class Page:
    data: list[dict[str, Any]]
    has_more: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": self.data,
            "first_id": self.data[0]["id"] if self.data else None,
            "last_id": self.data[-1]["id"] if self.data else None,
            "has_more": self.has_more,
        }


def parse_limit(raw: str | None, *, default: int, most: int) -> int:
    """The ``limit`` query parameter: an integer in 1..``most``; 400 otherwise."""
    if raw is None:
        return default
    # ASCII digits only: int() also takes " 5", "+5", "1_0" and other scripts' digits
    n = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 9 else 0
    if not 1 <= n <= most:
        raise bad_request(
            f"Invalid 'limit': {_short(raw)}; expected an integer between 1 and {most}.",
            param="limit",
            code="invalid_value",
        )
    return n


def _short(raw: str, most: int = 80) -> str:
    """``raw`` quoted for an error message, cut to ``most`` characters (a parameter is the
    caller's, of any length: the message echoes no megabyte)."""
    return repr(raw) if len(raw) <= most else f"{raw[:most]!r}... ({len(raw)} characters)"


async def page(
    r: aredis.Redis,
    zkey: str,
    fetch: Fetch,
    *,
    after: str | None,
    limit: int,
    order: str = "desc",
    keep: Callable[[dict[str, Any]], bool] | None = None,
    gone: Callable[[str], str] | None = None,
) -> Page:
    """Up to ``limit`` objects after the id ``after`` (newest first for ``order="desc"``), and
    whether more follow. ``fetch`` turns ids into objects (dropping vanished ones); ``keep``
    filters them. An ``after`` no longer in the set pages on from where it was when ``gone``
    names the key that kept its score (a client deleting each object of the page it listed asks
    for the next page after one it deleted); one never seen is a 400."""
    if order not in ("asc", "desc"):
        raise bad_request(
            f"Invalid 'order': {_short(order)}; expected 'asc' or 'desc'.", param="order"
        )
    desc = order == "desc"
    start = 0
    if after:
        start = await _start(r, zkey, after, desc, gone)
    out: list[dict[str, Any]] = []
    chunk = min(_CHUNK, limit + 1)
    while True:
        end = start + chunk - 1
        raw = await (r.zrevrange(zkey, start, end) if desc else r.zrange(zkey, start, end))
        if not raw:
            return Page(out, False)
        for obj in await fetch([i.decode() for i in raw]):
            if keep is not None and not keep(obj):
                continue
            if len(out) == limit:
                return Page(out, True)
            out.append(obj)
        start += len(raw)
        chunk = _CHUNK


async def _start(
    r: aredis.Redis, zkey: str, after: str, desc: bool, gone: Callable[[str], str] | None
) -> int:
    """The rank of the first id after ``after``: its own rank + 1, or for an id removed from the
    set, where it would be (ids of one score in the set's order: by their bytes)."""
    rank = await (r.zrevrank(zkey, after) if desc else r.zrank(zkey, after))
    if rank is not None:
        return int(rank) + 1
    raw = await r.get(gone(after)) if gone is not None else None
    try:
        score = int(raw) if raw is not None else None
    except ValueError:
        score = None
    if score is None:
        raise bad_request(f"Invalid 'after': no object with id {_short(after)}.", param="after")
    me = after.encode()
    ties: list[bytes] = await r.zrangebyscore(zkey, score, score)
    if desc:
        before = int(await r.zcount(zkey, f"({score}", "+inf"))
        return before + sum(m > me for m in ties)
    before = int(await r.zcount(zkey, "-inf", f"({score}"))
    return before + sum(m < me for m in ties)
