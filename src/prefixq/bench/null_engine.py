"""A zero-cost engine behind the `Engine` protocol, for measuring the data plane alone.

`NullEngine` answers every request at once (or after ``hold_s``, to keep requests in flight as a
real engine does) with one output token, so what a worker spends per request is the pipeline's
own cost: reading, decoding, scheduling, recording (scripts/dataplane.py measures it).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prefixq.core.errors import EngineAborted
from prefixq.engine.protocol import (
    EmbedOutput,
    EmbedRequest,
    EngineOutput,
    EngineRequest,
    EngineSizes,
)


class NullEngine(EngineSizes):
    """Answers at once: prompt tokens are counted as 4 characters each (or the ids given)."""

    def __init__(self, max_num_seqs: int = 256, block_size: int = 16, hold_s: float = 0.0) -> None:
        self._max_num_seqs = max_num_seqs
        self._block_size = block_size
        self.hold_s = hold_s
        self._aborted: set[str] = set()

    async def start(self) -> None:
        pass

    async def generate(self, request: EngineRequest) -> EngineOutput:
        if self.hold_s:
            await asyncio.sleep(self.hold_s)
        if request.request_id in self._aborted:
            self._aborted.discard(request.request_id)
            raise EngineAborted(f"request {request.request_id} was aborted")
        ids = request.prompt_token_ids
        prompt_tokens = len(ids) if ids is not None else len(request.prompt or "") // 4
        return EngineOutput(
            text="x",
            token_ids=[0],
            finish_reason="length",
            prompt_tokens=prompt_tokens,
            cached_tokens=0,
            first_token=time.time(),
        )

    async def embed(self, request: EmbedRequest) -> EmbedOutput:
        """One zero vector of 8 dimensions per input."""
        vectors = [bytes(32) for _ in request.inputs]
        return EmbedOutput(vectors=vectors, prompt_tokens=len(request.inputs))

    async def abort(self, request_id: str) -> None:
        if self.hold_s:
            self._aborted.add(request_id)

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in messages)

    async def reset_prefix_cache(self) -> None:
        pass

    async def close(self) -> None:
        pass
