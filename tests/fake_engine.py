"""A deterministic engine behind the `Engine` protocol, for fault tests of the worker loop.

Output = the prompt's words reversed, one token per word. Prompts steer faults:
``"fail:..."`` raises EngineError, ``"die:..."`` kills a ``lethal`` engine (EngineDead for it
and everything in flight), ``"sleep:S ..."`` takes S seconds (`abort` ends it at once with
EngineAborted). Never the only coverage of a
feature: the real engine has its own end-to-end tests.

`serve` runs the real `Worker` loop over it: the one place that builds such a worker, for the
`fake_worker` fixture (tests/helpers.py, in a thread) and tests/fault_worker.py (a process).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from prefixq.core.embeddings import pack_vector
from prefixq.core.errors import EngineAborted, EngineDead, EngineError, EngineRefused
from prefixq.core.settings import Settings
from prefixq.engine.protocol import (
    EmbedOutput,
    EmbedRequest,
    EngineOutput,
    EngineRequest,
    EngineSizes,
)
from prefixq.integrations.rq_callbacks import RqCompletion
from prefixq.integrations.webhooks import WebhookSender, configured
from prefixq.worker.worker import Worker


class FakeEngine(EngineSizes):
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
        #: (request id, engine priority) of every request, in the order they arrived
        self.priorities: list[tuple[str, int]] = []
        self.aborted: set[str] = set()
        self._abort_events: dict[str, asyncio.Event] = {}

    async def start(self) -> None:
        self.started = True

    async def generate(self, request: EngineRequest) -> EngineOutput:
        if self.dead.is_set():
            raise EngineDead("fake engine is dead")
        prompt = request.prompt or " ".join(map(str, request.prompt_token_ids or ()))
        self.seen.append(request.request_id)
        self.priorities.append((request.request_id, request.priority))
        if request.request_id in self.aborted:
            raise EngineAborted(f"request {request.request_id} was aborted before it started")
        abort = self._abort_events.setdefault(request.request_id, asyncio.Event())
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
                stop = asyncio.ensure_future(abort.wait())
                done, _ = await asyncio.wait(
                    [dead, stop], timeout=secs, return_when=asyncio.FIRST_COMPLETED
                )
                dead.cancel()
                stop.cancel()
                if dead in done:
                    raise EngineDead("fake engine died while serving")
                if stop in done:
                    raise EngineAborted(f"request {request.request_id} was aborted")
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
            self._abort_events.pop(request.request_id, None)

    async def embed(self, request: EmbedRequest) -> EmbedOutput:
        """One 4-dimensional vector per input: (characters or ids, first code, 1, the input's
        place); an input starting "fail:" refuses the request."""
        if self.dead.is_set():
            raise EngineDead("fake engine is dead")
        self.seen.append(request.request_id)
        vectors, tokens = [], 0
        for i, x in enumerate(request.inputs):
            if isinstance(x, str) and x.startswith("fail:"):
                raise EngineRefused("fake engine refused: " + x[5:])
            first = ord(x[0]) if isinstance(x, str) else x[0]
            vectors.append(pack_vector([float(len(x)), float(first), 1.0, float(i)]))
            tokens += len(x.split()) if isinstance(x, str) else len(x)
        return EmbedOutput(vectors=vectors, prompt_tokens=tokens)

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)
        event = self._abort_events.get(request_id)
        if event is not None:
            event.set()

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        return " ".join(f"{m['role']}: {m['content']}" for m in messages)

    async def reset_prefix_cache(self) -> None:
        pass

    async def close(self) -> None:
        self.closed = True


async def serve(
    settings: Settings,
    shard: int = 0,
    engine: FakeEngine | None = None,
    *,
    name: str = "",
    wrap: Callable[[Worker], AbstractAsyncContextManager[Any]] | None = None,
    on_worker: Callable[[Worker, asyncio.AbstractEventLoop], None] | None = None,
    hand_over: bool = False,
) -> int:
    """Run the real `Worker` loop of ``shard`` over ``engine`` (a new FakeEngine by default)
    until it stops; its exit code. ``wrap``: an async context manager around the run (a metrics
    exporter); ``on_worker`` is called with the worker and its loop once built (and wrapped),
    before it runs (tests/fault_worker.py hands it to `WorkerSignals.serve`, as `prefixq worker`
    does); ``hand_over``: as ``prefixq worker --hand-over``."""
    hooks = [WebhookSender(settings)] if configured(settings) else []
    w = Worker(
        settings,
        shard,
        engine if engine is not None else FakeEngine(),
        name=name,
        # as `prefixq worker` registers them
        middleware=[RqCompletion(settings), *hooks],
        hand_over=hand_over,
    )
    loop = asyncio.get_running_loop()
    if wrap is None:
        if on_worker is not None:
            on_worker(w, loop)
        return await w.run()
    async with wrap(w):
        if on_worker is not None:
            on_worker(w, loop)
        return await w.run()


class DocCounting(FakeEngine):
    """Counts the distinct documents (a prompt's first word ``doc...``; a request without one
    stands for itself) inside `generate` at once: ``peak_docs``."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.docs: dict[str, int] = {}
        self.peak_docs = 0

    async def generate(self, request: EngineRequest) -> EngineOutput:
        words = (request.prompt or "").split()
        doc = next((w for w in words if w.startswith("doc")), request.request_id)
        self.docs[doc] = self.docs.get(doc, 0) + 1
        self.peak_docs = max(self.peak_docs, len(self.docs))
        try:
            return await super().generate(request)
        finally:
            self.docs[doc] -= 1
            if not self.docs[doc]:
                del self.docs[doc]
