"""The records that travel: `Request` (input, here) and `Result` (output,
`prefixq.core.result_record`), validated and mapped to the short-keyed dicts that `wire` packs;
both, and the parts of a result (`Choice`, `TokenLogprob`), are imported from here.

A request line is either plain (``{"id", "prompt" | "messages" | "prompt_token_ids", "prefix"?,
sampling fields...}``, or ``{"id", "input", "dimensions"?, "encoding_format"?}`` to embed:
`prefixq.core.embeddings`) or an OpenAI batch-file line (``{"custom_id", "method", "url",
"body"}``), whose ``custom_id`` becomes the id and whose ``body`` holds the prompt or messages
and sampling.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prefixq.core import openai_lines
from prefixq.core.checks import check_nested, check_text, too_long
from prefixq.core.choices import MIN_LOGPROB, Choice, TokenLogprob
from prefixq.core.embeddings import EMBEDDINGS, check_inputs, check_pooling, normalize_input
from prefixq.core.errors import ValidationError
from prefixq.core.result_record import Result, Timings
from prefixq.core.sampling import (
    DEFAULT_MAX_TOKENS,
    SAMPLING_FIELDS,
    check_sampling,
    normalize_sampling,
)
from prefixq.core.wire import MAX_ARRAY_LEN

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "MIN_LOGPROB",
    "SAMPLING_FIELDS",
    "Choice",
    "Request",
    "Result",
    "Timings",
    "TokenLogprob",
    "id_text",
]

#: defaults of `Request.validate` (the settings' max_prompt_chars and max_messages)
DEFAULT_MAX_CHARS = 4_000_000
DEFAULT_MAX_MESSAGES = 1024
_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


def id_text(rid: Any, where: str) -> str:
    """A request's id as text: a string, or an integer in decimal (one of more than 512 digits is
    refused as too long before it is written out: CPython refuses past 4,300)."""
    if not isinstance(rid, str | int) or isinstance(rid, bool):
        raise ValidationError(f"{where}: id must be a string or integer")
    if isinstance(rid, int) and rid.bit_length() > _ID_BITS:
        raise ValidationError(f"{where}: id longer than 512 characters")
    return str(rid)


#: an integer id of more bits has more than 512 digits
_ID_BITS = 1710


@dataclass(slots=True)
class Request:
    """One prompt to run. Exactly one of ``prompt``, ``messages``, ``prompt_token_ids``,
    ``inputs`` is set; ``inputs`` makes it an embeddings request (one vector per input, options
    in ``pooling``: `prefixq.core.embeddings`), which takes no prefix and no sampling.

    ``prefix`` is shared leading text (a document) placed before ``prompt``; for chats the shared
    leading messages play that role (everything but the last message). ``endpoint`` is the url
    of the OpenAI batch line it came from (`body.ENDPOINTS`; None for a plain line) and ``model``
    that line's ``body.model``: the output objects need them, the answer does not; ``echo`` is
    what a /v1/responses line's Response object repeats of its body (core/responses_lines.py).
    ``refusal`` marks a request refused per line (the server's /v1/responses validation): it
    carries only its id and this message, runs nothing, and its result is that refusal
    (``invalid_request``), recorded as every other result is.
    """

    id: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    prefix: str | list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    endpoint: str | None = None
    model: str | None = None
    echo: dict[str, Any] | None = None
    refusal: str | None = None
    inputs: list[str] | list[list[int]] | None = None
    pooling: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def refused(
        cls, rid: str, message: str, *, endpoint: str | None = None, model: str | None = None
    ) -> Request:
        """A request refused per line: its result will be ``message`` (``invalid_request``)."""
        return cls(id=rid, prompt="", endpoint=endpoint, model=model, refusal=message)

    @property
    def task(self) -> str:
        """What a worker must serve to run it (`prefixq.core.embeddings.TASKS`)."""
        return "generate" if self.inputs is None else "embed"

    @classmethod
    def from_json(
        cls,
        obj: Any,
        *,
        index: int = 0,
        max_chars: int = DEFAULT_MAX_CHARS,
        max_messages: int = DEFAULT_MAX_MESSAGES,
        where: str | None = None,
    ) -> Request:
        """Build from a plain or OpenAI batch line and validate it against the given limits
        (the settings' ``max_prompt_chars`` / ``max_messages``); ValidationError names it as
        ``where`` (default: its line, ``index`` + 1)."""
        where = where or f"line {index + 1}"
        limits = {"max_chars": max_chars, "max_messages": max_messages}
        if not isinstance(obj, Mapping):
            raise ValidationError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        if openai_lines.is_openai_line(obj):
            rid, body, url, model = openai_lines.split_openai_line(obj, where)
            echo = body.pop("echo", None)  # only a /v1/responses body has one
            req = cls._from_body(rid, body, where)
            req.endpoint, req.model, req.echo = url, model, echo
        else:
            body = dict(obj)
            rid = body.pop("id", None)
            req = cls._from_body(str(index) if rid is None else rid, body, where)
        req.validate(where=where, **limits)
        return req

    @classmethod
    def _from_body(cls, rid: Any, body: dict[str, Any], where: str) -> Request:
        req = cls(
            id=id_text(rid, where),
            prompt=body.pop("prompt", None),
            messages=_own_list(body.pop("messages", None)),
            prompt_token_ids=body.pop("prompt_token_ids", None),
            prefix=body.pop("prefix", None),
        )
        if "input" in body:
            req.inputs = normalize_input(body.pop("input"), where + ": ")
            options = {k: body.pop(k) for k in ("dimensions", "encoding_format") if k in body}
            req.pooling = {k: v for k, v in options.items() if v is not None}
        sampling = body.pop("sampling", None)
        if sampling is None:
            sampling = {}
        if not isinstance(sampling, dict):  # [], 0, "" and false too: never taken as none
            raise ValidationError(f"{where}: 'sampling' must be an object")
        top = {k: body.pop(k) for k in list(body) if k in SAMPLING_FIELDS}
        both = sorted(k for k in top if k in sampling and sampling[k] != top[k])
        if both:  # which one was meant? nothing that changes the answer is chosen silently
            raise ValidationError(
                f"{where}: {', '.join(both)} given both at the top level and in 'sampling', "
                "with different values"
            )
        sampling = {**sampling, **top}
        if body:
            raise ValidationError(f"{where}: unknown fields: {', '.join(sorted(body))}")
        req.sampling = normalize_sampling(sampling)
        return req

    def validate(
        self,
        *,
        max_chars: int = DEFAULT_MAX_CHARS,
        max_messages: int = DEFAULT_MAX_MESSAGES,
        where: str = "",
    ) -> None:
        """Check shape, sizes and sampling values; raise ValidationError saying what is wrong."""
        w = f"{where or 'request ' + repr(self.id)}: "
        if self.refusal is not None:
            self._check_refused(w)
            return
        kinds = ("prompt", "messages", "prompt_token_ids", "inputs")
        given = [n for n in kinds if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValidationError(
                w + "needs exactly one of prompt, messages, prompt_token_ids, input"
            )
        if not isinstance(self.id, str):
            raise ValidationError(w + "id must be a string")
        if len(self.id) > 512:
            raise ValidationError(w + "id longer than 512 characters")
        for name in ("endpoint", "model"):
            if not isinstance(getattr(self, name), str | None):
                raise ValidationError(w + f"{name} must be a string")
        if self.endpoint is not None and self.endpoint not in openai_lines.ENDPOINTS:
            raise ValidationError(w + f"unsupported endpoint {self.endpoint!r}")
        chat = self.endpoint in openai_lines.MESSAGE_ENDPOINTS
        if chat != (self.messages is not None) and self.endpoint:
            raise ValidationError(w + f"{self.endpoint} does not go with this kind of prompt")
        if (self.endpoint == EMBEDDINGS) != (self.inputs is not None) and self.endpoint:
            raise ValidationError(w + f"{self.endpoint} does not go with this kind of input")
        if self.inputs is not None:
            self._check_embed(w)
        elif self.pooling:
            raise ValidationError(w + "dimensions and encoding_format go with input (embeddings)")
        if self.prompt is not None and not isinstance(self.prompt, str):
            raise ValidationError(w + "prompt must be a string")
        if self.prefix is not None:
            if isinstance(self.prefix, str) and self.prompt is None:
                raise ValidationError(
                    w + "a text prefix goes with prompt (chats: leading messages)"
                )
            if isinstance(self.prefix, list) and self.prompt_token_ids is None:
                raise ValidationError(w + "a token-id prefix goes with prompt_token_ids")
            if not isinstance(self.prefix, str | list):
                raise ValidationError(w + "prefix must be a string or a list of token ids")
            if isinstance(self.prefix, list) and not _token_ids(self.prefix):
                raise ValidationError(w + "prefix token ids must be a non-empty list of ids")
        if self.prompt_token_ids is not None and not _token_ids(self.prompt_token_ids):
            raise ValidationError(w + "prompt_token_ids must be a non-empty list of token ids")
        if self.messages is not None:
            _check_messages(self.messages, max_messages, w)
        if self.chars() > max_chars:
            raise ValidationError(w + f"prompt is {self.chars()} characters, over {max_chars}")
        if self.prompt == "" and not self.prefix:
            raise ValidationError(w + "prompt is empty")
        if not isinstance(self.sampling, dict):
            raise ValidationError(w + "sampling must be a dict")
        check_sampling(self.sampling, w)
        self._check_lists(w)
        self._check_texts(w)

    def _check_embed(self, w: str) -> None:
        """An embeddings request: its inputs and options, and nothing of a generation's."""
        check_inputs(self.inputs, w)
        check_pooling(self.pooling, w)
        if self.prefix is not None:
            raise ValidationError(w + "an embeddings request takes no prefix")
        if self.sampling:
            raise ValidationError(
                w + f"an embeddings request takes no sampling fields: {', '.join(self.sampling)}"
            )

    def _check_lists(self, w: str) -> None:
        """No list a worker could not decode (over `wire.MAX_ARRAY_LEN` items): token ids, a
        token-id prefix, messages, an input's token ids (lists inside values: `check_nested`)."""
        lists = [("prompt_token_ids", self.prompt_token_ids), ("messages", self.messages)]
        lists.append(("prefix", self.prefix if isinstance(self.prefix, list) else None))
        for i, x in enumerate(self.inputs or ()):
            lists.append((f"input[{i}]", x if isinstance(x, list) else None))
        for name, value in lists:
            if value is not None and len(value) > MAX_ARRAY_LEN:
                raise ValidationError(
                    w + too_long(name, len(value), "items", MAX_ARRAY_LEN, "list")
                )

    def _check_texts(self, w: str) -> None:
        """Every string is valid Unicode and within the wire's string cap (core/checks.py), and
        every value inside a message, a sampling field or the echo is of a JSON type, nests
        boundedly and holds no list or map a worker could not decode."""
        check_text(self.id, "id", w)
        if isinstance(self.model, str):
            check_text(self.model, "model", w)
        if isinstance(self.prompt, str):
            check_text(self.prompt, "prompt", w)
        if isinstance(self.prefix, str):
            check_text(self.prefix, "prefix", w)
        for i, m in enumerate(self.messages or ()):
            check_nested(m, f"message {i}", w)
        for i, x in enumerate(self.inputs or ()):
            if isinstance(x, str):
                check_text(x, f"input[{i}]", w)
        for key, value in self.sampling.items():
            check_nested(value, key, w)
        if self.echo is not None:
            if not isinstance(self.echo, dict):
                raise ValidationError(w + "echo must be a dict")
            check_nested(self.echo, "echo", w)

    def _check_refused(self, w: str) -> None:
        """A refused request holds its id, endpoint, model and message, and nothing to run."""
        if not isinstance(self.refusal, str) or not isinstance(self.id, str) or not self.id:
            raise ValidationError(w + "a refused request needs an id and a message")
        if self.prompt != "" or self.messages or self.prompt_token_ids or self.prefix:
            raise ValidationError(w + "a refused request carries no prompt")
        check_text(self.id, "id", w)
        check_text(self.refusal, "refusal", w)

    def chars(self) -> int:
        """Characters of text in the request (prefix, prompt and message contents)."""
        n = len(self.prefix or ()) + len(self.prompt or "")
        n += sum(len(x) for x in self.inputs or ())
        if self.messages:
            n += sum(len(m.get("content") or "") for m in self.messages)
        return n + len(self.prompt_token_ids or ())


def _token_ids(ids: Any) -> bool:
    """A non-empty list of ints in [0, 2**31) (bools refused); C-speed passes, since prompts of
    thousands of ids are checked by every producer and again by the worker."""
    return (
        isinstance(ids, list)
        and bool(ids)
        and set(map(type, ids)) == {int}
        and min(ids) >= 0
        and max(ids) < 1 << 31
    )


def _own_list(x: Any) -> Any:
    """A list of the caller's as a list of the request's own (validation may replace items)."""
    return list(x) if isinstance(x, list) else x


def _check_messages(messages: Any, max_messages: int, w: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValidationError(w + "messages must be a non-empty list")
    if len(messages) > max_messages:
        raise ValidationError(w + f"{len(messages)} messages, over {max_messages}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValidationError(w + f"message {i} needs a string 'role'")
        if m["role"] not in _ROLES:
            raise ValidationError(w + f"message {i} has unknown role {m['role']!r}")
        if isinstance(m.get("content"), list):  # OpenAI's content parts: text ones are joined
            # in a copy of the message: the caller's own dict stays as it gave it
            messages[i] = m = {**m, "content": _joined_text(m["content"], f"{w}message {i} ")}
        if not isinstance(m.get("content"), str):
            raise ValidationError(w + f"message {i} content must be a string or text parts")


def _joined_text(parts: list[Any], w: str) -> str:
    """A message's content given as parts (``[{"type": "text", "text": ...}, ...]``, as OpenAI's
    chat API takes it) as one string, the parts joined by newlines (as vLLM's chat parser joins
    them); a part of another type (an image) is refused: the engine runs a text model."""
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValidationError(w + f"content part {j} is {kind!r}: only text parts are taken")
        if not isinstance(part.get("text"), str):
            raise ValidationError(w + f"content part {j} needs a string 'text'")
        texts.append(part["text"])
    if not texts:
        raise ValidationError(w + "content is an empty list of parts")
    return "\n".join(texts)
