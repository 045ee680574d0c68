"""`SimEngine`: vLLM's own scheduler and KV cache on a clock, for designing admission on a CPU.

What several bursts over one corpus recompute depends on which documents vLLM's cache still holds
when each question reaches it: its scheduler (token budget, ``max_num_seqs``, chunked prefill,
priority), its block pool (least recently freed evicted first, a request's tail blocks before its
head) and the time each step takes against the bursts' arrival. `SimEngine` runs the first two for
real (vLLM's `Scheduler` and `KVCacheManager`, built from the installed vLLM, with no model) and
replaces the forward pass by a sleep as long as the step would take on a GPU, from a step-time
model (`StepCost`), so that a worker, its Redis queues and `prefixq bench`'s workloads run against
it in real time on a machine with no GPU.

It is a design tool, not a measurement: `prefixq bench --model sim:llama-3.1-8b` reports what the
model predicts (the report says so), and a policy it favours is kept only once the GPU measures
it. The default costs are fitted to one H200 running the Llama-3.1-8B-shaped dummy model with
vLLM 0.26 (docs/BENCHMARKS.md, "Simulated engine": the fit and how the simulation compares with
the measured runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from prefixq.core.errors import EngineAborted, EngineDead, EngineRefused
from prefixq.engine.protocol import (
    EmbedOutput,
    EmbedRequest,
    EngineOutput,
    EngineRequest,
    EngineSizes,
)

log = logging.getLogger(__name__)

__all__ = ["PREFIX", "Finished", "SimCore", "SimEngine", "StepCost", "is_sim"]

#: ``--model`` names that select the simulated engine (``sim:`` then the model's shape)
PREFIX = "sim:"
#: KV bytes per token of the Llama-3.1-8B shape (2 x 32 layers x 8 KV heads x 128 x 2 bytes)
KV_BYTES_PER_TOKEN = 131_072


def is_sim(model: str) -> bool:
    """Whether ``model`` names the simulated engine."""
    return model.startswith(PREFIX)


@dataclass(frozen=True, slots=True)
class StepCost:
    """How long one engine step takes, from what it schedules: a fixed cost (weights read,
    launch), a cost per token computed (the dense layers' FLOPs) and one per token of context
    read by attention (each scheduled request's context, its new tokens included)."""

    step_ms: float = 5.0
    token_us: float = 26.0
    context_ns: float = 32.0

    def seconds(self, new_tokens: int, context_tokens: int) -> float:
        return (
            self.step_ms * 1e-3 + self.token_us * 1e-6 * new_tokens
        ) + self.context_ns * 1e-9 * context_tokens


#: engine arguments the simulation reads (vLLM's names), with their defaults as vLLM 0.26 set
#: them on an H200 through `AsyncLLM` (the worker's log: ``max_num_seqs=128``)
_DEFAULTS: dict[str, Any] = {
    "max_num_seqs": 128,
    "max_num_batched_tokens": 2048,
    "max_model_len": 8192,
    "block_size": 16,
    "kv_cache_memory_bytes": 17_179_869_184,
    "scheduling_policy": "fcfs",
    "enable_prefix_caching": True,
}
#: the step-time model's arguments (`StepCost`'s fields, prefixed)
_COST = {"sim_step_ms": "step_ms", "sim_token_us": "token_us", "sim_context_ns": "context_ns"}
#: ``sim_trace=PATH``: one JSON line per finished request to ``PATH.<pid>`` (its id, a key of its
#: first block's tokens, when it was added, had its first token and finished, its cached tokens)
_TRACE = "sim_trace"
#: arguments a real engine takes that mean nothing here (accepted, ignored)
_IGNORED = {
    "load_format",
    "skip_tokenizer_init",
    "gpu_memory_utilization",
    "disable_log_stats",
    "enforce_eager",
    "dtype",
}


@dataclass(slots=True)
class Finished:
    """A request the simulated engine finished: its output tokens, prefix-cache hit, first
    token (on the core's clock) and prompt."""

    rid: str
    token_ids: list[int]
    cached: int
    first: float
    prompt_tokens: int


class SimCore:
    """vLLM's scheduler and a `StepCost`, with no clock of its own: `schedule` says what a step
    runs and how long it takes, `finish` hands vLLM its outputs at a time the caller gives
    (`SimEngine`: real time; scripts/sim_fit.py: a virtual one)."""

    def __init__(self, args: dict[str, Any]) -> None:
        unknown = sorted(set(args) - set(_DEFAULTS) - set(_COST) - _IGNORED - {_TRACE})
        if unknown:
            raise EngineRefused(f"the simulated engine takes no {', '.join(unknown)}")
        self.args = _DEFAULTS | {k: v for k, v in args.items() if k in _DEFAULTS}
        self.cost = StepCost(**{_COST[k]: float(v) for k, v in args.items() if k in _COST})
        self.block_size = int(self.args["block_size"])
        self.max_model_len = int(self.args["max_model_len"])
        per_block = KV_BYTES_PER_TOKEN * self.block_size
        self.blocks = int(self.args["kv_cache_memory_bytes"]) // per_block
        self.kv_tokens = self.blocks * self.block_size
        self.sched, self._hasher = _scheduler(self.args, self.blocks)
        self._first: dict[str, float] = {}
        self._cached: dict[str, int] = {}
        #: steps taken and the modelled seconds they took
        self.steps = 0
        self.busy_s = 0.0

    def add(self, rid: str, ids: list[int], max_tokens: int, priority: int, now: float) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(
            rid, ids, params, None, arrival_time=now, priority=priority, block_hasher=self._hasher
        )
        self.sched.add_request(req)

    def abort(self, rid: str) -> None:
        from vllm.v1.request import RequestStatus

        if rid in self.sched.requests:
            self.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        self._first.pop(rid, None)
        self._cached.pop(rid, None)

    def schedule(self) -> tuple[Any, float, set[str]]:
        """One step: vLLM's scheduler output, the step's modelled seconds and the requests that
        sample a token in it (those not in the middle of their prefill)."""
        sched = self.sched
        out = sched.schedule()
        context, sampled = 0, set()
        for rid in out.num_scheduled_tokens:
            r = sched.requests[rid]
            context += r.num_computed_tokens  # already advanced by this step's tokens
            if not r.is_prefill_chunk:
                sampled.add(rid)
        new = out.total_num_scheduled_tokens
        seconds = self.cost.seconds(new, context) if new else 0.0
        self.steps += 1
        self.busy_s += seconds
        return out, seconds, sampled

    def finish(self, out: Any, sampled: set[str], now: float) -> list[Finished]:
        """Hand vLLM the step's outputs (one token each of ``sampled``) at ``now``; the requests
        that finished."""
        from vllm.v1.outputs import ModelRunnerOutput

        rids = list(out.num_scheduled_tokens)
        runner = ModelRunnerOutput(
            req_ids=rids,
            req_id_to_index={rid: i for i, rid in enumerate(rids)},
            sampled_token_ids=[[11] if rid in sampled else [] for rid in rids],
        )
        requests = {rid: self.sched.requests.get(rid) for rid in rids}
        for rid in sampled:
            self._first.setdefault(rid, now)
        done: list[Finished] = []
        for outputs in self.sched.update_from_output(out, runner).values():
            for o in outputs.outputs:
                stats = getattr(o, "prefill_stats", None)
                if stats is not None:  # on a request's first output: its prefix cache hit
                    self._cached[o.request_id] = int(stats.num_cached_tokens)
                if o.finish_reason is None:
                    continue
                r = requests.get(o.request_id)
                first = self._first.pop(o.request_id, 0.0)
                cached = self._cached.pop(o.request_id, 0)
                if r is not None:
                    ids = list(r.output_token_ids)
                    done.append(Finished(o.request_id, ids, cached, first, r.num_prompt_tokens))
        return done


class SimEngine(EngineSizes):
    """The `Engine` protocol over a `SimCore` stepping in real time (module docstring)."""

    def __init__(self, model: str, engine_args: dict[str, Any] | None = None) -> None:
        self.model = model
        self._args = dict(engine_args or {})
        self.core = SimCore(self._args)
        self._max_num_seqs = int(self.core.args["max_num_seqs"])
        self._block_size = self.core.block_size
        self.max_model_len = self.core.max_model_len
        self.kv_tokens = self.core.kv_tokens
        trace = self._args.get(_TRACE)
        self._trace = open(f"{trace}.{os.getpid()}", "a") if trace else None  # noqa: SIM115
        self._added: dict[str, tuple[float, int]] = {}
        self._waiters: dict[str, asyncio.Future[EngineOutput]] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._ids = itertools.count()

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._loop_task = asyncio.create_task(self._run(), name="sim-engine")
        log.info(
            "simulated engine up: model=%s max_num_seqs=%d max_num_batched_tokens=%d "
            "kv_tokens=%d cost=%s",
            self.model,
            self._max_num_seqs,
            int(self.core.args["max_num_batched_tokens"]),
            self.kv_tokens,
            self.core.cost,
        )

    async def generate(self, request: EngineRequest) -> EngineOutput:
        if self._loop_task is None or self._loop_task.done():
            raise EngineDead("simulated engine not running")
        ids = request.prompt_token_ids
        if ids is None:  # a text prompt: 4 characters a token, as the bench's null engine
            ids = [7] * max(1, len(request.prompt or "") // 4)
        max_tokens = int(request.sampling.get("max_tokens") or 16)
        if len(ids) + max_tokens > self.max_model_len:
            raise EngineRefused(
                f"prompt of {len(ids)} tokens + max_tokens {max_tokens} exceeds max_model_len "
                f"{self.max_model_len}"
            )
        rid = f"{request.request_id}#{next(self._ids)}"
        fut: asyncio.Future[EngineOutput] = asyncio.get_running_loop().create_future()
        self._waiters[rid] = fut
        if self._trace is not None:
            self._added[rid] = (time.time(), hash(tuple(ids[: self._block_size])))
        self.core.add(rid, list(ids), max_tokens, request.priority, time.time())
        self._wake.set()
        try:
            return await fut
        except asyncio.CancelledError:
            self.core.abort(rid)
            self._waiters.pop(rid, None)
            raise

    async def embed(self, request: EmbedRequest) -> EmbedOutput:
        raise EngineRefused("the simulated engine generates only")

    async def abort(self, request_id: str) -> None:
        for rid in [r for r in self._waiters if r.rsplit("#", 1)[0] == request_id]:
            self.core.abort(rid)
            fut = self._waiters.pop(rid)
            if not fut.done():
                fut.set_exception(EngineAborted(f"request {request_id} was aborted"))

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        return "\n".join(str(m.get("content", "")) for m in messages)

    async def reset_prefix_cache(self) -> None:
        self.core.sched.reset_prefix_cache()

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        for fut in self._waiters.values():
            if not fut.done():
                fut.set_exception(EngineDead("simulated engine closed"))
        self._waiters.clear()
        if self._trace is not None:
            self._trace.close()
            self._trace = None

    async def _run(self) -> None:
        """`_steps` until closed; if vLLM's scheduler fails, every waiting request fails with
        EngineDead (as a real engine's death does) instead of waiting for good."""
        try:
            await self._steps()
        except Exception as e:
            log.exception("simulated engine died")
            for fut in self._waiters.values():
                if not fut.done():
                    fut.set_exception(EngineDead(f"simulated engine died: {e}"))
            self._waiters.clear()

    async def _steps(self) -> None:
        """Step while requests are in: schedule, sleep the step's modelled time (less what
        scheduling took), then hand vLLM the step's outputs."""
        core = self.core
        while True:
            if not core.sched.has_requests():
                self._wake.clear()
                await self._wake.wait()
                continue
            t0 = time.perf_counter()
            out, seconds, sampled = core.schedule()
            await asyncio.sleep(max(0.0, seconds - (time.perf_counter() - t0)))
            now = time.time()
            for f in core.finish(out, sampled, now):
                fut = self._waiters.pop(f.rid, None)
                if fut is None or fut.done():
                    continue
                if self._trace is not None:
                    add, doc = self._added.pop(f.rid, (0.0, 0))
                    row = [f.rid, doc, add, f.first, now, f.cached, f.prompt_tokens]
                    self._trace.write(json.dumps(row) + "\n")
                fut.set_result(
                    EngineOutput(
                        text="x" * len(f.token_ids),
                        token_ids=f.token_ids,
                        finish_reason="length",
                        prompt_tokens=f.prompt_tokens,
                        cached_tokens=f.cached,
                        first_token=f.first,
                    )
                )


def _scheduler(args: dict[str, Any], blocks: int) -> tuple[Any, Any]:
    """vLLM's v1 `Scheduler` over ``blocks`` KV blocks of one full-attention layer group (the
    cache's accounting is per block, whatever the layers: the model only sizes a block), and
    the block hasher its requests need (the engine core's, with its default hash)."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from prefixq.bench.dummy import dummy_model

    model, _ = dummy_model()
    block = int(args["block_size"])
    max_len = int(args["max_model_len"])
    mc = ModelConfig(model=model, skip_tokenizer_init=True, max_model_len=max_len)
    sc = SchedulerConfig(
        max_num_seqs=int(args["max_num_seqs"]),
        max_num_batched_tokens=int(args["max_num_batched_tokens"]),
        max_model_len=max_len,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
        policy=args["scheduling_policy"],
    )
    cc = CacheConfig(block_size=block, enable_prefix_caching=bool(args["enable_prefix_caching"]))
    cc.num_gpu_blocks = blocks
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc)
    spec = FullAttentionSpec(block_size=block, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    kvc = KVCacheConfig(
        num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l"], spec)]
    )
    sched = Scheduler(
        vllm_config=vc,
        kv_cache_config=kvc,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=block,
        log_stats=False,
    )
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return sched, get_request_block_hasher(block, hash_fn)
