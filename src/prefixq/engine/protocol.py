"""The seam between the worker loop and an inference engine.

`VllmEngine` (vllm_engine.py) is the real one; tests may put a deterministic engine behind the same
protocol to inject faults into the worker loop. `EngineSizes` gives an implementation the
protocol's two read-only sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from prefixq.core.records import Choice, Result


@dataclass(slots=True)
class EngineRequest:
    """One request as the engine sees it: a prompt string or token ids, plus sampling fields."""

    request_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    #: the prompt is a rendered chat template: tokenize it without adding special tokens again
    chat: bool = False
    #: its place in the engine's own queue, lower first (vLLM's convention): -1 for prefixq's
    #: priority high, 0 normal, 1 low (a worker admits by priority, and so does its engine)
    priority: int = 0


@dataclass(slots=True)
class EngineOutput:
    """The finished output of one request: choice 0 in ``text``/``token_ids``/``finish_reason``;
    ``choices`` holds all ``n`` choices (with logprobs when asked for) when the request asked for
    ``n`` > 1 or for logprobs, else it is empty."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    #: epoch seconds of the first output token (0.0 if the engine cannot tell)
    first_token: float = 0.0
    choices: list[Choice] = field(default_factory=list)

    def apply(self, res: Result) -> None:
        """Copy this output into the request's result record (``output_tokens`` counts the tokens
        of every choice, as OpenAI's ``usage.completion_tokens`` does)."""
        res.text, res.token_ids, res.finish_reason = self.text, self.token_ids, self.finish_reason
        res.prompt_tokens, res.cached_tokens = self.prompt_tokens, self.cached_tokens
        res.choices = self.choices
        res.output_tokens = (
            sum(len(c.token_ids) for c in self.choices) if self.choices else len(self.token_ids)
        )
        res.timings.first_token = self.first_token


@dataclass(slots=True)
class EmbedRequest:
    """One embeddings request as the engine sees it: its inputs (strings or token-id lists), each
    embedded on its own, and ``dimensions`` (None: the model's own)."""

    request_id: str
    inputs: list[str] | list[list[int]]
    dimensions: int | None = None
    priority: int = 0


@dataclass(slots=True)
class EmbedOutput:
    """The vectors of one embeddings request, one per input in order (little-endian float32
    bytes: `prefixq.core.embeddings.pack_vector`), and its inputs' tokens summed."""

    vectors: list[bytes]
    prompt_tokens: int
    cached_tokens: int = 0

    def apply(self, res: Result) -> None:
        """Copy this output into the request's result record."""
        res.embeddings = self.vectors
        res.prompt_tokens, res.cached_tokens = self.prompt_tokens, self.cached_tokens
        res.output_tokens = 0


class EngineSizes:
    """`Engine.max_num_seqs` and `Engine.block_size`, read-only, for an implementation to inherit:
    it sets ``_max_num_seqs`` and ``_block_size`` (when built, or once its engine has started)."""

    _max_num_seqs: int
    _block_size: int

    @property
    def max_num_seqs(self) -> int:
        return self._max_num_seqs

    @property
    def block_size(self) -> int:
        return self._block_size


class Engine(Protocol):
    """What the worker needs from an engine. Implementations raise `EngineError` for a failed
    request (`EngineRefused` when the engine refuses it as invalid, `EngineAborted` when `abort`
    stopped it) and `EngineDead` when no further request can succeed."""

    @property
    def max_num_seqs(self) -> int:
        """Requests the engine schedules at once (sets the worker's default in-flight window)."""
        ...

    @property
    def block_size(self) -> int:
        """Tokens per KV-cache block."""
        ...

    async def start(self) -> None:
        """Load the model and start serving; returns once requests can be sent."""
        ...

    async def generate(self, request: EngineRequest) -> EngineOutput:
        """Run one request to completion; raises `EngineAborted` if `abort` stopped it."""
        ...

    async def embed(self, request: EmbedRequest) -> EmbedOutput:
        """Embed each input of one request (an engine started to embed: ``Settings.task``);
        raises `EngineRefused` where the engine cannot (a generating engine, ``dimensions`` the
        model does not allow) and `EngineAborted` if `abort` stopped it."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request: its `generate` raises `EngineAborted` promptly (one not started yet
        raises it when it starts). A request that finished first keeps its output; aborting an
        unknown or finished request changes nothing."""
        ...

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        """The prompt string for a chat, through the model's chat template."""
        ...

    async def reset_prefix_cache(self) -> None:
        """Drop every cached prefix block."""
        ...

    async def close(self) -> None:
        """Stop the engine and release its resources."""
        ...
