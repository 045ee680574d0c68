"""The KV budget's riders (worker/kv_budget.py): a group the engine holds — inside it, or finished
last and still cached (the shared pass's window) — lets its requests in at once, and the requests
waiting for the budget stay out of the worker's window (worker/worker.py `room`), so that a later
burst's questions about the document the engine holds reach it while it does. On its own
(asyncio) and in a fake-engine worker against a real redis-server."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from fake_engine import FakeEngine
from helpers import budget_entry, queued_entries
from prefixq.client import Producer, results
from prefixq.core import wire
from prefixq.core.entries import Entry
from prefixq.core.settings import Settings
from prefixq.engine.protocol import EngineOutput, EngineRequest
from prefixq.worker.kv_budget import KvBudget


def test_a_resident_group_goes_in_at_once_and_others_still_wait() -> None:
    async def go() -> None:
        b = KvBudget(0.5, 200)  # room for one group of 100
        b.resident = {7}
        inside: list[int] = []
        gate = asyncio.Event()

        async def hold(g: int) -> None:
            async with b.hold(budget_entry(g), 0):
                inside.append(g)
                await gate.wait()

        tasks = [asyncio.create_task(hold(g)) for g in (1, 2, 7)]
        await asyncio.sleep(0.01)
        assert inside == [1, 7]  # 2 waits for room; 7 is cached already: it loads nothing
        assert b.waiting == 1 and b.used == 200
        gate.set()
        await asyncio.gather(*tasks)
        assert sorted(inside) == [1, 2, 7] and b.used == 0 and b.waiting == 0

    asyncio.run(go())


class _Entries(FakeEngine):
    """Counts how often each document (a prompt's second word) enters the engine: a document
    whose requests are all gone from the engine and that comes back is loaded again."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.inside: dict[str, int] = {}
        self.entries: dict[str, int] = {}
        self.lock = threading.Lock()

    async def generate(self, request: EngineRequest) -> EngineOutput:
        words = (request.prompt or "").split()
        if len(words) < 2:  # the worker's warm-up
            return await super().generate(request)
        doc = words[1]
        with self.lock:
            if not self.inside.get(doc):
                self.entries[doc] = self.entries.get(doc, 0) + 1
            self.inside[doc] = self.inside.get(doc, 0) + 1
        try:
            return await super().generate(request)
        finally:
            with self.lock:
                self.inside[doc] -= 1


DOCS = [f"sleep:0.4 doc{d} " + f"the {d}th text of the corpus " * 20 for d in range(6)]


def test_a_later_bursts_questions_ride_with_the_document_the_engine_holds(
    make_settings: Callable[..., Settings],
    r: redis.Redis,
    fake_worker: Callable[..., Any],
) -> None:
    """Two tenants ask two questions each about the same six documents, the second 0.2 s after
    the first. The budget lets one document in at a time and the worker's window is 4: the
    first burst's next document waits for the budget in two of those places. Those do not
    count against the window, so the second burst's questions about the document inside are
    read and go in with the first's: every document enters the engine once (a waiting request
    that filled the window kept them out, and each document came back for them)."""
    s = make_settings(prefix_store_min_chars=16, kv_inflight_share=0.5, max_inflight=4)
    engine = _Entries(max_num_seqs=64)

    def burst(tenant: str) -> list[dict[str, Any]]:
        return [
            {"id": f"{tenant}-d{d}-q{q}", "prefix": DOCS[d], "prompt": f" question {q}?"}
            for d in range(6)
            for q in range(2)
        ]

    first = asyncio.run(Producer(s).asubmit(burst("a"), order="grouped", tenant="a"))
    tokens = max(
        e.work + e.predicted_cached
        for e in (Entry.from_wire(wire.decode(f[b"d"])) for _, f in queued_entries(r, s))
    )
    engine.kv_tokens = 2 * tokens  # type: ignore[attr-defined]  # the budget: one document
    with fake_worker(s, engine=engine):
        time.sleep(0.2)
        second = asyncio.run(Producer(s).asubmit(burst("b"), order="grouped", tenant="b"))
        for b in (first, second):
            st = results.wait(b, s, timeout=60)
            assert st.done == 12 and st.failed == 0
    assert sorted(engine.entries) == [f"doc{d}" for d in range(6)]
    assert sum(engine.entries.values()) <= 7, engine.entries  # the first document's may differ
