"""The shared pass's window that follows what the engine runs (``pass_running``,
worker/shared_pass.py `PassMarks.published`): the prefixes of the requests the engine most likely
runs now, after those it finished last cut to what they leave of its cache. Units, then a real
worker loop (fake engine of a stated KV cache) against a real redis-server."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import redis

from fake_engine import FakeEngine
from helpers import wait_until
from pass_helpers import content_order, enqueued, key_of
from prefixq.client import Producer, results
from prefixq.core import wire
from prefixq.core.entries import Entry, to_wire
from prefixq.core.keys import Keys
from prefixq.core.records import Request
from prefixq.core.settings import Settings
from prefixq.worker.shared_pass import PassMarks


def _entry(key: int, tokens: int, *, lone: bool = False) -> Entry:
    """A request whose prefix has pass key ``key`` (a group's, or with ``lone`` a lone
    request's) and ``tokens`` prompt tokens."""
    d = to_wire(
        Request(id=f"r{key}", prompt="p"),
        burst="b",
        index=0,
        shard=0,
        enqueued=1.0,
        work=tokens,
        predicted_cached=0,
        prefix=None,
        prefix_ref=None,
        own={"p": "p"},
    )
    e = Entry.from_wire(d)
    if lone:
        e.lone_key = key
    else:
        e.group = key
    return e


def test_the_window_holds_what_the_engine_serves_first_within_its_cache() -> None:
    """Of the requests inside the engine, the prefixes it serves first (lower engine priority,
    then arrival) as many as its cache holds, each once; a lone request's prefix as a group's.
    Off (the default), requests inside change nothing."""
    marks = PassMarks("k", 0.5, kv_tokens=1000, running=True)
    marks.enter("r1", _entry(1, 300), 5)
    marks.enter("r2", _entry(2, 300), 0)  # served before r1
    marks.enter("r3", _entry(2, 300), 0)  # the same prefix: once
    marks.enter("r4", _entry(3, 300, lone=True), 5)  # after r1: it came later
    marks.enter("r5", _entry(4, 300), 5)  # no room left
    assert marks.held() == {2: 300, 1: 300, 3: 300}
    assert marks.published() == [2, 1, 3]
    marks.leave("r2")
    assert 2 in marks.held()  # r3 runs on
    marks.leave("r3")
    assert marks.held() == {1: 300, 3: 300, 4: 300}
    off = PassMarks("k", 0.5, kv_tokens=1000)
    off.enter("r1", _entry(1, 300), 0)
    assert off.held() == {} and off.published() == []


def test_finished_prefixes_keep_only_what_the_running_ones_leave_of_the_cache() -> None:
    """The groups finished last stay in the window (oldest first, before the running ones) as
    long as they fit both the window and what the running prefixes leave of the cache: on an
    engine whose running batch fills its cache, none (vLLM evicts what was freed first)."""
    marks = PassMarks("k", 0.5, kv_tokens=1000, running=True)
    for k in (10, 11, 12):
        marks.note(_entry(k, 200))
    assert marks.published() == [11, 12]  # the window: 500 tokens
    marks.enter("a", _entry(1, 300), 0)
    marks.enter("b", _entry(2, 350), 0)
    assert marks.published() == [12, 1, 2]  # 350 left of the cache: the newest only
    marks.enter("c", _entry(3, 300), 0)
    assert marks.published() == [1, 2, 3]  # 50 left: no finished group fits
    marks.note(_entry(2, 350))  # finished, and runs on in another request: counted once
    assert marks.published() == [1, 2, 3]
    unknown = PassMarks("k", 0.5, running=True)  # a cache it cannot size: what it finished
    unknown.enter("a", _entry(1, 300), 0)
    unknown.note(_entry(10, 200))
    assert unknown.published() == [10]


DOCS = [f"sleep:2.0 document {d}: " + f"the {d}th text of the corpus " * 20 for d in range(12)]


def _lone(name: str, seed: int) -> list[dict[str, Any]]:
    reqs = [{"id": f"{name}-d{d}", "prefix": DOCS[d], "prompt": f" {name}?"} for d in range(12)]
    random.Random(seed).shuffle(reqs)
    return reqs


def _published(r: redis.Redis, keys: Keys) -> list[int]:
    raw = r.get(keys.pass_marks(0, "fw"))
    return list(wire.unpack(raw)) if raw else []


def test_a_joining_analysis_starts_at_the_oldest_document_the_engine_runs_not_one_it_evicts(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: Callable[..., Any]
) -> None:
    """Given a worker whose engine's cache holds four documents and runs four requests at once
    (one question per document, two seconds each), when its second four run, the window holds
    them and none of the four it finished (their blocks are what the running ones take next),
    so a second analysis over the same documents starts at the oldest of those it runs and
    wraps around (with the window of what it finished it started two documents back)."""
    s = make_settings(
        prefix_store_min_chars=16,
        heartbeat_s=0.2,
        pass_window=0.5,
        pass_running=True,
        max_inflight=4,
        kv_history_tokens=0,
    )
    keys = Keys(s.namespace)
    order = content_order(DOCS, range(12))
    first = asyncio.run(Producer(s).asubmit(_lone("a", 1)))
    tokens = max(e.work + e.predicted_cached for e in enqueued(r, s, first))
    engine = FakeEngine(max_num_seqs=4)
    engine.kv_tokens = 4 * tokens  # type: ignore[attr-defined]
    running = [key_of(DOCS[d]) for d in order[4:8]]
    with fake_worker(s, engine=engine):
        wait_until(lambda: sum(x.startswith(first) for x in engine.seen) == 8, 15, "4 more inside")
        wait_until(lambda: _published(r, keys) == running, 5, "the window of the running four")
        b_reqs = _lone("b", 2)
        later = asyncio.run(Producer(s).asubmit(b_reqs))
        got = [int(e.id.split("-d")[1]) for e in enqueued(r, s, later)]
        assert got == order[4:] + order[:4]
        assert results.wait(first, s, timeout=60).failed == 0
        assert results.wait(later, s, timeout=60).failed == 0
