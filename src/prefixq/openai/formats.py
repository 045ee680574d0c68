"""prefixq results as OpenAI Batch output lines (`format_result`): the server's output and error
files, and ``prefixq results --format openai``.

One line per request, in input order: a ``chat.completion``, ``text_completion`` or ``response``
(openai/responses.py) body with status 200, an HTTP-style error response (400 or 500) for a
request that failed inside the engine or was refused, and ``response: null`` with
``batch_expired`` or ``batch_cancelled`` for one that never ran. Ids are derived from the burst id
and the input index, so writing a burst's lines twice gives the same bytes. This module imports no
web framework: the CLI uses it without the ``serve`` extra. docs/openai.md, "Output and error
files", has the shapes and the error table.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from prefixq.core.openai_lines import CHAT, COMPLETIONS, ENDPOINTS, RESPONSES
from prefixq.core.records import Choice, Result, TokenLogprob
from prefixq.openai.embeddings import EMBEDDINGS, embeddings_object
from prefixq.openai.responses import response_body

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "ENDPOINTS",
    "RESPONSES",
    "Line",
    "Usage",
    "error_code",
    "format_result",
]


#: the messages OpenAI writes for requests that never ran
EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
CANCELLED_MESSAGE = "This request was not executed because the batch was cancelled."
#: finish reasons an OpenAI choice may carry; anything else from the engine is reported as "stop"
_FINISH = frozenset({"stop", "length", "tool_calls", "content_filter", "function_call"})
#: the body field a refusal names ("body.tools=... is refused"), for the error's ``param``
_FIELD = re.compile(r"\bbody\.([a-z_]+)")
#: prefixq error code -> (HTTP status, OpenAI error type, OpenAI error code)
_HTTP_ERRORS: dict[str, tuple[int, str, str | None]] = {
    "invalid_request": (400, "invalid_request_error", None),
    "engine_error": (500, "server_error", "engine_error"),
    "dead_lettered": (500, "server_error", "dead_lettered"),
    "internal_error": (500, "server_error", None),
}


def _uid(prefix: str, burst: str, index: int) -> str:
    """A stable id for (burst, index): the same line always gets the same ids."""
    h = hashlib.blake2b(f"{prefix}\0{burst}\0{index}".encode(), digest_size=12).hexdigest()
    return prefix + h


def error_code(res: Result) -> str | None:
    """The result's error code (None on success): one of
    `prefixq.core.result_record.ERROR_CODES`."""
    if res.error is None:
        return None
    if res.error_code:
        return res.error_code
    # results recorded before Result.error_code existed carry only the message
    return "dead_lettered" if res.error.startswith("dead-lettered") else "engine_error"


@dataclass(slots=True)
class Usage:
    """Token totals over the lines formatted so far (the batch object's ``usage``)."""

    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0

    def add(self, res: Result) -> None:
        self.input_tokens += res.prompt_tokens
        self.cached_tokens += res.cached_tokens
        self.output_tokens += res.output_tokens

    def to_json(self) -> dict[str, Any]:
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.input_tokens + self.output_tokens,
        }


@dataclass(slots=True)
class Line:
    """One formatted line: ``ok`` lines go to the output file, the others to the error file;
    ``kind`` is ``completed``, ``failed``, ``expired`` or ``cancelled``."""

    obj: dict[str, Any]
    kind: str

    @property
    def ok(self) -> bool:
        return self.kind == "completed"

    def dumps(self) -> str:
        """The JSONL line (with its newline), compact and UTF-8 as OpenAI writes it."""
        return json.dumps(self.obj, ensure_ascii=False, separators=(", ", ": ")) + "\n"


def format_result(res: Result, *, burst: str, endpoint: str = CHAT, model: str = "") -> Line:
    """The OpenAI batch output line of one result. ``endpoint`` and ``model`` are the batch's;
    a result that carries its own (``Result.endpoint``, ``Result.model``) wins."""
    endpoint = res.endpoint or endpoint
    model = res.model or model
    line: dict[str, Any] = {
        "id": _uid("batch_req_", burst, res.index),
        "custom_id": res.id or None,  # null: its id was never recorded
        "response": None,
        "error": None,
    }
    code = error_code(res)
    if code in ("expired", "cancelled"):
        message = EXPIRED_MESSAGE if code == "expired" else CANCELLED_MESSAGE
        line["error"] = {"code": f"batch_{code}", "message": message}
        return Line(line, code)
    request_id = _uid("req_", burst, res.index)
    if code is not None:
        status, kind, oai_code = _HTTP_ERRORS.get(code, _HTTP_ERRORS["internal_error"])
        field = _FIELD.search(res.error or "") if code == "invalid_request" else None
        param = field.group(1) if field else None
        error = {"message": res.error, "type": kind, "param": param, "code": oai_code}
        line["response"] = {
            "status_code": status,
            "request_id": request_id,
            "body": {"error": error},
        }
        return Line(line, "failed")
    line["response"] = {
        "status_code": 200,
        "request_id": request_id,
        "body": _body(res, burst=burst, endpoint=endpoint, model=model),
    }
    return Line(line, "completed")


def _body(res: Result, *, burst: str, endpoint: str, model: str) -> dict[str, Any]:
    """A ``chat.completion``, ``text_completion`` or ``response`` object, as OpenAI's endpoint
    returns it (an embeddings list: openai/embeddings.py)."""
    if endpoint == RESPONSES:
        return response_body(res, burst=burst, model=model)
    if endpoint == EMBEDDINGS:
        return embeddings_object(res, model)
    chat = endpoint == CHAT
    choices = [_choice(c, chat) for c in _choices(res)]
    usage = {
        "prompt_tokens": res.prompt_tokens,
        "completion_tokens": res.output_tokens,
        "total_tokens": res.prompt_tokens + res.output_tokens,
        "prompt_tokens_details": {"cached_tokens": res.cached_tokens},
    }
    return {
        "id": _uid("chatcmpl-" if chat else "cmpl-", burst, res.index),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(res.timings.finished or res.timings.enqueued),
        "model": model,
        "choices": choices,
        "usage": usage,
        "system_fingerprint": None,
    }


def _choices(res: Result) -> list[Choice]:
    """Every choice of the result (choice 0 alone unless ``n`` > 1 or logprobs were asked)."""
    if res.choices:
        return res.choices
    return [Choice(0, res.text, res.token_ids, res.finish_reason)]


def _choice(c: Choice, chat: bool) -> dict[str, Any]:
    logprobs = None if c.logprobs is None else _logprobs(c.logprobs, chat)
    out: dict[str, Any]
    if chat:  # the key order of OpenAI's own objects
        message = {"role": "assistant", "content": c.text, "refusal": None}
        out = {"index": c.index, "message": message, "logprobs": logprobs}
    else:
        out = {"text": c.text, "index": c.index, "logprobs": logprobs}
    out["finish_reason"] = c.finish_reason if c.finish_reason in _FINISH else "stop"
    return out


def _text(token_id: int, token: str | None) -> str:
    """A token's text; ``token_id:N`` when the engine had no tokenizer to decode it (as vLLM's
    OpenAI server writes it)."""
    return f"token_id:{token_id}" if token is None else token


def _logprobs(tokens: list[TokenLogprob], chat: bool) -> dict[str, Any]:
    """Per-token logprobs in OpenAI's chat (``content``) or completions (``tokens``,
    ``token_logprobs``, ``top_logprobs``, ``text_offset``) shape."""
    if chat:
        content = []
        for t in tokens:
            tok = _text(t.token_id, t.token)
            top = [
                {"token": _text(i, x), "logprob": lp, "bytes": list(_text(i, x).encode())}
                for i, x, lp in t.top
            ]
            content.append(
                {
                    "token": tok,
                    "logprob": t.logprob,
                    "bytes": list(tok.encode()),
                    "top_logprobs": top,
                }
            )
        return {"content": content, "refusal": None}
    texts = [_text(t.token_id, t.token) for t in tokens]
    offsets, pos = [], 0
    for tok in texts:
        offsets.append(pos)
        pos += len(tok)
    return {
        "tokens": texts,
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{_text(i, x): lp for i, x, lp in t.top} for t in tokens],
        "text_offset": offsets,
    }
