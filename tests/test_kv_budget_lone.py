"""Requests of their own under the KV budget (worker/kv_budget.py): a request whose prefix no other
request of its burst shares carries no group, the head's included (client/encoding.py), and the
budget holds it back only while a group is inside the engine, whose history the rest of the cache
keeps. Held to the budget regardless, a GPU burst of 64 documents of their own ran 1.3% slower
than without it (docs/BENCHMARKS.md, 2026-12-06 (night)): there was nothing to keep room for."""

from __future__ import annotations

import asyncio
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
from prefixq.core.settings import Settings
from prefixq.worker.kv_budget import KvBudget

DOCS = [f"sleep:0.3 doc{d} " + f"the {d}th text of the corpus " * 20 for d in range(10)]


def _lone(name: str) -> Entry:
    """A request of its own named ``lN`` (its index N: its key)."""
    return budget_entry(None, rid=name, index=int(name[1:]))


def test_lone_requests_pass_a_full_budget_until_a_group_is_inside_then_wait_in_order() -> None:
    """Requests without a group go in beyond the budget while no group is inside (and are
    counted); a group that comes then waits for room as always, and a lone request behind it
    waits its turn; once the group is inside, a lone request waits for room like any other; with
    the group gone and nothing waiting, lone requests pass again."""

    async def go() -> None:
        b = KvBudget(0.5, 400)  # 200 tokens: two of 100
        inside: list[str] = []
        release = {n: asyncio.Event() for n in ("l1", "l2", "l3", "g", "l4", "l5", "l6")}

        async def hold(name: str, e: Entry) -> None:
            async with b.hold(e, 0):
                inside.append(name)
                await release[name].wait()

        tasks = {}
        for name in ("l1", "l2", "l3"):
            tasks[name] = asyncio.create_task(hold(name, _lone(name)))
        await asyncio.sleep(0)
        assert inside == ["l1", "l2", "l3"] and b.used == 300 and b.held == 0
        tasks["g"] = asyncio.create_task(hold("g", budget_entry(7)))
        tasks["l4"] = asyncio.create_task(hold("l4", _lone("l4")))
        await asyncio.sleep(0)
        assert inside == ["l1", "l2", "l3"] and b.waiting == 2  # the group, then l4 behind it
        for name in ("l1", "l2"):
            release[name].set()
            await tasks[name]
        await asyncio.sleep(0)
        assert inside[3:] == ["g"] and b.used == 200  # l4 waits: a group is inside, no room
        tasks["l5"] = asyncio.create_task(hold("l5", _lone("l5")))
        await asyncio.sleep(0)
        assert inside[3:] == ["g"] and b.waiting == 2
        release["l3"].set()
        await tasks["l3"]
        await asyncio.sleep(0)
        assert inside[4:] == ["l4"]  # room for one: the first in line
        release["g"].set()
        await tasks["g"]
        await asyncio.sleep(0)
        assert inside[5:] == ["l5"] and b.waiting == 0  # no group inside: nothing held back
        tasks["l6"] = asyncio.create_task(hold("l6", _lone("l6")))
        await asyncio.sleep(0)
        assert inside[6:] == ["l6"] and b.used == 300
        for name in ("l4", "l5", "l6"):
            release[name].set()
            await tasks[name]
        assert b.used == 0 and not b._inside and b._groups == 0

    asyncio.run(go())


def test_only_prefixes_that_other_requests_of_the_burst_share_carry_a_group_head_included(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """A burst of documents asked once each, then one asked twice each: the first's entries
    (its first four, sent before the rest, too) carry no group; every one of the second's does,
    a document's questions the same."""
    s = make_settings(prefix_store_min_chars=16)
    lone = [{"id": f"o{d}", "prefix": DOCS[d], "prompt": " q?"} for d in range(10)]
    asyncio.run(Producer(s).asubmit(lone, order="grouped"))
    got = [Entry.from_wire(wire.decode(f[b"d"])) for _, f in queued_entries(r, s)]
    assert len(got) == 10 and all(e.group is None and e.ancestor is None for e in got), got
    r.flushdb()
    twice = [
        {"id": f"t{d}-{q}", "prefix": DOCS[d], "prompt": f" q{q}?"}
        for d in range(10)
        for q in (0, 1)
    ]
    asyncio.run(Producer(s).asubmit(twice, order="grouped"))
    by_doc: dict[str, set[int | None]] = {}
    for _, f in queued_entries(r, s):
        e = Entry.from_wire(wire.decode(f[b"d"]))
        by_doc.setdefault(e.id.split("-")[0], set()).add(e.group)
    assert len(by_doc) == 10
    assert all(len(g) == 1 and None not in g for g in by_doc.values()), by_doc
    assert len({g for gs in by_doc.values() for g in gs}) == 10


@pytest.mark.parametrize("shared", [False, True])
def test_a_worker_with_the_default_budget_runs_lone_documents_as_without_one(
    shared: bool,
    make_settings: Callable[..., Settings],
    r: redis.Redis,
    fake_worker: Callable[..., Any],
) -> None:
    """In a cache of 6 documents (the default budget: 0.7 of it, 4 documents), 10 documents
    asked once each all go into the engine at once, and nothing waits for room; asked three
    times each, at most 4 documents are inside at once (the test can tell)."""
    s = make_settings(prefix_store_min_chars=16)
    questions = 3 if shared else 1
    reqs = [
        {"id": f"k-d{d}-q{q}", "prefix": DOCS[d], "prompt": f" question {q}?"}
        for d in range(10)
        for q in range(questions)
    ]
    burst = asyncio.run(Producer(s).asubmit(reqs, order="grouped"))
    engine = DocCounting(max_num_seqs=64)
    tokens = max(
        e.work + e.predicted_cached
        for e in (Entry.from_wire(wire.decode(f[b"d"])) for _, f in queued_entries(r, s))
    )
    engine.kv_tokens = 6 * tokens  # type: ignore[attr-defined]
    t0 = time.monotonic()
    with fake_worker(s, engine=engine):
        st = results.wait(burst, s, timeout=60)
        took = time.monotonic() - t0
    assert st.failed == 0 and st.done == len(reqs)
    if shared:
        assert engine.peak_docs <= 4, engine.peak_docs
        assert took >= 3 * 0.3, took
    else:
        assert engine.peak_docs == 10, engine.peak_docs
