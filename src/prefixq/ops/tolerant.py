"""Reads of the views (`prefixq inspect`, the dashboard) that one key of another type does not
fail as a whole: anything with write access may write a string where prefixq keeps a hash or a
stream; the view shows the rest and names what it could not read (its ``problems``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from redis.exceptions import ResponseError

__all__ = ["tolerant"]

T = TypeVar("T")


def tolerant(problems: list[str], what: str, default: T, read: Callable[..., T], *args: Any) -> T:
    """``read(*args)``, or ``default`` when Redis answers WRONGTYPE (noted in ``problems`` as
    ``what``); any other error is raised."""
    try:
        return read(*args)
    except ResponseError as e:
        text = str(e)
        if "WRONGTYPE" not in text:
            raise
        problems.append(f"{what} not shown: a key holds another type ({text[:200]})")
        return default
