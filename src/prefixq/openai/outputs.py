"""A burst's results as a JSONL file in either format, for ``prefixq results`` and
``prefixq submit --wait --out``: prefixq's result lines, or OpenAI batch output lines
(formats.py) — all of a burst's lines in one file, in input order, where the server splits them
into an output and an error file.

The default is the burst's input format, recorded on the burst record by whoever submitted it
(`input_metadata`: ``input_format``, ``endpoint`` and ``model`` in the burst's ``metadata``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

from prefixq.client import results
from prefixq.core.errors import ConfigError
from prefixq.core.records import Result
from prefixq.core.settings import Settings
from prefixq.openai.formats import CHAT, format_result

__all__ = ["burst_metadata", "input_metadata", "write_results"]

FORMATS = ("prefixq", "openai")


def input_metadata(path: str) -> dict[str, str] | None:
    """Burst metadata saying a request file holds OpenAI batch lines (from its first line), or
    None for plain lines and for stdin (``-``), which cannot be read twice."""
    if path == "-":
        return None
    with open(path, encoding="utf-8-sig") as f:  # a byte order mark is not part of line 1
        for line in f:
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    return None  # read_requests says what is wrong with it
                break
        else:
            return None
    if not isinstance(obj, dict) or not ("custom_id" in obj or "body" in obj):
        return None
    meta = {"input_format": "openai", "endpoint": str(obj.get("url") or CHAT)}
    body = obj.get("body")
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        meta["model"] = body["model"]
    return meta


def burst_metadata(st: results.BurstStatus) -> dict[str, str]:
    """The ``metadata`` a burst was submitted with ({} when none)."""
    try:
        meta: Any = json.loads(st.meta.get("metadata") or "{}")
    except json.JSONDecodeError:
        return {}
    return {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}


def write_results(
    burst: str,
    out: str | Path | IO[str],
    settings: Settings,
    *,
    fmt: str | None = None,
    timeout: float | None = None,
    token_ids: bool = False,
) -> int:
    """Write the burst's results in input order (waiting for them) as ``fmt`` lines; ``None``
    picks the burst's input format. Returns the number of lines."""
    meta = burst_metadata(results.status(burst, settings))
    if fmt is None:
        fmt = "openai" if meta.get("input_format") == "openai" else "prefixq"
    if fmt not in FORMATS:
        raise ConfigError(f"format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if fmt == "prefixq":
        return results.write_jsonl(burst, out, settings, timeout=timeout, token_ids=token_ids)
    if token_ids:
        raise ConfigError("--token-ids goes with the prefixq format, not openai")
    endpoint, model = meta.get("endpoint", CHAT), meta.get("model", "")

    def line(res: Result) -> str:
        return format_result(res, burst=burst, endpoint=endpoint, model=model).dumps()

    return results.write_lines(burst, out, line, settings, timeout=timeout)
