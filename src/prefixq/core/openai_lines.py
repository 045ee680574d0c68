"""OpenAI batch-file lines: ``{"custom_id", "method": "POST", "url", "body"}`` into the plain
request form, honouring every body field vLLM supports offline and refusing the rest.

Each body field is honoured, kept for the output object (``model``), accepted and ignored because
it cannot change the answer (`IGNORED`), refused unless absent, null or a value that changes
nothing (`_NO_OP`), or refused as unknown. Nothing that would change the answer is silently
ignored: a field moves to `IGNORED` only if no value of it can. A null value means the field's
default, as in OpenAI's API; errors name the line and the field. docs/requests.md, "OpenAI batch
lines", has the table of every field: change it with these sets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prefixq.core.embeddings import EMBEDDINGS, embeddings_body
from prefixq.core.errors import ValidationError
from prefixq.core.responses_lines import responses_body
from prefixq.core.sampling import MAX_LOGPROBS, SAMPLING_FIELDS

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
#: a body of instructions and input messages, answered with a Response object
#: (core/responses_lines.py)
RESPONSES = "/v1/responses"
ENDPOINTS = (CHAT, COMPLETIONS, RESPONSES, EMBEDDINGS)
#: endpoints whose requests are chats (messages)
MESSAGE_ENDPOINTS = (CHAT, RESPONSES)
#: accepted and ignored (they cannot change the answer here)
IGNORED = frozenset(
    {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
)
#: fields refused unless null or one of these values (which change nothing)
_NO_OP: dict[str, tuple[Any, ...]] = {
    "stream": (False,),
    "stream_options": (),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none", "auto"),
    "function_call": ("none", "auto"),
    "parallel_tool_calls": (True, False),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "reasoning_effort": (),
    "verbosity": (),
    "suffix": ("",),
    "echo": (False,),
}
_WHY: dict[str, str] = {
    "stream": "batch requests are not streamed",
    "stream_options": "batch requests are not streamed",
    "tools": "tool calling is not supported",
    "functions": "function calling is not supported",
    "tool_choice": "tool calling is not supported",
    "function_call": "function calling is not supported",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "reasoning effort is not supported",
    "verbosity": "verbosity is not supported",
    "suffix": "suffix (insertion) is not supported",
    "echo": "echo is not supported",
}
_CHAT_ONLY = frozenset({"messages", "top_logprobs", "max_completion_tokens"})
_COMPLETIONS_ONLY = frozenset({"prompt", "best_of", "echo", "suffix", "prefix"})
_LINE_KEYS = frozenset({"custom_id", "method", "url", "body"})


def is_openai_line(obj: Mapping[str, Any]) -> bool:
    """Whether a line is an OpenAI batch line rather than a plain request."""
    return not obj.keys().isdisjoint(("custom_id", "body", "method", "url"))


def split_openai_line(
    obj: Mapping[str, Any], where: str
) -> tuple[Any, dict[str, Any], str, str | None]:
    """``(custom_id, the plain request body, endpoint url, model)`` of an OpenAI batch line;
    ValidationError names ``where`` and the field."""
    w = where + ": "
    extra = set(obj) - _LINE_KEYS
    if extra:
        raise ValidationError(w + f"unknown fields in an OpenAI batch line: {_names(extra)}")
    for key in ("custom_id", "method", "url", "body"):
        if key not in obj:
            raise ValidationError(w + f"OpenAI batch line needs {key!r}")
    if obj["method"] != "POST":
        raise ValidationError(w + f"method must be POST, not {obj['method']!r}")
    url = obj["url"]
    if url not in ENDPOINTS:
        raise ValidationError(w + f"unsupported url {url!r} ({', '.join(ENDPOINTS)})")
    if not isinstance(obj["body"], Mapping):
        raise ValidationError(w + "OpenAI batch line needs an object 'body'")
    body = {k: v for k, v in obj["body"].items() if v is not None or k in ("messages", "prompt")}
    model = body.pop("model", None)
    if model is not None and not isinstance(model, str):
        raise ValidationError(w + "body.model must be a string")
    if url == RESPONSES:  # fields of its own, and what its Response object echoes
        return obj["custom_id"], responses_body(body, w), url, model
    if url == EMBEDDINGS:  # its own fields (prefixq.core.embeddings)
        return obj["custom_id"], embeddings_body(body, w), url, model
    for key in IGNORED & body.keys():
        del body[key]
    _refuse_no_ops(body, w)
    other = _COMPLETIONS_ONLY if url == CHAT else _CHAT_ONLY
    wrong = other & body.keys()
    if wrong:
        kind = "chat" if url == CHAT else "completions"
        raise ValidationError(w + f"body.{_names(wrong)} does not go with the {kind} url {url}")
    if url == CHAT:
        if "messages" not in body:
            raise ValidationError(w + f"a {CHAT} body needs 'messages'")
        _chat_logprobs(body, w)
    else:
        if "prompt" not in body:
            raise ValidationError(w + f"a {COMPLETIONS} body needs 'prompt'")
        _prompt(body, w)
        _best_of(body, w)
    _max_tokens(body, w)
    unknown = set(body) - SAMPLING_FIELDS.keys() - {"messages", "prompt", "prefix"}
    if url == COMPLETIONS:
        unknown.discard("prompt_token_ids")  # set by _prompt from a list of token ids
    if unknown:
        raise ValidationError(w + f"unknown body fields: {_names(unknown)}")
    return obj["custom_id"], body, url, model


def _names(keys: set[str] | frozenset[str]) -> str:
    return ", ".join(sorted(keys))


def _refuse_no_ops(body: dict[str, Any], w: str) -> None:
    tools = bool(body.get("tools") or body.get("functions"))
    for key in _NO_OP.keys() & body.keys():
        value = body.pop(key)
        ok = value in _NO_OP[key] and not (key in ("tool_choice", "function_call") and tools)
        if not ok:
            raise ValidationError(w + f"body.{key}={value!r} is refused: {_WHY.get(key, '')}")


def _chat_logprobs(body: dict[str, Any], w: str) -> None:
    """Chat: ``logprobs: true`` (+ ``top_logprobs: k``) -> the sampling ``logprobs: k``."""
    want = body.pop("logprobs", False)
    top = body.pop("top_logprobs", None)
    if not isinstance(want, bool):
        raise ValidationError(w + "body.logprobs must be true or false for chat")
    if top is not None:
        if not want:
            raise ValidationError(w + "body.top_logprobs needs body.logprobs=true")
        if isinstance(top, bool) or not isinstance(top, int):
            raise ValidationError(w + "body.top_logprobs must be an integer")
        if not 0 <= top <= MAX_LOGPROBS:
            raise ValidationError(
                w + f"body.top_logprobs={top} must be between 0 and {MAX_LOGPROBS}"
            )
    if want:
        body["logprobs"] = 0 if top is None else top


def _prompt(body: dict[str, Any], w: str) -> None:
    """Completions: a prompt string, token ids, or a list of exactly one of those."""
    prompt = body.pop("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        body["prompt"] = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        body["prompt_token_ids"] = prompt
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise ValidationError(w + "body.prompt holds several prompts: give one prompt per line")
    else:
        raise ValidationError(w + "body.prompt must be a string or a list of token ids")


def _best_of(body: dict[str, Any], w: str) -> None:
    best_of = body.pop("best_of", None)
    if best_of is not None and best_of != body.get("n", 1):
        raise ValidationError(w + f"body.best_of={best_of!r} is refused: only best_of = n")


def _max_tokens(body: dict[str, Any], w: str) -> None:
    if "max_completion_tokens" not in body:
        return
    value = body.pop("max_completion_tokens")
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 20:
        raise ValidationError(
            w + f"body.max_completion_tokens={value!r} must be an integer between 1 and 1048576"
        )
    if "max_tokens" in body and body["max_tokens"] != value:
        raise ValidationError(w + "body.max_tokens and body.max_completion_tokens differ")
    body["max_tokens"] = value
