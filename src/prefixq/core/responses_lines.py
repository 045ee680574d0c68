"""``/v1/responses`` batch bodies into the plain request form (`responses_body`): a chat of
messages, sampling fields, and what the Response object echoes (``echo``).

``instructions`` becomes a leading system message and ``input`` (a string, or message items with
text content) the messages after it, so requests that share instructions or leading messages get
the prefix affinity chat requests get (the shared leading messages are the prefix).
``max_output_tokens``, ``temperature`` and ``top_p`` are sampling fields; ``text.format`` is chat's
``response_format`` (structured output, which the engine runs as guided decoding). What cannot be
served (tools, built-in tools, ``previous_response_id``, ``background``, images, files, audio,
reasoning) raises ValidationError naming the field: the server's batch validation turns that into
the line's own 400 refusal (openai/validate.py), never the batch's failure. docs/openai.md,
"/v1/responses", has the table of every field.
"""

from __future__ import annotations

from typing import Any

from prefixq.core.errors import ValidationError

__all__ = ["ECHOED", "responses_body"]

#: body fields the Response object repeats (and the defaults OpenAI shows for them)
ECHOED = ("instructions", "metadata", "temperature", "top_p", "max_output_tokens", "text")
#: accepted and ignored: they cannot change the answer here (``store``: no response is kept for a
#: later ``previous_response_id``, which is refused)
_IGNORED = frozenset(
    {
        "user",
        "store",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "max_tool_calls",
        "parallel_tool_calls",
    }
)
#: refused unless absent, null or one of these values (which change nothing), and why
_NO_OP: dict[str, tuple[tuple[Any, ...], str]] = {
    "stream": ((False,), "batch requests are not streamed"),
    "stream_options": ((), "batch requests are not streamed"),
    "background": ((False,), "background responses are not supported in a batch"),
    "tools": (([],), "tools (function and built-in) are not supported"),
    "tool_choice": (("none", "auto"), "tools are not supported"),
    "previous_response_id": ((), "previous_response_id is not supported: no response is stored"),
    "conversation": ((), "conversations are not supported: no response is stored"),
    "prompt": ((), "prompt templates are not supported"),
    "reasoning": ((), "reasoning options are not supported"),
    "include": (([],), "include is not supported"),
    "truncation": (("disabled",), "only truncation 'disabled' is supported"),
    "top_logprobs": ((0,), "logprobs are not supported for /v1/responses"),
}
_ROLES = frozenset({"user", "assistant", "system", "developer"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_MEDIA_PARTS = frozenset({"input_image", "input_file", "input_audio"})


def responses_body(body: dict[str, Any], w: str) -> dict[str, Any]:
    """The plain request body of a ``/v1/responses`` line's ``body`` (``model`` already taken
    out): ``messages``, sampling fields and ``echo``; ValidationError names ``w`` and the field."""
    body = dict(body)
    for key in _IGNORED & body.keys():
        del body[key]
    for key in _NO_OP.keys() & body.keys():
        value = body.pop(key)
        ok, why = _NO_OP[key]
        if value is not None and value not in ok:
            raise ValidationError(w + f"body.{key}={_short(value)} is refused: {why}")
    echo: dict[str, Any] = {}
    messages: list[dict[str, Any]] = []
    instructions = body.pop("instructions", None)
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ValidationError(w + "body.instructions must be a string")
        messages.append({"role": "system", "content": instructions})
        echo["instructions"] = instructions
    if "input" not in body or body["input"] is None:
        raise ValidationError(w + "a /v1/responses body needs 'input'")
    messages += _input(body.pop("input"), w)
    out: dict[str, Any] = {"messages": messages}
    metadata = body.pop("metadata", None)
    if metadata is not None:
        echo["metadata"] = _metadata(metadata, w)
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            out[key] = echo[key] = body.pop(key)
    tokens = body.pop("max_output_tokens", None)
    if tokens is not None:
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= 1 << 20:
            raise ValidationError(
                w + f"body.max_output_tokens={tokens!r} must be an integer between 1 and 1048576"
            )
        out["max_tokens"] = echo["max_output_tokens"] = tokens
    text = body.pop("text", None)
    if text is not None:
        fmt = _text_format(text, w)
        if fmt is not None:
            out["response_format"] = fmt
        echo["text"] = text
    unknown = {k for k, v in body.items() if v is not None}
    if unknown:
        raise ValidationError(w + f"unknown body fields: {', '.join(sorted(unknown))}")
    out["echo"] = echo
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _input(value: Any, w: str) -> list[dict[str, Any]]:
    """``input``: a string (one user message) or a list of message items with text content."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ValidationError(w + "body.input must be a string or a non-empty list of messages")
    out = []
    for i, item in enumerate(value):
        where = f"body.input[{i}]"
        if not isinstance(item, dict):
            raise ValidationError(w + f"{where} must be a message object")
        kind = item.get("type", "message")
        if kind != "message":
            raise ValidationError(
                w + f"{where} of type {_short(kind)} is refused: only message items are supported"
            )
        role = item.get("role")
        if role not in _ROLES:
            raise ValidationError(
                w + f"{where}.role={_short(role)} must be one of " + ", ".join(sorted(_ROLES))
            )
        extra = set(item) - {"type", "role", "content", "id", "status"}
        if extra:
            raise ValidationError(w + f"{where} has unknown fields: {', '.join(sorted(extra))}")
        out.append({"role": role, "content": _content(item.get("content"), f"{where}.content", w)})
    return out


def _content(content: Any, where: str, w: str) -> str:
    """A message's content: a string, or text parts joined (images, files and audio refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValidationError(w + f"{where} must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _MEDIA_PARTS:
            raise ValidationError(
                w + f"{where}[{j}] of type {kind!r} is refused: only text input is supported"
            )
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ValidationError(
                w + f"{where}[{j}] must be a text part ({{'type': 'input_text', 'text': ...}}}})"
            )
        texts.append(part["text"])
    return "".join(texts)


def _metadata(metadata: Any, w: str) -> dict[str, str]:
    """OpenAI's limits: at most 16 string pairs, keys up to 64 characters, values up to 512."""
    if (
        not isinstance(metadata, dict)
        or len(metadata) > 16
        or not all(isinstance(k, str) and len(k) <= 64 for k in metadata)
        or not all(isinstance(v, str) and len(v) <= 512 for v in metadata.values())
    ):
        raise ValidationError(
            w + "body.metadata must hold at most 16 string pairs (keys up to 64 characters, "
            "values up to 512)"
        )
    return dict(metadata)


def _text_format(text: Any, w: str) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (None for plain text)."""
    if not isinstance(text, dict):
        raise ValidationError(w + "body.text must be an object")
    extra = {k for k, v in text.items() if k != "format" and not (k == "verbosity" and v is None)}
    if extra:
        raise ValidationError(w + f"body.text.{sorted(extra)[0]} is refused: only text.format")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ValidationError(w + "body.text.format must be an object")
    kind = fmt.get("type")
    if kind == "text" and set(fmt) == {"type"}:
        return None
    if kind == "json_object" and set(fmt) == {"type"}:
        return {"type": "json_object"}
    if kind == "json_schema":
        extra = set(fmt) - {"type", "name", "schema", "strict", "description"}
        if extra:
            raise ValidationError(
                w + f"body.text.format has unknown fields: {', '.join(sorted(extra))}"
            )
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}  # checked as response_format
    raise ValidationError(
        w + f"body.text.format type {_short(kind)} is not supported (text, json_object, "
        "json_schema)"
    )
