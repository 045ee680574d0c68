"""A deterministic engine behind the `Engine` protocol, for fault tests of the worker loop.

Output = the prompt's words reversed, one token per word. Prompts steer faults:
``"fail:..."`` raises EngineError, ``"die:..."`` kills a ``lethal`` engine (EngineDead for it
and everything in flight), ``"sleep:S ..."`` takes S seconds. Never the only coverage of a
feature: the real engine has its own end-to-end tests.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prefixq.consumers.engine import EngineOutput, EngineRequest
from prefixq.errors import EngineDead, EngineError


class FakeEngine:
    def __init__(self, max_num_seqs: int = 4, block_size: int = 16, *, lethal: bool = True) -> None:
        self.lethal = lethal
        self._max_num_seqs = max_num_seqs
        self._block_size = block_size
        self.started = False
        self.closed = False
        self.dead = asyncio.Event()
        self.active = 0
        self.peak_active = 0
        self.seen: list[str] = []

    @property
    def max_num_seqs(self) -> int:
        return self._max_num_seqs

    @property
    def block_size(self) -> int:
        return self._block_size

    async def start(self) -> None:
        self.started = True

    async def generate(self, request: EngineRequest) -> EngineOutput:
        if self.dead.is_set():
            raise EngineDead("fake engine is dead")
        prompt = request.prompt or " ".join(map(str, request.prompt_token_ids or ()))
        self.seen.append(request.request_id)
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)
        try:
            if prompt.startswith("fail:"):
                raise EngineError("fake engine refused: " + prompt[5:])
            if prompt.startswith("die:") and self.lethal:
                self.dead.set()
                raise EngineDead("fake engine died")
            if prompt.startswith("sleep:"):
                secs = float(prompt.split()[0][6:])
                dead = asyncio.ensure_future(self.dead.wait())
                done, _ = await asyncio.wait([dead], timeout=secs)
                dead.cancel()
                if done:
                    raise EngineDead("fake engine died while serving")
            words = prompt.split()
            first = time.time()
            n = min(len(words), int(request.sampling.get("max_tokens", 256)))
            return EngineOutput(
                text=" ".join(reversed(words))[: 10 * n],
                token_ids=list(range(n)),
                finish_reason="stop",
                prompt_tokens=len(words),
                cached_tokens=0,
                first_token=first,
            )
        finally:
            self.active -= 1

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        return " ".join(f"{m['role']}: {m['content']}" for m in messages)

    async def reset_prefix_cache(self) -> None:
        pass

    async def close(self) -> None:
        self.closed = True
