"""``/v1/embeddings`` batches: the output line's body, and the 50,000-inputs limit of a batch.

A result of an embeddings request becomes OpenAI's ``CreateEmbeddingResponse``: ``{"object":
"list", "data": [{"object": "embedding", "index": i, "embedding": [...]}], "model", "usage":
{"prompt_tokens", "total_tokens"}}``, one ``data`` item per input in input order, each vector
as floats or as base64 of its little-endian float32 bytes (the request's ``encoding_format``).
OpenAI limits an embeddings batch to `MAX_BATCH_INPUTS` inputs across its requests; the server
refuses to create a batch over it (`check_batch_inputs`, 400 with OpenAI's error shape), before
the file is validated line by line. docs/openai.md, "/v1/embeddings", has the field table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefixq.core.embeddings import EMBEDDINGS, MAX_BATCH_INPUTS, count_inputs, vector_json
from prefixq.core.records import Result

__all__ = ["EMBEDDINGS", "count_file_inputs", "embeddings_object", "too_many_inputs"]


def embeddings_object(res: Result, model: str) -> dict[str, Any]:
    """The ``CreateEmbeddingResponse`` of one embeddings result."""
    data = [
        {"object": "embedding", "index": i, "embedding": vector_json(v, res.encoding_format)}
        for i, v in enumerate(res.embeddings or ())
    ]
    usage = {"prompt_tokens": res.prompt_tokens, "total_tokens": res.prompt_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def count_file_inputs(path: Path, stop_after: int = MAX_BATCH_INPUTS) -> int:
    """Inputs across the lines of a batch input file (`count_inputs` of each ``body.input``),
    read line by line; stops counting once past ``stop_after``. Lines that are not JSON or not
    embeddings lines count nothing here: line-by-line validation reports them."""
    n = 0
    with open(path, "rb") as f:
        for raw in f:
            try:
                obj = json.loads(raw)
            except ValueError:
                continue
            body = obj.get("body") if isinstance(obj, dict) else None
            if isinstance(body, dict):
                n += count_inputs(body.get("input"))
            if n > stop_after:
                break
    return n


def too_many_inputs(n: int) -> str | None:
    """The refusal of a batch of ``n`` inputs (None within the limit)."""
    if n <= MAX_BATCH_INPUTS:
        return None
    return (
        f"The batch input file holds more than {MAX_BATCH_INPUTS:,} embedding inputs across its "
        f"requests; an embeddings batch takes at most {MAX_BATCH_INPUTS:,}."
    )
