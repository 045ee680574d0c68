"""Files that expire: ``expires_after`` on an upload, ``output_expires_after`` on a batch (its
output and error files), both ``{"anchor": "created_at", "seconds": 3600..2592000}`` as OpenAI
takes them, and shown as the File object's ``expires_at``.

An expiring file's object holds ``expires_at`` and is listed in `Keys.oai_expiring` by that
time. It is honoured twice: every access checks it (`FileStore.get`: an expired file is removed
there and answers 404, so expiry is exact to the second), and each server's sweeper removes what
has expired (`FileStore.sweep_expired`), so the bytes and keys of a file nobody asks for are gone
too. The clock is `Clock`: the real one, plus the seconds in the ``clock_shift_file`` setting's
file, which only tests set (the expiry logic they run is this one, with time moved).
docs/openai.md, "Expiry".
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

from prefixq.core.settings import Settings
from prefixq.openai.apierror import bad_request

__all__ = ["MAX_S", "MIN_S", "PER_SWEEP", "Clock", "expires_after", "form_expires_after"]

#: OpenAI's bounds on ``seconds``: one hour to thirty days
MIN_S = 3600
MAX_S = 30 * 86400
#: expired files one sweep removes per namespace (the rest go on the next pass)
PER_SWEEP = 1000


class Clock:
    """Epoch seconds as expiry sees them: ``time.time()`` plus, in tests only, the number in
    the ``clock_shift_file`` setting's file (missing or empty: no shift)."""

    def __init__(self, settings: Settings) -> None:
        self.shift_file = Path(settings.clock_shift_file) if settings.clock_shift_file else None

    def now(self) -> float:
        if self.shift_file is None:
            return time.time()
        try:
            text = self.shift_file.read_text().strip()
        except FileNotFoundError:
            text = ""
        return time.time() + (float(text) if text else 0.0)


def expires_after(value: Any, param: str) -> int | None:
    """Seconds of an ``expires_after`` object (None when absent); a 400 naming ``param``
    otherwise."""
    if value is None:
        return None
    seconds = value.get("seconds") if isinstance(value, dict) else None
    ok = (
        isinstance(value, dict)
        and set(value) == {"anchor", "seconds"}
        and value["anchor"] == "created_at"
        and isinstance(seconds, int)
        and not isinstance(seconds, bool)
        and MIN_S <= seconds <= MAX_S
    )
    if not ok:
        raise bad_request(
            f"Invalid '{param}': expected {{'anchor': 'created_at', 'seconds': N}} with N "
            f"between {MIN_S} and {MAX_S}.",
            param=param,
            code="invalid_value",
        )
    assert isinstance(seconds, int)
    return seconds


def form_expires_after(fields: dict[str, str]) -> int | None:
    """``expires_after`` of a multipart upload: ``expires_after[anchor]`` and
    ``expires_after[seconds]``, as the openai client sends it, or one field ``expires_after``
    holding the JSON object (as ``curl -F`` sends it); None when none of them is there, a 400
    for both forms at once or another ``expires_after[...]`` field (never a file that silently
    does not expire)."""
    names = sorted(k for k in fields if k == "expires_after" or k.startswith("expires_after["))
    if not names:
        return None
    if names == ["expires_after"]:
        raw: Any = fields["expires_after"]
        with contextlib.suppress(ValueError, RecursionError):  # not JSON: a 400 below
            raw = json.loads(raw)
        return expires_after(raw, "expires_after")
    if not set(names) <= {"expires_after[anchor]", "expires_after[seconds]"}:
        raise bad_request(
            "Invalid 'expires_after': expected the fields expires_after[anchor] and "
            "expires_after[seconds], or one field expires_after holding its JSON object; "
            f"got {', '.join(names)}.",
            param="expires_after",
            code="invalid_value",
        )
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    value: dict[str, Any] = {"anchor": anchor, "seconds": seconds}
    if seconds is not None and seconds.isascii() and seconds.isdigit():
        value["seconds"] = int(seconds)
    return expires_after(value, "expires_after")
