"""The shared pass for analyses that ask a few documents twice and most once (client/shared_pass.py:
a burst with shared groups and long prefixes used once beside them walks all of them in the
content order): against a real redis-server, a fake-engine worker and the session's real vLLM
CPU workers."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from typing import Any

import redis

from helpers import wait_until
from pass_helpers import (
    content_order,
    engine_for_window,
    enqueued,
    key_of,
    publish_window,
    published,
    window_after,
)
from prefixq.client import Producer, results
from prefixq.core import wire
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings

DOCS = [f"document {d}: " + f"the {d}th text of the mixed corpus " * 20 for d in range(16)]


def _mixed(
    name: str, docs: Sequence[int], twice: set[int], seed: int, texts: Sequence[str] = DOCS
) -> list[dict[str, Any]]:
    """One question about each of ``docs``, two about those in ``twice``, shuffled."""
    reqs = [
        {"id": f"{name}-d{d}-q{q}", "prefix": texts[d], "prompt": f" {name} {q}?"}
        for d in docs
        for q in range(1 + (d in twice))
    ]
    random.Random(seed).shuffle(reqs)
    return reqs


def _doc_of(request_id: str) -> int:
    return int(request_id.split("-d")[1].split("-")[0])


def _walk(ids: Sequence[str]) -> list[int]:
    """The documents of ``ids`` in the order they first come; a document's requests together."""
    docs = [_doc_of(x) for x in ids]
    firsts = list(dict.fromkeys(docs))
    assert docs == [d for d in firsts for _ in range(docs.count(d))], docs
    return firsts


def test_a_mixed_burst_walks_all_its_documents_in_content_order_and_keeps_only_its_groups(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Given a burst that asks three documents twice and thirteen once, shuffled, when it is
    submitted (no pass published), then all sixteen documents are enqueued in their content
    order, each document's requests together (before: the groups in that order, the lone
    requests where the shuffle put them); the corpus order and the shard hints hold its three
    groups, not its lone documents. A second such analysis, other documents twice, walks the
    same order."""
    s = make_settings(prefix_store_min_chars=16)
    keys = Keys(s.namespace)
    docs = list(range(16))
    want = content_order(DOCS, docs)
    first = asyncio.run(Producer(s).asubmit(_mixed("a", docs, {2, 5, 11}, 1)))
    assert _walk([e.id for e in enqueued(r, s, first)]) == want
    placed = {k for k in r.hkeys(keys.pass_order) if k != b"n"}
    assert placed == {str(key_of(DOCS[d])).encode() for d in (2, 5, 11)}
    assert set(r.hkeys(keys.pass_shards)) == placed
    second = asyncio.run(Producer(s).asubmit(_mixed("b", docs, {0, 7, 9, 14}, 2)))
    assert _walk([e.id for e in enqueued(r, s, second)]) == want


def test_a_mixed_burst_starts_where_the_pass_is_on_each_shard(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Given an earlier mixed analysis placed on two shards and a window on shard 0 holding
    the 7th and 8th documents of the content order, a second mixed analysis starts there and
    wraps around, on each shard; garbage windows are no pass, never a refused burst."""
    s = make_settings(prefix_store_min_chars=16, shards=2)
    keys = Keys(s.namespace)
    docs = list(range(16))
    order = content_order(DOCS, docs)
    asyncio.run(Producer(s).asubmit(_mixed("a", docs, {1, 4, 12}, 3)))
    publish_window(r, keys, 0, wire.pack([key_of(DOCS[order[7]]), key_of(DOCS[order[6]])]))
    later = asyncio.run(Producer(s).asubmit(_mixed("b", docs, {3, 4, 10, 15}, 4)))
    parts = [_walk([e.id for e in enqueued(r, s, later, k)]) for k in range(2)]
    assert sorted(parts[0] + parts[1]) == docs
    want = order[6:] + order[:6]
    for part in parts:
        assert part == [d for d in want if d in set(part)]
    r.set(keys.pass_marks(0, "w"), b"\xc1 garbage")
    again = asyncio.run(Producer(s).asubmit(_mixed("c", docs, {2, 8}, 5)))
    parts = [_walk([e.id for e in enqueued(r, s, again, k)]) for k in range(2)]
    assert sorted(parts[0] + parts[1]) == docs


def test_a_worker_serves_a_mixed_analysis_after_another_from_the_pass(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: Callable[..., Any]
) -> None:
    """A real worker loop (fake engine of a stated KV cache) publishes the documents of a mixed
    analysis it finished, lone and grouped alike; a second mixed analysis then reaches the
    engine from the oldest of them around, in content order, every request once."""
    s = make_settings(prefix_store_min_chars=16, heartbeat_s=0.2, pass_window=0.5)
    docs = list(range(16))
    order = content_order(DOCS, docs)
    first = asyncio.run(Producer(s).asubmit(_mixed("a", docs, {2, 6, 13}, 6)))
    engine = engine_for_window(r, s, first, 4)
    with fake_worker(s, engine=engine):
        window = window_after(r, s, first)
        assert window == [key_of(DOCS[d]) for d in order[-len(window) :]]
        b_reqs = _mixed("b", docs, {0, 6, 9}, 7)
        b = asyncio.run(Producer(s).asubmit(b_reqs))
        assert results.wait(b, s, timeout=60).failed == 0
        seen = [b_reqs[int(x.split(":")[1])]["id"] for x in engine.seen if x.startswith(b + ":")]
        assert sorted(seen) == sorted(x["id"] for x in b_reqs)
        at = order.index(next(d for d in order if key_of(DOCS[d]) == window[0]))
        assert _walk(seen) == order[at:] + order[:at]


def test_the_session_workers_serve_a_mixed_analysis_beside_the_pass(
    engines: Any, r: redis.Redis
) -> None:
    """On the real vLLM CPU workers (two shards): after a mixed analysis, the shards' windows
    hold its documents, lone and grouped; a second one, other documents twice, walks its part
    on each shard in the content order from some point around; both complete."""
    s = engines.settings.replace(prefix_store_min_chars=16)
    keys = Keys(s.namespace)
    texts = [f"mixed document {d}. " + f"words of mixed text {d} " * 12 for d in range(6)]
    docs = list(range(6))
    order = content_order(texts, docs)
    a = [{**x, "max_tokens": 2} for x in _mixed("ma", docs, {1, 4}, 8, texts)]
    first = asyncio.run(Producer(s).asubmit(a))
    assert results.wait(first, s, timeout=300).failed == 0

    def seen() -> bool:
        return {key_of(texts[d]) for d in docs} <= published(r, keys, 2)

    wait_until(seen, 15, "the shards' windows holding the first analysis's documents")
    b = [{**x, "max_tokens": 2} for x in _mixed("mb", docs, {0, 3}, 9, texts)]
    later = asyncio.run(Producer(s).asubmit(b))
    got = [_walk([e.id for e in enqueued(r, s, later, k)]) for k in range(2)]
    assert sorted(d for part in got for d in part) == docs
    for part in got:
        mine = [d for d in order if d in set(part)]
        assert any(mine[i:] + mine[:i] == part for i in range(max(1, len(mine))))
    assert results.wait(later, s, timeout=300).failed == 0
