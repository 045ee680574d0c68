"""Embeddings requests: their inputs, their options, and their vectors on the wire (no I/O).

An embeddings request (an OpenAI ``/v1/embeddings`` batch line, or a plain line with ``input``)
holds one or many inputs: a string, a list of strings, a list of token ids, or a list of token-id
lists, as OpenAI's ``input`` takes them; each input gets one vector, and the request one result
with ``data[i]`` per input. Its options (`Request.pooling`) are ``dimensions`` (Matryoshka
truncation, where the model allows it: the engine refuses it per line otherwise) and
``encoding_format`` (``float``, or ``base64``: the little-endian float32 bytes, as OpenAI writes
them). Vectors travel and are stored as those float32 bytes (`pack_vector`), 4 bytes a dimension.
docs/openai.md, "/v1/embeddings", has the field table.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from typing import Any

from prefixq.core.errors import ValidationError

__all__ = [
    "EMBEDDINGS",
    "EMBED_FORMATS",
    "MAX_BATCH_INPUTS",
    "MAX_INPUTS",
    "TASKS",
    "check_inputs",
    "check_pooling",
    "count_inputs",
    "embeddings_body",
    "normalize_input",
    "pack_vector",
    "unpack_vector",
    "vector_json",
]

EMBEDDINGS = "/v1/embeddings"
#: what a worker serves (`Settings.task`): text generation, or embeddings through vLLM's pooling
#: runner; a shard's task is recorded in Redis (`Keys.tasks`) and placement follows it
TASKS = ("generate", "embed")
EMBED_FORMATS = ("float", "base64")
#: inputs in one request (OpenAI's limit for one embeddings call)
MAX_INPUTS = 2048
#: inputs across the requests of one batch (OpenAI's limit for an embeddings batch)
MAX_BATCH_INPUTS = 50_000
#: body fields of an embeddings line besides ``input`` and ``model``: honoured, or ignored (user)
_OPTIONS = frozenset({"dimensions", "encoding_format"})
_IGNORED = frozenset({"user"})

Inputs = list[str] | list[list[int]]


def normalize_input(value: Any, w: str) -> Inputs:
    """OpenAI's ``input`` (a string, strings, token ids, token-id lists) as a list of inputs,
    each a string or a list of token ids; ValidationError (prefixed ``w``) says what is wrong."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise ValidationError(
            w + "input must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists, and not empty"
        )
    if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return [list(value)]
    return list(value)


def check_inputs(inputs: Any, w: str) -> None:
    """Each input a non-empty string or a non-empty list of token ids in [0, 2**31), all of one
    kind, at most `MAX_INPUTS` of them."""
    if not isinstance(inputs, list) or not inputs:
        raise ValidationError(w + "input must be a non-empty list of inputs")
    if len(inputs) > MAX_INPUTS:
        raise ValidationError(w + f"input holds {len(inputs)} inputs, over {MAX_INPUTS}")
    kinds: set[type] = set()
    for i, x in enumerate(inputs):
        if isinstance(x, str):
            if not x:
                raise ValidationError(w + f"input[{i}] is an empty string")
            kinds.add(str)
        elif (
            isinstance(x, list)
            and x
            and set(map(type, x)) == {int}
            and min(x) >= 0
            and max(x) < 1 << 31
        ):
            kinds.add(list)
        else:
            raise ValidationError(
                w + f"input[{i}] must be a non-empty string or a non-empty list of token ids"
            )
    if len(kinds) > 1:
        raise ValidationError(w + "input mixes strings and token ids: give one kind")


def check_pooling(pooling: Any, w: str) -> None:
    """``dimensions`` a positive integer, ``encoding_format`` float or base64, nothing else."""
    if not isinstance(pooling, dict):
        raise ValidationError(w + "pooling options must be an object")
    unknown = set(pooling) - _OPTIONS
    if unknown:
        raise ValidationError(w + f"unknown embeddings options: {', '.join(sorted(unknown))}")
    dims = pooling.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or dims < 1):
        raise ValidationError(w + f"dimensions={dims!r} must be a positive integer")
    fmt = pooling.get("encoding_format")
    if fmt is not None and fmt not in EMBED_FORMATS:
        raise ValidationError(w + f"encoding_format={fmt!r} must be float or base64")


def embeddings_body(body: dict[str, Any], w: str) -> dict[str, Any]:
    """The plain request body of an OpenAI embeddings line's body (``model`` already taken):
    ``{"input": [...], "dimensions"?, "encoding_format"?}``; a field OpenAI's embeddings
    endpoint does not take is refused, ``user`` ignored."""
    if "input" not in body:
        raise ValidationError(w + f"a {EMBEDDINGS} body needs 'input'")
    unknown = set(body) - _OPTIONS - _IGNORED - {"input"}
    if unknown:
        raise ValidationError(w + f"unknown body fields: {', '.join(sorted(unknown))}")
    return {k: v for k, v in body.items() if k not in _IGNORED}


def count_inputs(value: Any) -> int:
    """How many inputs an ``input`` value holds (1 for a string or one list of token ids), as the
    batch limit counts them; 0 for a value that is none of OpenAI's forms."""
    if isinstance(value, str):
        return 1
    if not isinstance(value, list) or not value:
        return 0
    if all(isinstance(t, int) for t in value):
        return 1
    return len(value)


def pack_vector(values: Sequence[float]) -> bytes:
    """A vector as little-endian float32 bytes (what OpenAI's base64 encodes)."""
    return struct.pack(f"<{len(values)}f", *values)


def unpack_vector(data: bytes) -> list[float]:
    """The floats of `pack_vector`'s bytes."""
    return list(struct.unpack(f"<{len(data) // 4}f", data))


def vector_json(data: bytes, encoding_format: str | None) -> list[float] | str:
    """A vector as an OpenAI ``embedding``: floats, or base64 of its float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(data).decode("ascii")
    return unpack_vector(data)
