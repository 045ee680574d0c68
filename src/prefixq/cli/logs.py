"""Log output for the ``prefixq`` command: ``--log-format text`` (default) or ``json``.

Modules only create loggers (``log = logging.getLogger(__name__)``) and call them with lazy
%-formatting; `configure` is called once, by the CLI. ``json`` writes one object per line:
``ts`` (ISO 8601, UTC, milliseconds), ``level``, ``logger``, ``msg``, then ``exc_info`` /
``stack_info`` when present and any ``extra={...}`` fields.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import IO, Any

from prefixq.core.errors import ConfigError

FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: libraries whose INFO and DEBUG lines are kept out at any level: httpx logs every request with
#: its whole URL (a webhook URL's user, password and query token; prefixq's own lines show it
#: without them: ops/webhook_delivery.py)
QUIET = ("httpx", "httpcore")

#: attributes every LogRecord has; anything else on a record came from ``extra=``
_STANDARD = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys() | {"message", "asctime"}
)


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc_info"] = record.exc_text
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in out:
                out[key] = value
        return json.dumps(out, ensure_ascii=False, default=str)


def configure(level: str, fmt: str = "text", stream: IO[str] | None = None) -> None:
    """Install one stderr (or ``stream``) handler on the root logger; replaces earlier ones."""
    if fmt not in FORMATS:
        raise ConfigError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.WARNING)
