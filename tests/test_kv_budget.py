"""The KV budget (worker/kv_budget.py): the distinct prefixes of the requests inside the engine
held to a share of its cache, on its own (asyncio, no I/O) and in a fake-engine worker against a
real redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from fake_engine import DocCounting
from helpers import budget_entry, queued_entries
from prefixq.client import Producer, results
from prefixq.core import wire
from prefixq.core.entries import Entry
from prefixq.core.errors import ConfigError
from prefixq.core.settings import DEFAULT_KV_HISTORY, Settings
from prefixq.worker.kv_budget import KvBudget
from prefixq.worker.kv_sizing import HISTORY_TRUST, MIN_INFLIGHT_SHARE, pass_window_for, share_for


class _Run:
    """Requests holding ``budget`` until released, and the order they got in."""

    def __init__(self, budget: KvBudget) -> None:
        self.budget = budget
        self.inside: list[str] = []
        self.release: dict[str, asyncio.Event] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, name: str, e: Entry, priority: int = 0) -> None:
        self.release[name] = asyncio.Event()

        async def go() -> None:
            async with self.budget.hold(e, priority):
                self.inside.append(name)
                await self.release[name].wait()

        self.tasks[name] = asyncio.create_task(go())

    async def done(self, name: str) -> None:
        self.release[name].set()
        await self.tasks[name]
        await asyncio.sleep(0)


def test_groups_fit_the_budget_and_the_same_groups_requests_go_at_once() -> None:
    async def go() -> None:
        b = KvBudget(0.5, 400)  # room for two groups of 100
        run = _Run(b)
        run.start("a1", budget_entry(1))
        run.start("b1", budget_entry(2))
        run.start("c1", budget_entry(3))  # a third group: waits
        run.start("a2", budget_entry(1))  # group 1 is inside: goes, although c waits
        await asyncio.sleep(0)
        assert run.inside == ["a1", "b1", "a2"]
        assert b.used == 200 and b.waiting == 1 and b.held == 1
        await run.done("a1")
        assert run.inside == ["a1", "b1", "a2"]  # a2 still holds group 1
        await run.done("a2")
        assert run.inside[-1] == "c1" and b.used == 200
        await run.done("b1")
        await run.done("c1")
        assert b.used == 0 and b.peak == 200 and not b._inside

    asyncio.run(go())


def test_waiting_groups_go_in_priority_then_arrival_order_each_with_all_its_requests() -> None:
    async def go() -> None:
        b = KvBudget(0.5, 200)  # one group of 100 at a time
        run = _Run(b)
        run.start("x", budget_entry(9))
        run.start("n1", budget_entry(1), priority=5)
        run.start("n2", budget_entry(2), priority=5)
        run.start("h1", budget_entry(3), priority=1)  # a higher band, arriving last
        run.start("n1b", budget_entry(1), priority=5)  # joins group 1's wait
        run.start("h1b", budget_entry(3), priority=1)
        await asyncio.sleep(0)
        assert run.inside == ["x"]
        await run.done("x")
        assert run.inside == ["x", "h1", "h1b"]
        await run.done("h1")
        await run.done("h1b")
        assert run.inside[3:] == ["n1", "n1b"]
        await run.done("n1")
        await run.done("n1b")
        assert run.inside[5:] == ["n2"]
        await run.done("n2")

    asyncio.run(go())


def test_a_group_larger_than_the_budget_goes_alone_and_no_group_means_the_request_itself() -> None:
    async def go() -> None:
        b = KvBudget(0.1, 1000)  # 100 tokens
        run = _Run(b)
        run.start("big", budget_entry(1, tokens=900))  # the engine is empty: it goes
        # no group: its own tokens; it waits, a group being inside
        run.start("lone", budget_entry(None, tokens=10, rid="lone"))
        await asyncio.sleep(0)
        assert run.inside == ["big"] and b.used == 900
        await run.done("big")
        assert run.inside == ["big", "lone"] and b.used == 10
        await run.done("lone")

    asyncio.run(go())


def test_the_smallest_share_is_the_strictest_budget_not_none() -> None:
    """A share whose tokens round down to 0 (1e-5 of 4,000) holds one group at a time; before,
    its capacity was 0, which means no budget, and every group went in at once."""

    async def go() -> None:
        b = KvBudget(1e-5, 4000)
        assert b.capacity == 1
        run = _Run(b)
        run.start("g1", budget_entry(1, tokens=100))
        run.start("g2", budget_entry(2, tokens=100, rid="g2"))
        await asyncio.sleep(0)
        assert run.inside == ["g1"]
        await run.done("g1")
        assert run.inside == ["g1", "g2"]
        await run.done("g2")

    asyncio.run(go())


def test_a_waiting_request_cancelled_leaves_nothing_behind_and_the_next_goes() -> None:
    async def go() -> None:
        b = KvBudget(0.5, 200)
        run = _Run(b)
        run.start("x", budget_entry(1))
        run.start("y", budget_entry(2))
        run.start("z", budget_entry(3))
        await asyncio.sleep(0)
        run.tasks["y"].cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run.tasks["y"]
        assert b.waiting == 1
        await run.done("x")
        assert run.inside == ["x", "z"]
        await run.done("z")
        assert b.used == 0 and b.waiting == 0 and not b._heap
        # let in, then cancelled before it ran: it leaves again
        run.start("p", budget_entry(4))
        run.start("q", budget_entry(5))
        await asyncio.sleep(0)
        run.release["p"].set()
        await asyncio.sleep(0)  # p leaves, q is let in: cancel q before it runs
        run.tasks["q"].cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run.tasks["q"]
        await run.tasks["p"]
        assert b.used == 0 and not b._inside

    asyncio.run(go())


def test_off_or_resized_to_off_lets_everything_in_and_the_window_follows_the_share() -> None:
    async def go() -> None:
        b = KvBudget(0.0, 1000)
        run = _Run(b)
        for g in range(20):
            run.start(f"g{g}", budget_entry(g))
        await asyncio.sleep(0)
        assert len(run.inside) == 20 and b.held == 0
        c = KvBudget(0.5, 200)
        run2 = _Run(c)
        for g in range(4):
            run2.start(f"g{g}", budget_entry(g))
        await asyncio.sleep(0)
        assert len(run2.inside) == 1
        c.resize(0.0)
        await asyncio.sleep(0)
        assert len(run2.inside) == 4
        for name in list(run.tasks):
            await run.done(name)
        for name in list(run2.tasks):
            await run2.done(name)

    asyncio.run(go())
    assert pass_window_for(0.1, 0.0) == 0.1
    assert pass_window_for(0.1, 0.5) == pytest.approx(HISTORY_TRUST * 0.5)
    assert pass_window_for(0.9, 0.5) == 0.9
    with pytest.raises(ConfigError, match="kv_inflight_share"):
        Settings(kv_inflight_share=1.0).validate()
    with pytest.raises(ConfigError, match="kv_inflight_share"):
        Settings(kv_inflight_share=-0.1).validate()


def test_a_history_in_tokens_is_the_same_tokens_on_any_cache_and_leaves_at_least_half() -> None:
    """``kv_history_tokens`` keeps that many tokens for the prefixes finished last whatever the
    cache's size (a share keeps a share): 32,768 of 131,072 is a budget of 0.75, of 262,144 one
    of 0.875, never less than `MIN_INFLIGHT_SHARE` (0.7, of 65,536); no budget while the cache's
    size is unknown. It is the default (32,768); a share set replaces it; both 0: no budget."""
    assert share_for(0.3, 0, 131072) == 0.3  # no history: the share as set
    assert share_for(0.3, 32768, 131072) == 0.3  # a share set replaces the history
    assert share_for(0.0, 0, 131072) == 0.0  # both off
    assert share_for(0.0, 32768, 131072) == pytest.approx(0.75)
    assert share_for(0.0, 32768, 262144) == pytest.approx(0.875)
    assert share_for(0.0, 32768, 65536) == MIN_INFLIGHT_SHARE == 0.7
    assert share_for(0.0, 32768, 0) == 0.0
    assert Settings().kv_history_tokens == DEFAULT_KV_HISTORY == 32768
    assert Settings().kv_inflight_share == 0.0
    with pytest.raises(ConfigError, match="kv_history_tokens"):
        Settings(kv_history_tokens=-1)
    # a share beside the default history is the share; beside another history, a clear error
    assert Settings(kv_inflight_share=0.5).kv_history_tokens == DEFAULT_KV_HISTORY
    assert Settings(kv_history_tokens=0, kv_inflight_share=0.5).kv_inflight_share == 0.5
    with pytest.raises(ConfigError, match="not both"):
        Settings(kv_history_tokens=16384, kv_inflight_share=0.5)


DOCS = [f"sleep:0.3 doc{d} " + f"the {d}th text of the corpus " * 20 for d in range(10)]


@pytest.mark.parametrize("budget", ["none", "share", "history", "default"])
def test_a_worker_keeps_the_distinct_prefixes_in_its_engine_within_the_budget(
    budget: str,
    make_settings: Callable[..., Settings],
    r: redis.Redis,
    fake_worker: Callable[..., Any],
) -> None:
    """A worker whose window holds the whole burst (10 documents x 3 questions) hands it all to
    its engine without a budget; with ``kv_inflight_share`` 0.5 of a cache of 6 documents, at
    most 3 documents are inside at once, each document's questions go in together, and every
    result comes; the same with ``kv_history_tokens`` of one document in a cache of four (those
    inside take the rest); by default (32,768 tokens kept, more than this cache: the floor, 0.7 of
    6 documents) at most 4."""
    s = make_settings(prefix_store_min_chars=16, kv_inflight_share=0.5 if budget == "share" else 0)
    if budget == "none":
        s = s.replace(kv_history_tokens=0)
    reqs = [
        {"id": f"k-d{d}-q{q}", "prefix": DOCS[d], "prompt": f" question {q}?"}
        for d in range(10)
        for q in range(3)
    ]
    burst = asyncio.run(Producer(s).asubmit(reqs, order="grouped"))
    engine = DocCounting(max_num_seqs=64)
    tokens = max(
        e.work + e.predicted_cached
        for e in (Entry.from_wire(wire.decode(f[b"d"])) for _, f in queued_entries(r, s))
    )
    engine.kv_tokens = 6 * tokens  # type: ignore[attr-defined]  # the budget: 3 documents
    if budget == "history":  # a cache of 4 documents keeping 1: the budget is 3 again
        engine.kv_tokens = 4 * tokens  # type: ignore[attr-defined]
        s = s.replace(kv_history_tokens=tokens)
    t0 = time.monotonic()
    with fake_worker(s, engine=engine):
        st = results.wait(burst, s, timeout=60)
        took = time.monotonic() - t0
    assert st.failed == 0 and st.done == 30
    got = {x.id: x for x in results.collect(burst, s)}
    assert all(got[f"k-d{d}-q{q}"].error is None for d in range(10) for q in range(3))
    if budget == "default":
        assert engine.peak_docs <= 4, engine.peak_docs
        assert took >= 3 * 0.3, took  # ten documents, at most four at a time
    elif budget != "none":
        assert engine.peak_docs <= 3, engine.peak_docs
        assert took >= 3 * 0.3, took  # ten documents, at most three at a time
    else:
        assert engine.peak_docs == 10  # the whole burst at once: the test can tell
