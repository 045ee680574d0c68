"""The shared pass (client/shared_pass.py, worker/shared_pass.py): bursts over one corpus follow
the first burst's order and start where the shards' passes are, against a real redis-server, a
fake-engine worker and the session's real vLLM CPU workers."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import redis

from fake_engine import FakeEngine
from helpers import queued_entries, wait_until
from pass_helpers import (
    content_order,
    engine_for_window,
    enqueued,
    key_of,
    publish_window,
    published,
)
from prefixq.client import Producer, results, shared_pass
from prefixq.client.encoding import _fingerprint, pass_key
from prefixq.client.pass_places import join_point, rotate
from prefixq.core import wire
from prefixq.core.entries import Entry
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.store.connection import async_client
from prefixq.worker import control
from prefixq.worker.shared_pass import COUNT_WINDOW, PassMarks

DOCS = [f"document {d}: " + f"the {d}th text of the corpus " * 20 for d in range(12)]


def _burst(name: str, docs: list[int], questions: int = 2, seed: int = 0) -> list[dict[str, Any]]:
    """``questions`` per document of ``docs``, shuffled (as a user's burst comes)."""
    reqs = [
        {"id": f"{name}-d{d}-q{q}", "prefix": DOCS[d], "prompt": f" {name} question {q}?"}
        for d in docs
        for q in range(questions)
    ]
    random.Random(seed).shuffle(reqs)
    return reqs


def _doc_order(r: redis.Redis, s: Settings, burst: str, shards: int = 1) -> list[list[int]]:
    """Per shard, the documents of ``burst`` in its enqueue order there (each once, as first
    reached)."""
    return [
        list(dict.fromkeys(_doc_of(e.id) for e in enqueued(r, s, burst, k))) for k in range(shards)
    ]


def _doc_of(request_id: str) -> int:
    return int(request_id.split("-d")[1].split("-")[0])


def _first_seen(reqs: list[dict[str, Any]]) -> list[int]:
    return list(dict.fromkeys(_doc_of(x["id"]) for x in reqs))


def _content(docs: Iterable[int]) -> list[int]:
    """``docs`` in their content order: the order a burst's new groups are placed in."""
    return content_order(DOCS, docs)


def _on_shards(order: list[int], per_shard: list[list[int]]) -> list[list[int]]:
    """``order`` as each shard of ``per_shard`` holds it."""
    return [[d for d in order if d in set(held)] for held in per_shard]


def _key(d: int) -> int:
    return key_of(DOCS[d])


def test_the_join_point_is_after_the_largest_gap_read_circularly() -> None:
    assert join_point([], 10) is None
    assert join_point([4], 10) == 4
    assert join_point([3, 4, 5, 6], 10) == 3
    assert join_point([8, 9, 0, 1], 10) == 8  # a window across the order's end: one run
    assert join_point([1, 2, 6, 7, 8], 10) == 6  # the gap 2 -> 6 (4) beats 8 -> 1 (3)
    assert join_point([1, 2, 3, 7], 10) == 7  # 3 -> 7 and 7 -> 1 are 4: the first largest


def test_rotate_moves_only_placed_groups_and_keeps_the_others_in_their_slots() -> None:
    members = [[0], [1], [2], [3], [4]]
    got = rotate(members, [2, None, 0, 1, None], 1, 3)
    assert got == [[3], [1], [0], [2], [4]]  # places 1, 2, then 0 (wrapped)
    assert rotate(members, [None] * 5, None, 0) == members


def test_a_later_burst_walks_the_documents_in_the_first_bursts_order(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """No pass published: a burst over documents earlier bursts submitted walks them in the
    order they did (the first four documents, then the next four, each burst's new ones in their
    content order), whatever its own order and theirs; the documents it adds come after the
    known ones, in their content order; off, each burst walks its own."""
    s = make_settings(prefix_store_min_chars=16)
    a_order = []
    for name, docs, seed in (("a1", [0, 1, 2, 3], 1), ("a2", [4, 5, 6, 7], 7)):
        a = _burst(name, docs, seed=seed)
        first = asyncio.run(Producer(s).asubmit(a, order="grouped"))
        (placed,) = _doc_order(r, s, first)
        assert placed == _content(docs) != _first_seen(a)
        a_order += placed
    assert a_order != _content(range(8))
    b = _burst("b", list(range(8)), seed=2)
    assert _first_seen(b) != a_order
    later = asyncio.run(Producer(s).asubmit(b, order="grouped"))
    assert _doc_order(r, s, later) == [a_order]
    mixed = asyncio.run(
        Producer(s).asubmit(_burst("c", [10, 3, 11, 5, 9], seed=3), order="grouped")
    )
    known = [d for d in a_order if d in (3, 5)]
    assert _doc_order(r, s, mixed)[0] == known + _content([10, 11, 9])
    off = make_settings(prefix_store_min_chars=16, shared_pass=False, namespace=s.namespace)
    d = _burst("d", list(range(8)), seed=4)
    own = asyncio.run(Producer(off).asubmit(d, order="grouped"))
    assert _doc_order(r, s, own) == [_first_seen(d)] != [a_order]


def test_a_burst_starts_where_a_shards_pass_is_and_wraps_around(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """A shard's published window (documents 5, 6, 7 of the first burst's order, as a worker
    publishes it) makes a later burst start at the first of them and wrap around; across two
    shards each shard's groups start at its own window (shard 1's: document 7); a value that is
    not a window is no pass."""
    s = make_settings(prefix_store_min_chars=16, shards=2)
    keys = Keys(s.namespace)
    first_reqs = _burst("a", list(range(8)), seed=1)
    first = asyncio.run(Producer(s).asubmit(first_reqs, order="grouped"))
    a = _content(range(8))
    held = _doc_order(r, s, first, shards=2)
    assert all(held) and held == _on_shards(a, held)
    publish_window(r, keys, 0, wire.pack([_key(a[6]), _key(a[5])]))
    publish_window(r, keys, 1, wire.pack([_key(a[7])]))
    b = asyncio.run(Producer(s).asubmit(_burst("b", list(range(8)), seed=2)))  # decode-first
    got = _doc_order(r, s, b, shards=2)
    assert got == [_on_shards(a[5:] + a[:5], got)[0], _on_shards(a[7:] + a[:7], got)[1]]
    publish_window(r, keys, 0, b"\xc1garbage")
    publish_window(r, keys, 1, wire.pack({"not": "a list"}))
    c = asyncio.run(Producer(s).asubmit(_burst("c", list(range(8)), seed=3), order="grouped"))
    got = _doc_order(r, s, c, shards=2)
    assert got == _on_shards(a, got)


def test_several_workers_of_one_shard_each_keep_a_window_and_a_burst_joins_them_together(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Two workers of one shard, their engines at documents 5 and 6 of the first burst's order:
    each keeps its own window (one key per shard, each worker's publication overwrote the
    other's every 0.2 s, and a burst started at one engine's pass or the other's by chance), and
    a later burst starts at the first of both, wrapping around; a worker gone from the shard's
    workers (unregistered) points no burst at what its engine held."""
    s = make_settings(prefix_store_min_chars=16)
    keys = Keys(s.namespace)
    first_reqs = _burst("a", list(range(8)), seed=1)
    asyncio.run(Producer(s).asubmit(first_reqs, order="grouped"))
    a = _content(range(8))
    publish_window(r, keys, 0, wire.pack([_key(a[6])]), worker="w2")
    publish_window(r, keys, 0, wire.pack([_key(a[5])]), worker="w1")
    b = asyncio.run(Producer(s).asubmit(_burst("b", list(range(8)), seed=2), order="grouped"))
    assert _doc_order(r, s, b) == [a[5:] + a[:5]]
    r.zrem(keys.workers(0), "w1")
    c = asyncio.run(Producer(s).asubmit(_burst("c", list(range(8)), seed=3), order="grouped"))
    assert _doc_order(r, s, c) == [a[6:] + a[:6]]


def test_two_workers_of_one_shard_publish_a_window_each(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: Callable[..., Any]
) -> None:
    """Two fake-engine workers of shard 0 (windows of 2 requests of 0.3 s each, so both read
    the burst): each publishes what its own engine finished, under its own key; together they
    hold every document, and neither window is the other's."""
    s = make_settings(prefix_store_min_chars=16, heartbeat_s=0.2, max_inflight=2)
    keys = Keys(s.namespace)
    docs = [f"sleep:0.3 {DOCS[d]}" for d in range(8)]
    reqs = [
        {"id": f"d{d}-q{q}", "prefix": doc, "prompt": f" question {q}?"}
        for d, doc in enumerate(docs)
        for q in range(2)
    ]
    with fake_worker(s, name="w1"), fake_worker(s, name="w2"):  # both serve before the burst
        burst = asyncio.run(Producer(s).asubmit(reqs, order="grouped"))
        assert results.wait(burst, s, timeout=60).failed == 0
        every = {pass_key(_fingerprint(doc)) for doc in docs}
        got: dict[str, set[int]] = {}

        def published() -> bool:  # each publishes within PUBLISH_S of its last change
            for w in ("w1", "w2"):
                raw = r.get(keys.pass_marks(0, w))
                got[w] = set(wire.unpack(raw)) if raw else set()
            return got["w1"] | got["w2"] == every

        wait_until(published, 10, "the two windows holding every document together")
    assert got["w1"] and got["w2"] and got["w1"] != got["w2"], got


def test_an_unreadable_corpus_order_or_window_is_a_hint_lost_never_a_burst_refused(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """The corpus order and the windows are hints: a place that is not a whole number is given
    a new one (after the known ones), a field ``n`` that is not one or a key of another type
    starts the order over, a window key of another type is no pass; each burst goes in whole
    (they failed the submit: a script error, a places list one short, WRONGTYPE)."""
    s = make_settings(prefix_store_min_chars=16, shards=2)
    keys = Keys(s.namespace)
    first = _burst("a", list(range(8)), seed=1)
    asyncio.run(Producer(s).asubmit(first, order="grouped"))
    a = _content(range(8))
    r.hset(keys.pass_order, str(_key(a[0])), "not a place")
    r.zadd(keys.workers(0), {"w": time.time()})
    r.hset(keys.pass_marks(0, "w"), "not", "a window")
    b = asyncio.run(Producer(s).asubmit(_burst("b", list(range(8)), seed=2), order="grouped"))
    got = _doc_order(r, s, b, shards=2)
    assert got == _on_shards(a[1:] + a[:1], got)
    for n, spoil in enumerate(
        [
            lambda: r.hset(keys.pass_order, "n", "1.5"),
            lambda: r.hset(keys.pass_order, "n", "-3"),
            lambda: r.delete(keys.pass_order) + r.set(keys.pass_order, "not a hash"),
        ]
    ):
        spoil()
        reqs = _burst(f"c{n}", list(range(8)), seed=3 + n)
        c = asyncio.run(Producer(s).asubmit(reqs, order="grouped"))
        got = _doc_order(r, s, c, shards=2)
        assert got == _on_shards(_content(range(8)), got)  # a new order
        assert r.hget(keys.pass_order, "n") == b"8"
    for burst in (b, c):
        assert sum(1 for k in range(2) for _ in enqueued(r, s, burst, k)) == 16


def test_a_burst_placed_in_several_calls_keeps_one_order_when_the_order_starts_over(
    make_settings: Callable[..., Settings], r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past `ORDER_MAX` places the order starts over, at a burst's first call of the script
    only: a burst whose places take several calls (here 3 keys a call) keeps its own order
    (the order used to start over at its second call: its first groups, placed at the old
    order's end, went in among its later ones, and were no longer in the order)."""
    monkeypatch.setattr(shared_pass, "_CHUNK", 3)
    s = make_settings(prefix_store_min_chars=16)
    keys = Keys(s.namespace)
    r.hset(keys.pass_order, "n", shared_pass.ORDER_MAX)
    reqs = _burst("a", list(range(8)), seed=1)
    burst = asyncio.run(Producer(s).asubmit(reqs, order="grouped"))
    assert _doc_order(r, s, burst) == [_content(range(8))]
    assert r.hget(keys.pass_order, "n") == str(shared_pass.ORDER_MAX + 8).encode()
    # past the limit now: the next burst's first call starts the order over, with its own
    # groups (four of them, the first placed at 0)
    again = _burst("b", [7, 1, 4, 2], seed=2)
    later = asyncio.run(Producer(s).asubmit(again, order="grouped"))
    assert _doc_order(r, s, later) == [_content([7, 1, 4, 2])]
    assert r.hget(keys.pass_order, "n") == b"4"
    assert r.hget(keys.pass_order, str(_key(_content([7, 1, 4, 2])[0]))) == b"0"


def test_a_window_smaller_than_a_token_of_a_known_cache_holds_the_newest_group_only() -> None:
    """``pass_window`` times the engine's KV cache under one token is a window of the newest
    group, as a small window is, and an engine of unknown cache counts `COUNT_WINDOW` groups
    (the tiny window rounded to 0, read as unknown: 64 groups, more than a larger one held)."""

    def entry(g: int) -> Entry:
        return Entry("b", g, f"r{g}", {}, None, None, {}, 0.0, 0, 100, 0, group=g)

    tiny, unknown = PassMarks("k", 1e-6, kv_tokens=100_000), PassMarks("k", 1e-6)
    for g in range(100):
        tiny.note(entry(g))
        unknown.note(entry(g))
    assert tiny.keys() == [99]
    assert unknown.keys() == list(range(100 - COUNT_WINDOW, 100))


def test_a_worker_publishes_the_newest_groups_within_its_window_and_a_reset_empties_it(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: Callable[..., Any]
) -> None:
    """A real worker loop (fake engine of a stated KV cache) publishes the pass keys of the
    groups it admitted last, oldest first, as many as half its cache holds; a burst submitted
    then starts at the oldest of them; ``reset_prefix_cache`` empties the window."""
    s = make_settings(prefix_store_min_chars=16, heartbeat_s=0.2, pass_window=0.5)
    keys = Keys(s.namespace)
    first_reqs = _burst("a", list(range(12)), seed=1)
    first = asyncio.run(Producer(s).asubmit(first_reqs, order="grouped"))
    a = _content(range(12))
    engine = engine_for_window(r, s, first, 4)
    with fake_worker(s, engine=engine):
        results.wait(first, s, timeout=60)
        raw = wait_until(lambda: r.get(keys.pass_marks(0, "fw")), 10, "the published window")
        window = wire.unpack(raw)
        assert window == [_key(d) for d in a[-len(window) :]]
        assert 2 <= len(window) <= 4
        b_reqs = _burst("b", list(range(12)), seed=2)
        b = asyncio.run(Producer(s).asubmit(b_reqs))
        results.wait(b, s, timeout=60)
        start = a.index(next(d for d in a if _key(d) == window[0]))
        # the worker admits one burst in its enqueue order: the engine saw it so
        seen = [b_reqs[int(x.split(":")[1])]["id"] for x in engine.seen if x.startswith(b + ":")]
        served = list(dict.fromkeys(map(_doc_of, seen)))
        assert served == a[start:] + a[:start]

        async def reset() -> None:
            ar = async_client(s)
            try:
                await control.send(ar, keys, "reset_prefix_cache", ["fw"])
            finally:
                await ar.aclose()

        asyncio.run(reset())
        wait_until(lambda: not r.exists(keys.pass_marks(0, "fw")), 10, "the window emptied")


def test_each_shard_starts_a_burst_where_its_own_pass_is(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Two shards whose passes are at different places of the corpus: a later burst's groups
    on each shard start at that shard's own window (the producer kept where each group went:
    keys.pass_shards), each shard's part wrapping around; one shard's pass does not turn the
    other's groups. A hint about a shard that is gone, or garbage, is no hint."""
    s = make_settings(prefix_store_min_chars=16, shards=2)
    keys = Keys(s.namespace)
    first_reqs = _burst("a", list(range(12)), seed=1)
    first = asyncio.run(Producer(s).asubmit(first_reqs, order="grouped"))
    held = _doc_order(r, s, first, shards=2)
    assert all(len(h) >= 4 for h in held)
    assert r.hlen(keys.pass_shards) == 12
    publish_window(r, keys, 0, wire.pack([_key(held[0][-2])]))
    publish_window(r, keys, 1, wire.pack([_key(held[1][1])]))
    later = asyncio.run(Producer(s).asubmit(_burst("b", list(range(12)), seed=2)))
    got = _doc_order(r, s, later, shards=2)
    assert got[0] == held[0][-2:] + held[0][:-2]
    assert got[1] == held[1][1:] + held[1][:1]
    # garbage hints and a hint naming a shard past the count: the shards' passes together
    r.hset(keys.pass_shards, mapping={str(_key(d)): "9" for d in held[0]})
    r.hset(keys.pass_shards, str(_key(held[1][0])), "not a shard")
    again = asyncio.run(Producer(s).asubmit(_burst("c", list(range(12)), seed=3)))
    assert sum(map(len, _doc_order(r, s, again, shards=2))) == 12
    r.delete(keys.pass_shards)
    r.set(keys.pass_shards, "not a hash")
    fourth = asyncio.run(Producer(s).asubmit(_burst("d", list(range(12)), seed=4)))
    assert sum(map(len, _doc_order(r, s, fourth, shards=2))) == 12
    assert r.type(keys.pass_shards) == b"hash"  # kept anew after the burst
    for burst in (first, later, again, fourth):
        assert results.status(burst, s).total == 24


def test_the_window_follows_what_the_engine_finished_not_what_the_worker_handed_it(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: Callable[..., Any]
) -> None:
    """A worker hands a whole burst to its engine at once (its window, twice ``max_num_seqs``,
    holds it: on an H200 hundreds of requests), so the groups it admitted last are the end of
    the engine's queue. The published window is where the engine is: the groups of the
    requests it finished last. Here documents 0-3 take 0.2 s and 4-11 take 6 s: while only the
    first four are done, the window holds some of them and nothing of the rest (it held
    documents 9-11, the last admitted, before the window followed finished requests). No KV
    budget (``kv_history_tokens`` 0): with one, the worker hands the engine a few documents at a
    time (tests/test_kv_budget.py). ``pass_running`` off: with it (the default) the window also
    holds what the engine most likely runs (tests/test_shared_pass_running.py)."""
    s = make_settings(
        prefix_store_min_chars=16,
        heartbeat_s=0.2,
        pass_window=0.5,
        kv_history_tokens=0,
        pass_running=False,
    )
    keys = Keys(s.namespace)
    docs = [f"sleep:{0.2 if d < 4 else 6} " + DOCS[d] for d in range(12)]
    reqs = [
        {"id": f"w-d{d}-q{q}", "prefix": docs[d], "prompt": f" question {q}?"}
        for d in range(12)
        for q in range(2)
    ]
    burst = asyncio.run(Producer(s).asubmit(reqs, order="grouped"))
    engine = FakeEngine(max_num_seqs=64)  # a window of 128: the burst goes in at once
    tokens = max(
        e.work + e.predicted_cached
        for e in (Entry.from_wire(wire.decode(f[b"d"])) for _, f in queued_entries(r, s))
    )
    engine.kv_tokens = 2 * 3 * tokens  # type: ignore[attr-defined]  # window: 3 documents
    fast = {pass_key(_fingerprint(docs[d])) for d in range(4)}
    with fake_worker(s, engine=engine):
        in_engine = lambda: sum(x.startswith(burst + ":") for x in engine.seen)  # noqa: E731
        wait_until(lambda: in_engine() == len(reqs), 10, "the whole burst in the engine")
        wait_until(lambda: results.status(burst, s).done >= 8, 10, "the fast documents' results")
        raw = wait_until(lambda: r.get(keys.pass_marks(0, "fw")), 3, "the published window")
        window = wire.unpack(raw)
        assert results.status(burst, s).done == 8  # the slow documents still run
        assert window and set(window) <= fast, "the window holds groups the engine has not done"
        assert results.wait(burst, s, timeout=60).failed == 0


def test_the_session_workers_publish_their_pass_and_a_second_burst_follows_the_first(
    engines: Any, r: redis.Redis
) -> None:
    """On the real vLLM CPU workers (two shards): after a burst, each shard that served it
    publishes the pass keys of what it served (its KV cache holds them all), and a second burst
    over the same documents, shuffled otherwise, walks them in the first one's order."""
    s = engines.settings.replace(prefix_store_min_chars=16)
    keys = Keys(s.namespace)
    docs = list(range(6))
    a = [{**x, "max_tokens": 2} for x in _burst("pa", docs, seed=5)]
    first = asyncio.run(Producer(s).asubmit(a, order="grouped"))
    a_order = _content(docs)
    assert results.wait(first, s, timeout=300).failed == 0

    def seen() -> bool:
        return {_key(d) for d in docs} <= published(r, keys, 2)

    wait_until(seen, 15, "both shards' windows holding the first burst's documents")
    b = [{**x, "max_tokens": 2} for x in _burst("pb", docs, seed=6)]
    later = asyncio.run(Producer(s).asubmit(b, order="grouped"))
    got = _doc_order(r, s, later, shards=2)
    assert sum(map(len, got)) == len(docs)
    # each shard's part of the first order, from some point around (the window's start)
    for part in _on_shards(a_order, got):
        assert any(part[i:] + part[:i] in got for i in range(len(part)))
    st = results.wait(later, s, timeout=300)
    assert st.failed == 0


def test_each_shard_starts_at_its_own_pass_on_a_redis_cluster(
    cluster_settings: Callable[..., Settings], cr: redis.Redis
) -> None:
    """The same on a real Redis Cluster (4 shards on three masters): the corpus order, the
    shards' windows and where each group went live in different slots; a later burst's groups
    on each shard start at that shard's window."""
    s = cluster_settings(prefix_store_min_chars=16)
    keys = Keys(s.namespace)
    first = asyncio.run(Producer(s).asubmit(_burst("a", list(range(12)), seed=1), order="grouped"))
    held = _doc_order(cr, s, first, shards=4)
    busy = [k for k in range(4) if len(held[k]) >= 2]
    assert len(busy) >= 2
    for k in busy:
        publish_window(cr, keys, k, wire.pack([_key(held[k][-1])]))
    later = asyncio.run(Producer(s).asubmit(_burst("b", list(range(12)), seed=2)))
    got = _doc_order(cr, s, later, shards=4)
    for k in busy:
        assert got[k] == held[k][-1:] + held[k][:-1]
    assert results.status(later, s, client=cr).total == 24


def test_a_window_lives_as_long_as_its_worker(
    make_settings: Callable[..., Settings],
    r: redis.Redis,
    fake_worker: Callable[..., Any],
    monkeypatch: Any,
) -> None:
    """The published window's TTL is renewed while its worker runs, even with nothing new to
    publish, and it goes soon after the worker does (a restarted engine's cache is empty: a
    window left for an hour pointed bursts at what it no longer held)."""
    from prefixq.worker import shared_pass as marks_module

    monkeypatch.setattr(marks_module, "TTL_S", 2)
    monkeypatch.setattr(marks_module, "REFRESH_S", 0.5)
    s = make_settings(prefix_store_min_chars=16, heartbeat_s=0.2)
    keys = Keys(s.namespace)
    burst = asyncio.run(Producer(s).asubmit(_burst("t", list(range(4)), seed=1), order="grouped"))
    fw = fake_worker(s)
    results.wait(burst, s, timeout=60)
    window = keys.pass_marks(0, "fw")
    wait_until(lambda: r.exists(window), 10, "the published window")
    time.sleep(3)  # past the TTL: still there, renewed with nothing new
    assert r.exists(window) and 0 < r.ttl(window) <= 2
    fw.stop()
    wait_until(lambda: not r.exists(window), 10, "the window gone with its worker")
