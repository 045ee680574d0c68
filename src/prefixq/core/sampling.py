"""A request's sampling fields: which exist, their types and ranges (`check_sampling`).

The same checks run when a producer accepts a request and again when a worker reads it (an entry
may come from anything with write access to the stream). The dict travels to the engine as it is
here; the engine adapter (engine/vllm_engine.py) turns it into vLLM's ``SamplingParams``, so a
field added here needs its translation there. docs/requests.md ("Sampling values") lists every
field and range; docs/engine.md ("Sampling, choices and abort") says what vLLM makes of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from prefixq.core.errors import ValidationError

#: sampling fields a request may carry, with their accepted types
SAMPLING_FIELDS: dict[str, tuple[type, ...]] = {
    "max_tokens": (int,),
    "min_tokens": (int,),
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": (int,),
    "min_p": (int, float),
    "presence_penalty": (int, float),
    "frequency_penalty": (int, float),
    "repetition_penalty": (int, float),
    "stop": (str, list),
    "stop_token_ids": (list,),
    "seed": (int,),
    "ignore_eos": (bool,),
    "n": (int,),
    "logprobs": (int,),
    "logit_bias": (dict,),
    "response_format": (dict,),
}
#: output tokens when a request does not say (the engine adapter applies it)
DEFAULT_MAX_TOKENS = 256
MAX_N = 128
#: vLLM's default ``max_logprobs``; an engine started with a lower one refuses more
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024
#: nesting of a json_schema's schema (text_checks allows 16 levels below a sampling field)
MAX_SCHEMA_DEPTH = 14
_MAX_TOKEN_ID = 1 << 31

_RANGES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("max_tokens", lambda v: 1 <= v <= 1 << 20, "between 1 and 1048576"),
    ("min_tokens", lambda v: v >= 0, ">= 0"),
    ("temperature", lambda v: 0 <= v <= 100, "between 0 and 100"),
    ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("top_k", lambda v: v == -1 or v >= 0, "-1 or >= 0"),
    ("min_p", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("presence_penalty", lambda v: -2 <= v <= 2, "between -2 and 2"),
    ("frequency_penalty", lambda v: -2 <= v <= 2, "between -2 and 2"),
    ("repetition_penalty", lambda v: 0 < v <= 10, "in (0, 10]"),
    ("seed", lambda v: -(1 << 63) <= v < 1 << 63, "a 64-bit integer"),
    ("n", lambda v: 1 <= v <= MAX_N, f"between 1 and {MAX_N}"),
    ("logprobs", lambda v: 0 <= v <= MAX_LOGPROBS, f"between 0 and {MAX_LOGPROBS}"),
)


def normalize_sampling(s: Mapping[str, Any]) -> dict[str, Any]:
    """The canonical form of a sampling dict (before `check_sampling`): ``logit_bias`` keys as
    strings (msgpack maps carry string keys only), ``response_format`` ``text`` dropped (the
    default)."""
    out = dict(s)
    bias = out.get("logit_bias")
    if isinstance(bias, dict):
        out["logit_bias"] = {
            str(k) if isinstance(k, int) and not isinstance(k, bool) else k: v
            for k, v in bias.items()
        }
    rf = out.get("response_format")
    if isinstance(rf, dict) and rf == {"type": "text"}:
        del out["response_format"]
    return out


def check_sampling(s: Mapping[str, Any], w: str) -> None:
    """Raise ValidationError (prefixed with ``w``) unless every field of ``s`` is known, typed
    and in range."""
    for key, value in s.items():
        kinds = SAMPLING_FIELDS.get(key)
        if kinds is None:
            raise ValidationError(w + f"unknown sampling field {key!r}")
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            raise ValidationError(w + f"{key} has the wrong type ({type(value).__name__})")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValidationError(w + f"{key} must be finite")
    for key, ok, what in _RANGES:
        if key in s and not ok(s[key]):
            raise ValidationError(w + f"{key}={s[key]!r} must be {what}")
    stop = s.get("stop")
    if isinstance(stop, list) and (len(stop) > 16 or not all(isinstance(x, str) for x in stop)):
        raise ValidationError(w + "stop must be a string or a list of at most 16 strings")
    ids = s.get("stop_token_ids")
    if ids is not None and not all(
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x < _MAX_TOKEN_ID for x in ids
    ):
        raise ValidationError(w + "stop_token_ids must be a list of token ids (integers >= 0)")
    top = s.get("max_tokens", DEFAULT_MAX_TOKENS)
    if s.get("min_tokens", 0) > top:
        raise ValidationError(
            w
            + f"min_tokens={s['min_tokens']} is over max_tokens={top}"
            + ("" if "max_tokens" in s else " (the default)")
        )
    if "logit_bias" in s:
        _check_logit_bias(s["logit_bias"], w)
    if "response_format" in s:
        check_response_format(s["response_format"], w)


def _check_logit_bias(bias: dict[Any, Any], w: str) -> None:
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValidationError(w + f"logit_bias has {len(bias)} entries, over {MAX_LOGIT_BIAS}")
    for k, v in bias.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit() and int(k) < _MAX_TOKEN_ID):
            raise ValidationError(w + f"logit_bias key {k!r} is not a token id")
        if isinstance(v, bool) or not isinstance(v, int | float) or not -100 <= v <= 100:
            raise ValidationError(w + f"logit_bias[{k!r}]={v!r} must be a number in [-100, 100]")


def check_response_format(rf: Any, w: str) -> None:
    """OpenAI's ``response_format``: text, json_object or json_schema (with a schema object)."""
    if not isinstance(rf, dict):
        raise ValidationError(w + "response_format must be an object")
    kind = rf.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise ValidationError(
            w + f"response_format type {kind!r} is not supported (text, json_object, json_schema)"
        )
    extra = set(rf) - ({"type", "json_schema"} if kind == "json_schema" else {"type"})
    if extra:
        raise ValidationError(w + f"response_format has unknown fields: {', '.join(sorted(extra))}")
    if kind != "json_schema":
        return
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise ValidationError(w + "response_format json_schema needs a 'json_schema' object")
    extra = set(js) - {"name", "schema", "strict", "description"}
    if extra:
        raise ValidationError(w + f"json_schema has unknown fields: {', '.join(sorted(extra))}")
    if not isinstance(js.get("schema"), dict):
        raise ValidationError(w + "json_schema needs a 'schema' object")
    for name, kinds in (("name", (str,)), ("description", (str,)), ("strict", (bool,))):
        if js.get(name) is not None and not isinstance(js[name], kinds):
            raise ValidationError(w + f"json_schema.{name} has the wrong type")
    if _depth(js["schema"]) > MAX_SCHEMA_DEPTH:
        raise ValidationError(w + f"json_schema.schema nests deeper than {MAX_SCHEMA_DEPTH}")


def _depth(obj: Any, level: int = 1) -> int:
    """Nesting depth of a JSON value, stopping just past the limit."""
    if level > MAX_SCHEMA_DEPTH:
        return level
    if isinstance(obj, dict):
        return max((_depth(v, level + 1) for v in obj.values()), default=level)
    if isinstance(obj, list):
        return max((_depth(v, level + 1) for v in obj), default=level)
    return level - 1
