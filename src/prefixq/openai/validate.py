"""Check a batch input file line by line, as OpenAI does while a batch is ``validating``.

Each problem is a batch error ``{"code", "message", "param", "line"}`` (1-based line numbers):
``invalid_json_line``, ``missing_required_parameter``, ``invalid_request`` (wrong types, a method
other than POST, a body prefixq refuses: the message says why, ``param`` names the body field when
the refusal does), ``url_mismatch`` (the line's url is not the batch's endpoint),
``model_mismatch`` (one batch, one model), ``duplicate_custom_id``, ``empty_file``. Any error
fails the whole batch; at most `MAX_ERRORS` are listed. On ``/v1/responses`` a body prefixq
refuses is the line's own 400 result instead, as OpenAI answers such a line: a `Request.refused`
that runs nothing. The file is read line by line, never whole; blank lines are skipped. The valid
requests are not kept: a `prefixq.client.request_file.RequestFile` keeps where each line is (and
its id and prefix fingerprint), and the producer reads each again when it enqueues it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from prefixq.client.request_file import RequestFile, line_limit
from prefixq.core.entry_size import check_size
from prefixq.core.errors import ValidationError
from prefixq.core.inputs import BLANK, read_json_line
from prefixq.core.openai_lines import RESPONSES
from prefixq.core.records import Request
from prefixq.core.settings import Settings

__all__ = ["MAX_ERRORS", "Checked", "check_input"]

MAX_ERRORS = 100
_WHERE = re.compile(r"^line \d+: ")
#: the body field a refusal names ("body.top_logprobs needs ...", "n=0 must be ..."), for the
#: error's param
_FIELD = re.compile(r"\bbody\.([a-z_]+)|^([a-z_]+)=")


@dataclass(slots=True)
class Checked:
    """The valid requests in file order (read again from the file on access), the batch's model
    (None if no line names one), and the errors found (empty when the batch may run)."""

    requests: Sequence[Request] = field(default_factory=list)
    model: str | None = None
    errors: list[dict[str, Any]] = field(default_factory=list)
    error_count: int = 0

    def add(self, line: int, code: str, message: str, param: str | None = None) -> None:
        self.error_count += 1
        if len(self.errors) < MAX_ERRORS:
            self.errors.append({"code": code, "message": message, "param": param, "line": line})


_REQUIRED = (("custom_id", str, "a string"), ("method", str, "a string"), ("url", str, "a string"))


def _check_line(
    obj: Any, n: int, endpoint: str, settings: Settings, seen: set[str], out: Checked
) -> Request | None:
    if not isinstance(obj, dict):
        out.add(n, "invalid_request", "Each line must be a JSON object.")
        return None
    bad = False
    for name, kind, what in (*_REQUIRED, ("body", dict, "an object")):
        if name not in obj:
            out.add(n, "missing_required_parameter", f"Missing required parameter: '{name}'.", name)
            bad = True
        elif not isinstance(obj[name], kind):
            out.add(n, "invalid_request", f"'{name}' must be {what}.", name)
            bad = True
    if bad:
        return None
    if obj["method"] != "POST":
        out.add(n, "invalid_request", "The method must be 'POST'.", "method")
        return None
    if obj["url"] != endpoint:
        out.add(
            n,
            "url_mismatch",
            f"The url {obj['url']!r} does not match the batch's endpoint {endpoint!r}.",
            "url",
        )
        return None
    body = obj["body"]
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            out.add(n, "invalid_request", "'model' must be a string.", "body.model")
            return None
        if out.model is None:
            out.model = model
        elif model != out.model:
            out.add(
                n,
                "model_mismatch",
                f"The model {model!r} differs from {out.model!r}: a batch uses one model.",
                "body.model",
            )
            return None
    cid = obj["custom_id"]
    if not cid:
        out.add(n, "invalid_request", "'custom_id' must not be empty.", "custom_id")
        return None
    if cid in seen:
        out.add(
            n,
            "duplicate_custom_id",
            f"The custom_id {cid!r} is a duplicate of another request's; custom_id values must "
            "be unique within a batch.",
            "custom_id",
        )
        return None
    seen.add(cid)
    try:
        req = Request.from_json(
            obj,
            index=n - 1,
            max_chars=settings.max_prompt_chars,
            max_messages=settings.max_messages,
        )
        check_size(req, settings, f"line {n}")  # what the producer would refuse
        return req
    except ValidationError as e:
        message = _WHERE.sub("", str(e))
        if endpoint == RESPONSES:  # the line's own refusal, never the batch's failure
            return Request.refused(cid, message, endpoint=endpoint, model=model)
        field = _FIELD.search(message)
        param = f"body.{field.group(1) or field.group(2)}" if field else "body"
        out.add(n, "invalid_request", message, param)
        return None


def _skip_line(f: IO[bytes]) -> int:
    """Read past the rest of a line, a chunk at a time; the bytes skipped."""
    n = 0
    while True:
        chunk = f.readline(1 << 20)
        n += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return n


def check_input(path: Path, endpoint: str, settings: Settings) -> Checked:
    """Read and check the input file at ``path`` for a batch on ``endpoint``."""
    out = Checked()
    index = RequestFile(path, settings)
    index.open()  # the file deleted meanwhile (DELETE /v1/files) stays readable through it
    seen: set[str] = set()
    offset = 0
    limit = line_limit(settings)
    with open(path, "rb") as f:
        for n, raw in enumerate(iter(lambda: f.readline(limit + 1), b""), start=1):
            at, offset = offset, offset + len(raw)
            if len(raw) > limit:  # not read whole: no request this deployment takes is that long
                offset += 0 if raw.endswith(b"\n") else _skip_line(f)
                out.add(
                    n,
                    "line_too_long",
                    f"This line is longer than {limit:,} bytes, more than any request can take.",
                )
                continue
            # a BOM on line 1 is skipped; bytes that are not UTF-8, text that is not JSON, JSON
            # nested too deep or an integer too long to read are the line's error, not the batch's
            try:
                obj = read_json_line(raw, n)
            except ValidationError:
                out.add(n, "invalid_json_line", "This line is not parseable as valid JSON.")
                continue
            if obj is BLANK:  # a blank line (a ``null`` one is not: not an object)
                continue
            req = _check_line(obj, n, endpoint, settings, seen, out)
            if req is not None and not out.error_count:
                index.add(at, len(raw), n, req)
    if not out.error_count and not index:
        out.add(
            0,
            "empty_file",
            "The batch input file is empty: it needs at least one request.",
            "input_file_id",
        )
        out.errors[-1]["line"] = None
    if out.error_count:
        index.clear()
        index.close()
    out.requests = index
    return out
