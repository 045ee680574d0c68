"""The shared pass for bursts that ask one question per document (client/shared_pass.py's
content order, `prefixq.core.entries.Entry.lone_key`): every such burst walks the documents in
their content order, starts where the workers' windows are in it, and keeps nothing in Redis;
against a real redis-server, a fake-engine worker and the session's real vLLM CPU workers."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import pytest
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
from prefixq.core.entries import Entry, WireError, to_wire
from prefixq.core.keys import Keys
from prefixq.core.records import Request
from prefixq.core.settings import Settings

DOCS = [f"document {d}: " + f"the {d}th text of the corpus " * 20 for d in range(16)]


def _lone(
    name: str, docs: list[int], seed: int, docs_text: list[str] = DOCS
) -> list[dict[str, Any]]:
    """One question about each of ``docs``, shuffled (as a user's burst comes)."""
    reqs = [{"id": f"{name}-d{d}", "prefix": docs_text[d], "prompt": f" {name}?"} for d in docs]
    random.Random(seed).shuffle(reqs)
    return reqs


def _doc_of(request_id: str) -> int:
    return int(request_id.split("-d")[1])


def test_a_lone_request_carries_its_prefix_pass_key_and_a_shared_one_its_group(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """A long prefix used once travels inline with its pass key (``lk``) and no group; one used
    twice is stored once and marks a group (``g``), no ``lk``; a short one carries neither."""
    s = make_settings(prefix_store_min_chars=16)
    reqs = [
        {"id": "a-d0", "prefix": DOCS[0], "prompt": " q?"},
        {"id": "b-d1", "prefix": DOCS[1], "prompt": " q1?"},
        {"id": "c-d1", "prefix": DOCS[1], "prompt": " q2?"},
        {"id": "d-short", "prefix": "tiny", "prompt": " q?"},
    ]
    burst = asyncio.run(Producer(s).asubmit(reqs, order="input"))
    by_id = {e.id: e for e in enqueued(r, s, burst)}
    assert by_id["a-d0"].lone_key == key_of(DOCS[0]) and by_id["a-d0"].group is None
    assert by_id["a-d0"].prefix is not None and by_id["a-d0"].prefix_ref is None
    for rid in ("b-d1", "c-d1"):
        assert by_id[rid].group == key_of(DOCS[1]) and by_id[rid].lone_key is None
    assert by_id["d-short"].lone_key is None and by_id["d-short"].group is None
    assert results.status(burst, s).total == 4


@pytest.mark.parametrize("bad", [-1, 1 << 64, True, b"12345678", "7", 1.5, [1]])
def test_a_malformed_lone_key_is_a_hint_left_out_never_a_refused_entry(bad: Any) -> None:
    d = to_wire(
        Request(id="x", prompt="p"),
        burst="b",
        index=0,
        shard=0,
        enqueued=1.0,
        work=1,
        predicted_cached=0,
        prefix=None,
        prefix_ref=None,
        own={"p": "p"},
        lone_key=5,
    )
    assert Entry.from_wire(d).lone_key == 5
    assert Entry.from_wire({**d, "lk": bad}).lone_key is None
    # a group wins over a lone key (an entry is one or the other)
    both = Entry.from_wire({**d, "g": 7, "lk": 5})
    assert (both.group, both.lone_key) == (7, None)
    with pytest.raises(WireError):  # the rest of the entry is still checked
        Entry.from_wire({**d, "lk": 5, "i": -1})


def test_lone_bursts_over_one_corpus_walk_it_in_one_content_order_and_keep_nothing_in_redis(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Without a pass published, bursts over the same documents shuffled differently enqueue
    them in one order, the documents' content order, whatever their own; a burst over part of
    them walks its part in that order. No corpus order or shard hint is kept for them.
    ``input`` order, and ``shared_pass`` off, keep the burst's own order."""
    s = make_settings(prefix_store_min_chars=16)
    keys = Keys(s.namespace)
    docs = list(range(16))
    want = content_order(DOCS, docs)
    got = []
    for seed in (1, 2):
        reqs = _lone(f"s{seed}", docs, seed)
        assert [_doc_of(x["id"]) for x in reqs] != want
        burst = asyncio.run(Producer(s).asubmit(reqs))  # decode-first, the default
        got.append([_doc_of(e.id) for e in enqueued(r, s, burst)])
    assert got == [want, want]
    part = [3, 9, 1, 14, 6]
    burst = asyncio.run(Producer(s).asubmit(_lone("p", part, 3), order="grouped"))
    assert [_doc_of(e.id) for e in enqueued(r, s, burst)] == content_order(DOCS, part)
    assert not r.exists(keys.pass_order) and not r.exists(keys.pass_shards)
    given = _lone("i", docs, 4)
    burst = asyncio.run(Producer(s).asubmit(given, order="input"))
    assert [e.id for e in enqueued(r, s, burst)] == [x["id"] for x in given]
    off = s.replace(shared_pass=False)
    burst = asyncio.run(Producer(off).asubmit(given, order="grouped"))
    assert [e.id for e in enqueued(r, s, burst)] == [x["id"] for x in given]


def test_a_lone_burst_starts_where_the_pass_is_and_wraps_around(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """A window holding documents 6-8 of the content order (and keys of documents this burst
    does not ask about) makes a lone burst start at the first of them and wrap around; across
    two shards the windows are read together; garbage in a window is no pass."""
    s = make_settings(prefix_store_min_chars=16, shards=2)
    keys = Keys(s.namespace)
    docs = list(range(16))
    order = content_order(DOCS, docs)
    other = key_of(f"a document nobody asks about {'x' * 80}")
    publish_window(r, keys, 0, wire.pack([other, key_of(DOCS[order[7]]), key_of(DOCS[order[6]])]))
    publish_window(r, keys, 1, wire.pack([key_of(DOCS[order[8]])]))
    burst = asyncio.run(Producer(s).asubmit(_lone("j", docs, 5)))
    assert sum(len(enqueued(r, s, burst, k)) for k in range(2)) == 16
    want = order[6:] + order[:6]
    for k in range(2):  # each shard's part of the rotated order, in that order
        mine = [_doc_of(e.id) for e in enqueued(r, s, burst, k)]
        assert mine == [d for d in want if d in set(mine)]
    r.set(keys.pass_marks(0, "w"), b"\xc1 not msgpack")
    r.set(keys.pass_marks(1, "w"), wire.pack({"not": "a list"}))
    again = asyncio.run(Producer(s).asubmit(_lone("k", docs, 6)))
    parts = [[_doc_of(e.id) for e in enqueued(r, s, again, k)] for k in range(2)]
    assert sorted(parts[0] + parts[1]) == docs
    assert parts == [[d for d in order if d in set(part)] for part in parts]


def test_a_worker_publishes_lone_requests_prefixes_and_a_later_analysis_walks_beside_them(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: Callable[..., Any]
) -> None:
    """A real worker loop (fake engine of a stated KV cache) puts the prefixes of the lone
    requests it finished in its window, the newest within half its cache; a second analysis over
    the same documents, shuffled otherwise, then starts at the oldest of them and wraps around
    (the engine saw it in that order)."""
    s = make_settings(prefix_store_min_chars=16, heartbeat_s=0.2, pass_window=0.5)
    docs = list(range(16))
    order = content_order(DOCS, docs)
    first = asyncio.run(Producer(s).asubmit(_lone("a", docs, 1)))
    engine = engine_for_window(r, s, first, 4)
    with fake_worker(s, engine=engine):
        window = window_after(r, s, first)
        assert 2 <= len(window) <= 4
        assert window == [key_of(DOCS[d]) for d in order[-len(window) :]]
        b_reqs = _lone("b", docs, 2)
        b = asyncio.run(Producer(s).asubmit(b_reqs))
        assert results.wait(b, s, timeout=60).failed == 0
        seen = [b_reqs[int(x.split(":")[1])]["id"] for x in engine.seen if x.startswith(b + ":")]
        at = order.index(next(d for d in order if key_of(DOCS[d]) == window[0]))
        assert [_doc_of(x) for x in seen] == order[at:] + order[:at]


def test_the_session_workers_publish_lone_prefixes_and_a_second_analysis_joins_them(
    engines: Any, r: redis.Redis
) -> None:
    """On the real vLLM CPU workers (two shards): after an analysis asking one question per
    document, the shards' windows hold its documents, and a second analysis over them, shuffled
    otherwise, walks them in the content order from some point around; both complete."""
    s = engines.settings.replace(prefix_store_min_chars=16)
    keys = Keys(s.namespace)
    texts = [f"lone document {d}. " + f"words of lone text {d} " * 12 for d in range(6)]
    docs = list(range(6))
    order = content_order(texts, docs)
    a = [{**x, "max_tokens": 2} for x in _lone("la", docs, 5, texts)]
    first = asyncio.run(Producer(s).asubmit(a))
    assert results.wait(first, s, timeout=300).failed == 0

    def seen() -> bool:
        return {key_of(texts[d]) for d in docs} <= published(r, keys, 2)

    wait_until(seen, 15, "the shards' windows holding the first analysis's documents")
    b = [{**x, "max_tokens": 2} for x in _lone("lb", docs, 6, texts)]
    later = asyncio.run(Producer(s).asubmit(b))
    got = [[_doc_of(e.id) for e in enqueued(r, s, later, k)] for k in range(2)]
    assert sorted(d for part in got for d in part) == docs
    for part in got:
        mine = [d for d in order if d in set(part)]
        assert any(mine[i:] + mine[:i] == part for i in range(max(1, len(mine))))
    assert results.wait(later, s, timeout=300).failed == 0


@pytest.mark.parametrize("seed", range(6))
def test_any_mix_of_lone_and_shared_prefixes_is_enqueued_once_each_whatever_the_windows(
    make_settings: Callable[..., Settings], r: redis.Redis, seed: int
) -> None:
    """Random bursts (text, token-id and chat prefixes, short and long, used once or several
    times, requests without one, long answers) under random windows (keys of this burst's
    documents, of others, garbage) on two shards, in every order: each request is enqueued
    exactly once, and a burst of lone long prefixes under no window walks them in content
    order."""
    rng = random.Random(seed)
    s = make_settings(prefix_store_min_chars=16, shards=2)
    keys = Keys(s.namespace)
    chats = [[{"role": "system", "content": f"sys {k} " * 30}] for k in range(3)]
    reqs: list[dict[str, Any]] = []
    for i in range(rng.randrange(2, 60)):
        kind = rng.randrange(6)
        d = rng.randrange(len(DOCS))
        body: dict[str, Any] = {"id": f"r{i}", "max_tokens": rng.choice([4, 4, 4, 64])}
        if kind == 0:
            body["prompt"] = f"no prefix {i}"
        elif kind == 1:
            body |= {"prefix": DOCS[d], "prompt": f" q{i}"}
        elif kind == 2:
            body |= {"prefix": f"short {d}", "prompt": f" q{i}"}
        elif kind == 3:
            body |= {"prefix": [100 + d] * 40, "prompt_token_ids": [7, i]}
        elif kind == 4:
            body["messages"] = [*rng.choice(chats), {"role": "user", "content": f"{DOCS[d]} {i}"}]
        else:
            body |= {"prefix": DOCS[d] + f" lone {i}", "prompt": " q"}
        reqs.append(body)
    window = [key_of(DOCS[rng.randrange(len(DOCS))]) for _ in range(rng.randrange(4))]
    stray = rng.getrandbits(64)  # a key of no document here
    publish_window(r, keys, rng.randrange(2), wire.pack([*window, stray]))
    if rng.random() < 0.3:
        r.set(keys.pass_marks(1, "w"), b"\x00garbage")
    for order in ("input", "leaders-first", "grouped", "depth-first", "decode-first"):
        burst = asyncio.run(Producer(s).asubmit(reqs, order=order))
        got = sorted(e.id for k in range(2) for e in enqueued(r, s, burst, k))
        assert got == sorted(x["id"] for x in reqs), order
    r.delete(keys.workers(0), keys.workers(1))
    docs = rng.sample(range(len(DOCS)), 8)
    burst = asyncio.run(Producer(s).asubmit(_lone(f"c{seed}", docs, seed)))
    parts = [[_doc_of(e.id) for e in enqueued(r, s, burst, k)] for k in range(2)]
    order = content_order(DOCS, docs)
    assert parts == [[d for d in order if d in set(part)] for part in parts]


def test_a_lone_burst_joins_the_windows_on_a_redis_cluster(
    cluster_settings: Callable[..., Settings], cr: redis.Redis
) -> None:
    """On a real Redis Cluster (4 shards on three masters) the workers' windows live in the
    shards' slots: a lone burst reads them all, starts at their first document in the content
    order and wraps around, and keeps nothing in the cluster for it."""
    s = cluster_settings(prefix_store_min_chars=16)
    keys = Keys(s.namespace)
    docs = list(range(12))
    order = content_order(DOCS, docs)
    publish_window(cr, keys, 1, wire.pack([key_of(DOCS[order[9]])]))
    publish_window(cr, keys, 3, wire.pack([key_of(DOCS[order[8]]), key_of(DOCS[order[10]])]))
    burst = asyncio.run(Producer(s).asubmit(_lone("cl", docs, 7)))
    want = order[8:] + order[:8]
    parts = [[_doc_of(e.id) for e in enqueued(cr, s, burst, k)] for k in range(4)]
    assert sorted(d for part in parts for d in part) == docs
    assert parts == [[d for d in want if d in set(part)] for part in parts]
    assert not cr.exists(keys.pass_order) and not cr.exists(keys.pass_shards)
    assert results.status(burst, s, client=cr).total == 12
