"""Shared ancestors (affinity/ancestors.py, worker/kv_budget.py): the producer marks each prefix
group's entries with the part of its prefix other groups of the burst share (documents under one
system prompt), and the worker's KV budget counts that part once while any group under it is
inside, instead of once per group: with it counted per group, a two-level prefix tree ran 10%
slower under the budget (simulated, docs/BENCHMARKS.md 2026-12-06 (later))."""

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

SYSTEMS = [f"You are assistant {s}. " + f"rule {s} of the house, kept always. " * 60 for s in "AB"]
DOCS = [f"doc{d} " + f"the {d}th text of the corpus, told at length. " * 30 for d in range(12)]


def _burst(docs: range, systems: int = 2, questions: int = 2, sleep: str = "") -> list[dict]:
    return [
        {
            "id": f"s{d % systems}-d{d}-q{q}",
            "prefix": sleep + SYSTEMS[d % systems] + DOCS[d],
            "prompt": f" question {q}?",
        }
        for d in docs
        for q in range(questions)
    ]


def _entries(r: redis.Redis, s: Settings) -> dict[str, Entry]:
    out = {}
    for _, f in queued_entries(r, s):
        e = Entry.from_wire(wire.decode(f[b"d"]))
        out[e.id] = e
    return out


def test_the_producer_marks_the_groups_under_one_system_prompt_with_its_shared_part(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Documents under one system prompt share an ancestor (one key, the prompt's tokens rounded
    down to a checkpoint, less than the group's prompt); those under another system prompt
    another; every question of a document the same. The burst's groups go in their content
    order (client/shared_pass.py), which puts the documents under one prompt together (their
    first block is the prompt's), so even its first chunk (4 requests: two documents under one
    prompt) carries it (in their order of first appearance, one document under each prompt,
    that chunk carried none). A burst of documents that share nothing above themselves has
    none."""
    s = make_settings(prefix_store_min_chars=16)
    asyncio.run(Producer(s).asubmit(_burst(range(8)), order="grouped"))
    got = _entries(r, s)
    assert len(got) == 16
    by_system: dict[int, set[tuple[int | None, int]]] = {0: set(), 1: set()}
    by_doc: dict[str, set[int | None]] = {}
    for rid, e in got.items():
        assert e.group is not None, rid
        by_doc.setdefault(rid.split("-")[1], set()).add(e.ancestor)
        if e.ancestor is not None:
            assert 0 < e.ancestor_tokens < e.work + e.predicted_cached
            by_system[int(rid[1])].add((e.ancestor, e.ancestor_tokens))
    assert all(len(v) == 1 for v in by_doc.values()), by_doc  # a document's questions alike
    lacking = sorted(d for d, v in by_doc.items() if v == {None})
    assert lacking == [], lacking
    ((a0, t0),), ((a1, t1),) = by_system[0], by_system[1]
    assert a0 != a1 and t0 == t1  # two prompts of one length
    system_tokens = len(SYSTEMS[0]) / 4  # the character estimate's scale, roughly
    assert 0.5 * system_tokens < t0 <= 1.2 * system_tokens, (t0, system_tokens)
    r.flushdb()
    s2 = make_settings(prefix_store_min_chars=16)
    flat = [
        {"id": f"f{d}-q{q}", "prefix": DOCS[d], "prompt": f" q{q}?"}
        for d in range(6)
        for q in (0, 1)
    ]
    asyncio.run(Producer(s2).asubmit(flat, order="grouped"))
    assert all(e.ancestor is None and e.ancestor_tokens == 0 for e in _entries(r, s2).values())


def test_an_entrys_ancestor_is_a_hint_never_a_reason_to_refuse_it() -> None:
    """``sa`` round-trips; one of the wrong shape (not a pair, not 64-bit numbers, no tokens, a
    bool) is left out and the entry decodes as one without it."""
    from prefixq.core.entries import to_wire
    from prefixq.core.records import Request

    def entry(**kw: Any) -> dict[str, Any]:
        return to_wire(
            Request(id="x", prompt="p"), burst="b", index=0, shard=0, enqueued=1.0, work=5,
            predicted_cached=0, prefix=None, prefix_ref=None, own={"p": "p"}, group=7, **kw,
        )  # fmt: skip

    e = Entry.from_wire(wire.decode(wire.encode(entry(ancestor=(2**64 - 1, 300)))))
    assert (e.ancestor, e.ancestor_tokens) == (2**64 - 1, 300)
    for bad in ("x", [1], [1, 2, 3], [-1, 5], [1, 0], [True, 5], [1, "5"], [2**64, 5], {"a": 1}):
        d = entry()
        d["sa"] = bad
        e = Entry.from_wire(d)
        assert e.ancestor is None and e.ancestor_tokens == 0 and e.group == 7, bad


def test_the_budget_counts_a_shared_ancestor_once_while_any_group_under_it_is_inside() -> None:
    """Budget 10,000; groups of 6,000 tokens under one ancestor of 2,000: two go in together
    (2,000 + 2 x 4,000), a third waits, and goes when one leaves; the ancestor leaves ``used``
    with the last group under it. Without ancestors only one of them fits."""

    async def main() -> None:
        b = KvBudget(0.5, 20_000)
        assert b.capacity == 10_000
        events: list[str] = []
        release = {g: asyncio.Event() for g in (1, 2, 3, 4)}

        async def go(e: Entry) -> None:
            async with b.hold(e, 0):
                events.append(f"in {e.group}")
                await release[e.group or 0].wait()

        up = (99, 2000)
        tasks = [asyncio.create_task(go(budget_entry(g, 6000, up))) for g in (1, 2, 3)]
        await asyncio.sleep(0.01)
        assert events == ["in 1", "in 2"] and b.used == 10_000 and b.waiting == 1
        release[1].set()
        await asyncio.sleep(0.01)
        assert events == ["in 1", "in 2", "in 3"] and b.used == 10_000
        release[2].set()
        release[3].set()
        await asyncio.gather(*tasks)
        assert b.used == 0 and not b._ancestors and not b._up
        # the same groups without their ancestor: one at a time
        t = [asyncio.create_task(go(budget_entry(4, 6000, None)))]
        await asyncio.sleep(0.01)
        other = KvBudget(0.5, 20_000)
        async with other.hold(budget_entry(5, 6000, None), 0):
            assert not other._fits(5, other._cost(6000, None))
        release[4].set()
        await asyncio.gather(*t)
        assert b.peak == 10_000

    asyncio.run(main())


@pytest.mark.parametrize("ancestors", [True, False])
def test_a_worker_lets_in_as_many_documents_under_a_system_prompt_as_the_budget_holds(
    ancestors: bool,
    make_settings: Callable[..., Settings],
    r: redis.Redis,
    fake_worker: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Twelve documents under one system prompt, a budget of the system prompt and four
    documents: with the ancestor counted once, four documents run at once; counted with each
    document (a producer that sends no ancestor), fewer."""
    from prefixq.affinity.ancestors import Ancestry

    if not ancestors:
        monkeypatch.setattr(Ancestry, "mark", lambda self, items, *_: [(None, 0)] * len(items))
    s = make_settings(prefix_store_min_chars=16, kv_inflight_share=0.5)
    reqs = _burst(range(12), systems=1, sleep="sleep:0.3 ")
    burst = asyncio.run(Producer(s).asubmit(reqs, order="grouped"))
    entries = _entries(r, s)
    whole = max(x.work + x.predicted_cached for x in entries.values())
    if ancestors:
        up = {x.ancestor_tokens for x in entries.values()}
        assert len(up) == 1 and all(x.ancestor is not None for x in entries.values())
        (up_tokens,) = up
    else:
        assert all(x.ancestor is None for x in entries.values())
        up_tokens = 512  # as the other case finds: only the budget's size
    own = whole - up_tokens
    engine = DocCounting(max_num_seqs=64)
    # the budget (half the cache): the system prompt and four documents' own parts
    budget = up_tokens + 4 * own
    engine.kv_tokens = 2 * budget  # type: ignore[attr-defined]
    t0 = time.monotonic()
    with fake_worker(s, engine=engine):
        st = results.wait(burst, s, timeout=60)
    assert st.failed == 0 and st.done == 24, st
    assert time.monotonic() - t0 >= 3 * 0.3  # twelve documents, four at a time at most
    if ancestors:
        assert engine.peak_docs == 4, engine.peak_docs
    else:
        assert engine.peak_docs == budget // whole < 4, (engine.peak_docs, budget, whole)
