"""A burst's results as a download: the JSON lines recorded so far, in input order, in prefixq's
format or as OpenAI batch output lines (prefixq.openai.formats), read 512 at a time so that a
burst of 100,000 results is streamed, never held whole. Unlike ``prefixq results``, nothing waits:
a running burst's missing results are left out (the page says so next to the link).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import redis

from prefixq.client import results
from prefixq.core import wire
from prefixq.core.errors import BurstRecordLost, ConfigError
from prefixq.core.records import Result
from prefixq.core.settings import Settings
from prefixq.openai.formats import CHAT, format_result
from prefixq.openai.outputs import FORMATS, burst_metadata

__all__ = ["result_lines"]

_CHUNK = 512


def result_lines(r: redis.Redis, settings: Settings, burst: str, fmt: str) -> Iterator[bytes]:
    """The lines (UTF-8, newline-terminated, 512 results a piece) of the burst's recorded
    results; BurstNotFound for an unknown burst and ConfigError for an unknown format, both
    before the first line."""
    if fmt not in FORMATS:
        raise ConfigError(f"format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    st = results.status(burst, settings, client=r)
    meta = burst_metadata(st)
    endpoint, model = meta.get("endpoint", CHAT), meta.get("model", "")
    limits = wire.Limits.from_settings(settings)
    key = settings.keys.results(burst)
    kind = r.type(key)
    if kind not in (b"hash", b"none", "hash", "none"):  # checked before the first line is sent
        raise BurstRecordLost(f"burst {burst}: its results key holds a {kind!r}, not a hash")

    def line(res: Result) -> str:
        if fmt == "openai":
            return format_result(res, burst=burst, endpoint=endpoint, model=model).dumps()
        return json.dumps(res.to_json(), ensure_ascii=False) + "\n"

    def chunks() -> Iterator[bytes]:  # one piece per 512 results: one thread-pool hop each
        for start in range(0, st.total, _CHUNK):
            indexes = list(range(start, min(st.total, start + _CHUNK)))
            got = [
                line(results.read_stored(raw, i, "", limits))
                for i, raw in zip(indexes, r.hmget(key, indexes), strict=True)
                if raw is not None
            ]
            if got:
                yield "".join(got).encode()

    return chunks()
