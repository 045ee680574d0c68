"""The engine arguments a worker starts vLLM with: ``--engine-arg KEY=VALUE`` flags typed
(`parse_engine_args`) and the defaults of a small CPU machine (`cpu_defaults`); re-exported by
vllm_engine.py, where callers have always imported them.
"""

from __future__ import annotations

from typing import Any

from prefixq.core.errors import SetupError
from prefixq.engine.vllm_compat import cpu_block_size

__all__ = ["cpu_defaults", "parse_engine_args"]


def parse_engine_args(pairs: list[str]) -> dict[str, Any]:
    """``["max_model_len=4096", "enforce_eager=true"]`` -> typed kwargs for `AsyncEngineArgs`."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise SetupError(f"--engine-arg takes KEY=VALUE, not {pair!r}")
        out[key.strip().replace("-", "_")] = _literal(raw.strip())
    return out


def _literal(raw: str) -> Any:
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def cpu_defaults() -> dict[str, Any]:
    """Engine args for a small CPU machine (docs/engine.md): a bounded KV cache (the default 0.92
    share of a NUMA node fails at start-up); eager mode (start-up ~25 s instead of ~100 s with
    torch.compile); float32, since eager bfloat16 on the CPU drifts far enough to change greedy
    answers of the embedded model ("Paris" becomes French word salad); small KV blocks, close to
    the block the affinity map hashes (the CPU backend's own default is 128; the smallest it
    takes depends on the release: `cpu_block_size`)."""
    return {
        "kv_cache_memory_bytes": 2 << 30,
        "max_model_len": 8192,
        "enforce_eager": True,
        "dtype": "float32",
        "block_size": cpu_block_size(),
    }
