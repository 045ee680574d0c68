"""The producer against a real redis-server: burst integrity (a refused request, a racing second
producer), the head sent first, enqueue orders, the ids list."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from helpers import cli, queued_entries
from prefixq.affinity.placement import HashPlacer
from prefixq.client import Producer, results
from prefixq.client import producer as producer_module
from prefixq.client.layout import GUARD_TTL_S, Layout
from prefixq.client.producer import HEAD
from prefixq.core import wire
from prefixq.core.entries import Entry
from prefixq.core.errors import ValidationError
from prefixq.core.keys import POS, Keys
from prefixq.core.records import Request
from prefixq.core.settings import Settings


def entries(r: redis.Redis, s: Settings, shard: int = 0) -> list[Entry]:
    """The entries queued on a shard (its intakes, then its lanes)."""
    return [Entry.from_wire(wire.decode(f[b"d"])) for _, f in queued_entries(r, s, shard)]


def enqueued(r: redis.Redis, s: Settings, burst: str) -> list[Entry]:
    """A one-shard burst's entries in enqueue order, from the places the producer gave them
    (`POS`: the lane and intake entries sent before each), checked to be 0, 1, 2, ... with the
    lane's in stream order."""
    keys = Keys(s.namespace)
    intake = [f for _, f in r.xrange(keys.stream(0))]
    lane = [f for _, f in r.xrange(keys.lane(0, burst))]
    placed = []
    for f in intake + lane:
        lanes, intakes = (int(x) for x in f[POS].split(b":"))
        placed.append((lanes + intakes, f))
    placed.sort(key=lambda x: x[0])
    assert [k for k, _ in placed] == list(range(len(placed)))
    in_lane = [f for _, f in placed if f in lane]
    assert in_lane == lane, "lane entries out of stream order"
    return [Entry.from_wire(wire.decode(f[b"d"])) for _, f in placed]


def namespace_keys(r: redis.Redis, s: Settings) -> list[bytes]:
    return [k for k in r.scan_iter(match=f"{s.namespace}:*") if not k.endswith(b":config")]


def test_a_line_too_big_to_encode_is_refused_before_anything_is_enqueued(
    make_settings: Callable[..., Settings], r: redis.Redis, tmp_path: Path
) -> None:
    """Given a file whose line 51 (3.5M CJK characters) encodes over max_entry_bytes, `prefixq
    submit` names line 51, exits 1 and leaves no entry, record or prefix in Redis."""
    s = make_settings()
    r.hset(Keys(s.namespace).config, "shards", 1)
    lines = [json.dumps({"id": f"q{i}", "prompt": f"hello {i}"}) for i in range(100)]
    lines[50] = json.dumps(
        {"id": "big", "prompt": "".join(chr(0x4E00 + i % 20000) for i in range(3_500_000))}
    )
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    p = cli(s, "submit", str(src))
    assert p.returncode == 1, p.stderr
    assert "line 51" in p.stderr and "max_entry_bytes" in p.stderr and "Traceback" not in p.stderr
    assert namespace_keys(r, s) == []


def test_a_bad_request_in_the_head_leaves_nothing_behind(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Given a burst whose second request is invalid, the Python API raises ValidationError
    naming it, and nothing at all was written."""
    s = make_settings()
    reqs: list[dict[str, Any]] = [{"id": f"q{i}", "prompt": "x"} for i in range(50)]
    reqs[1]["temperature"] = -1
    with pytest.raises(ValidationError, match=r"requests\[1\]|line 2\b"):
        Producer(s).submit(reqs)
    assert namespace_keys(r, s) == []


def test_a_bad_request_after_the_head_cancels_the_burst_as_a_whole(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Given a burst whose request 30 is invalid (found after the head was sent), the Python API
    raises ValidationError naming it and saying the burst was cancelled; the burst is ended:
    every request has exactly one result, cancelled, and waiters see it finished."""
    s = make_settings()
    reqs: list[dict[str, Any]] = [{"id": f"q{i}", "prompt": "x"} for i in range(50)]
    reqs[30]["top_p"] = 7
    with pytest.raises(ValidationError, match=r"(requests\[30\]|line 31\b).*cancelled") as e:
        Producer(s).submit(reqs, burst_id="half")
    assert "4 of its 50" in str(e.value)
    got = results.collect("half", s)
    assert len(got) == 50 and {g.error_code for g in got} == {"cancelled"}
    st = results.status("half", s)
    assert st.finished and st.status == "cancelled" and st.failed == 50


def test_two_producers_racing_for_one_burst_id_only_one_writes(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Given two producers released at a barrier with the same burst id, exactly one burst is
    created: its record says its own total, the stream holds exactly its entries, and the other
    producer gets a ValidationError saying the id exists, having written nothing."""
    s = make_settings()
    barrier = threading.Barrier(2)
    outcome: dict[str, Any] = {}

    def submit(tag: str, n: int) -> None:
        reqs = [{"id": f"{tag}{i}", "prompt": f"{tag} {i}"} for i in range(n)]
        barrier.wait()
        try:
            outcome[tag] = Producer(s).submit(reqs, burst_id="same")
        except ValidationError as e:
            outcome[tag] = e

    threads = [threading.Thread(target=submit, args=a) for a in (("a", 1000), ("b", 500))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    won = [tag for tag, o in outcome.items() if o == "same"]
    lost = [o for o in outcome.values() if isinstance(o, ValidationError)]
    assert len(won) == 1 and len(lost) == 1 and "already exists" in str(lost[0])
    total = {"a": 1000, "b": 500}[won[0]]
    meta = r.hgetall(Keys(s.namespace).burst("same"))
    got = entries(r, s)
    assert int(meta[b"total"]) == total == len(got)
    assert {e.id[0] for e in got} == {won[0]}
    assert r.llen(Keys(s.namespace).ids("same")) == total


def test_the_head_is_uncompressed_and_the_rest_uses_the_codec(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """The first HEAD entries go out uncompressed (read at once, deleted once acked); the rest
    are compressed with the settings' codec; every index appears once, ids list in input order."""
    s = make_settings(codec="zlib")
    reqs = [{"id": f"q{i}", "prompt": f"question {i} " * 50} for i in range(40)]
    burst = Producer(s).submit(reqs)
    rows = queued_entries(r, s)
    tags = [f[b"d"][0] for _, f in rows]
    assert tags[:HEAD] == [wire.CODEC_TAGS["none"]] * HEAD
    assert set(tags[HEAD:]) == {wire.CODEC_TAGS["zlib"]}
    assert sorted(e.index for e in entries(r, s)) == list(range(40))
    ids = [x.decode() for x in r.lrange(Keys(s.namespace).ids(burst), 0, -1)]
    assert ids == [q["id"] for q in reqs]


@pytest.mark.parametrize(
    ("order", "expect"),
    [
        ("input", ["d0q0", "d1q0", "d0q1", "d1q1", "d2q0", "d0q2"]),
        ("leaders-first", ["d0q0", "d1q0", "d2q0", "d0q1", "d1q1", "d0q2"]),
        ("grouped", ["d0q0", "d0q1", "d0q2", "d1q0", "d1q1", "d2q0"]),
    ],
)
def test_enqueue_order_puts_each_prefix_group_as_asked(
    make_settings: Callable[..., Settings], r: redis.Redis, order: str, expect: list[str]
) -> None:
    """Requests on three shared documents are enqueued in the asked order; each keeps its
    input index, and the ids list stays in input order. (The shared pass, off here, walks a
    ``grouped`` burst in the corpus order instead: tests/test_shared_pass*.py.)"""
    s = make_settings(prefix_store_min_chars=16, shared_pass=False)
    docs = [f"document {d} " * 40 for d in range(3)]
    names = ["d0q0", "d1q0", "d0q1", "d1q1", "d2q0", "d0q2"]
    reqs = [{"id": n, "prefix": docs[int(n[1])], "prompt": f" {n}?"} for n in names]
    burst = asyncio.run(Producer(s).asubmit(reqs, order=order))
    got = enqueued(r, s, burst)
    assert [e.id for e in got] == expect
    assert all(names[e.index] == e.id for e in got)
    ids = [x.decode() for x in r.lrange(Keys(s.namespace).ids(burst), 0, -1)]
    assert ids == names


def test_a_submit_drops_index_entries_of_bursts_whose_record_expired(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Given a burst index holding 100 bursts whose records are gone (expired) and 5 whose
    records live, each submit drops some of the gone ones, oldest first, and never a live one:
    the index does not grow for ever."""
    s = make_settings()
    keys = Keys(s.namespace)
    r.zadd(keys.bursts, {f"old{i:03d}": i for i in range(100)})
    r.zadd(keys.bursts, {f"live{i}": 200 + i for i in range(5)})
    for i in range(5):
        r.hset(keys.burst(f"live{i}"), "total", 1)
    before = r.zcard(keys.bursts)
    Producer(s).submit([{"id": "a", "prompt": "x"}])
    after = r.zcard(keys.bursts)
    assert after < before  # 105 + the new burst - what this submit pruned
    for _ in range(5):
        Producer(s).submit([{"id": "a", "prompt": "x"}])
    names = {b.decode() for b in r.zrange(keys.bursts, 0, -1)}
    assert not any(n.startswith("old") for n in names)
    assert {f"live{i}" for i in range(5)} <= names and len(names) == 5 + 6


@pytest.mark.parametrize("bad", ["", "a b", "x{y}", "line\nbreak", "é", "x" * 201])
def test_an_unusable_burst_id_is_refused_before_anything_is_written(
    make_settings: Callable[..., Settings], r: redis.Redis, bad: str
) -> None:
    """A burst id with braces (they would split its keys' Cluster hash tag), spaces, control
    or non-ASCII characters, or over 200 characters, is refused; nothing is written."""
    s = make_settings()
    with pytest.raises(ValidationError, match="burst id"):
        Producer(s).submit([{"id": "a", "prompt": "x"}], burst_id=bad)
    assert namespace_keys(r, s) == []


@pytest.mark.parametrize(
    "one", [{"id": "a", "prompt": "hi"}, "hello", Request(id="a", prompt="hi")], ids=type
)
def test_one_request_instead_of_a_list_is_refused_by_name(
    settings: Settings, r: redis.Redis, one: Any
) -> None:
    """`submit({"id": ..., "prompt": ...})` iterated the dict's keys and said "line 1: expected a
    JSON object, got str"; it now says to wrap the request in a list."""
    with pytest.raises(ValidationError, match="wrap a single request in a list"):
        Producer(settings).submit(one)
    assert not list(r.scan_iter(match=f"{settings.namespace}:*"))


@pytest.mark.parametrize("bad", [5, "a prompt", None, ["x"]], ids=repr)
def test_an_item_that_is_not_a_request_past_the_head_is_refused_before_anything_is_written(
    make_settings: Callable[..., Settings], r: redis.Redis, bad: Any
) -> None:
    """A list of 50 requests whose 51st item is not an object: a ValidationError naming its line,
    not an AttributeError that left the burst record behind as "queued" forever."""
    s = make_settings()
    reqs: list[Any] = [{"id": str(i), "prompt": "x"} for i in range(50)] + [bad]
    with pytest.raises(ValidationError, match="line 51: expected a JSON object"):
        Producer(s).submit(reqs)
    assert namespace_keys(r, s) == []


class _PlacesTheHeadOnly:
    """A `Placer` of a user's own that fails on the burst's second chunk."""

    def __init__(self) -> None:
        self.calls = 0

    async def place(self, r: Any, items: list[Any], shards: int) -> list[Any]:
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("the placer broke")
        return await HashPlacer().place(r, items, shards)


def test_an_unexpected_error_after_the_head_was_sent_cancels_the_burst_as_a_whole(
    settings: Settings, r: redis.Redis
) -> None:
    """Any error once the head is out (here a placer of the user's own raising RuntimeError)
    cancels the burst, so its record does not stay "queued" with requests that never come."""
    reqs = [{"id": str(i), "prompt": "x"} for i in range(3 * HEAD)]
    with pytest.raises(RuntimeError, match="was cancelled as a whole"):
        Producer(settings).submit(reqs, placement=_PlacesTheHeadOnly(), burst_id="broken")
    st = results.status("broken", settings, client=r)
    assert st.status == "cancelled"
    assert st.finished and st.failed >= 3 * HEAD - HEAD


async def _agen() -> Any:
    yield {"id": "a", "prompt": "hi"}


@pytest.mark.parametrize("bad", [5, None, _agen()], ids=lambda x: type(x).__name__)
def test_something_that_is_not_an_iterable_of_requests_is_refused_by_name(
    settings: Settings, r: redis.Redis, bad: Any
) -> None:
    """`submit(5)`, `submit(None)` or an async generator was a TypeError from list()."""
    with pytest.raises(ValidationError, match=r"submit takes a list .* of requests, not"):
        Producer(settings).submit(bad)
    assert not list(r.scan_iter(match=f"{settings.namespace}:*"))


def test_a_new_burst_id_that_is_taken_is_drawn_again(
    settings: Settings, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two producers drawing the same new id (same second, same 6 random hex digits) failed the
    second with "already exists"; a taken id of the producer's own making is drawn again. An
    explicit burst_id that is taken is still refused."""
    drawn = iter(["same", "same", "other"])
    monkeypatch.setattr(producer_module, "new_burst_id", lambda: next(drawn))
    assert Producer(settings).submit([{"id": "a", "prompt": "x"}]) == "same"
    assert Producer(settings).submit([{"id": "a", "prompt": "x"}]) == "other"
    assert sorted(r.zrange(settings.keys.bursts, 0, -1)) == [b"other", b"same"]
    with pytest.raises(ValidationError, match="burst 'same' already exists"):
        Producer(settings).submit([{"id": "a", "prompt": "x"}], burst_id="same")


def test_submit_works_where_an_event_loop_is_running(settings: Settings, r: redis.Redis) -> None:
    """The blocking `submit` called inside a running event loop (a notebook cell, an async
    service) failed with "asyncio.run() cannot be called from a running event loop"; it now
    submits from a thread of its own, also inside `async with Producer(...)`."""

    async def main() -> list[str]:
        first = Producer(settings).submit([{"id": "a", "prompt": "x"}])
        async with Producer(settings) as p:
            second = p.submit([{"id": "a", "prompt": "x"}])
            third = await p.asubmit([{"id": "a", "prompt": "x"}])
        return [first, second, third]

    bursts = asyncio.run(main())
    assert len(set(bursts)) == 3
    assert all(results.status(b, settings, client=r).total == 1 for b in bursts)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"deadline": "soon"}, "deadline must be epoch seconds"),
        ({"deadline": True}, "deadline must be epoch seconds"),
        ({"metadata": ["a"]}, "metadata must map strings to strings"),
        ({"progress": 5}, "progress must be a function"),
        ({"placement": 5}, "placement must be a name or a Placer"),
    ],
    ids=repr,
)
def test_an_option_of_the_wrong_type_is_refused_before_anything_is_written(
    settings: Settings, r: redis.Redis, options: dict[str, Any], match: str
) -> None:
    """These were a TypeError, a Redis DataError or an AttributeError; `progress=5` was called
    only after the head went out and cancelled the burst it had started."""
    reqs = [{"id": str(i), "prompt": "x"} for i in range(3 * HEAD)]
    with pytest.raises(ValidationError, match=match):
        Producer(settings).submit(reqs, **options)
    assert not list(r.scan_iter(match=f"{settings.namespace}:*"))


def test_small_entries_travel_uncompressed(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Past the head, an entry that packs into fewer than wire.COMPRESS_FROM bytes is not compressed
    (zlib would only make it longer); a longer one is."""
    s = make_settings(codec="zlib")
    reqs = [{"id": f"q{i}", "prompt": f"q{i}?" if i % 2 else "long question " * 40}
            for i in range(HEAD + 20)]  # fmt: skip
    Producer(s).submit(reqs)
    by_id = {}
    for _, f in queued_entries(r, s):
        e = Entry.from_wire(wire.decode(f[b"d"]))
        by_id[e.id] = (f[b"d"][0], len(wire.decompress(f[b"d"])))
    body = [by_id[q["id"]] for q in reqs[HEAD:]]
    assert {tag for tag, n in body if n < wire.COMPRESS_FROM} == {wire.CODEC_TAGS["none"]}
    assert {tag for tag, n in body if n >= wire.COMPRESS_FROM} == {wire.CODEC_TAGS["zlib"]}


def test_a_long_submit_keeps_the_count_of_a_shard_it_stopped_sending_to(
    settings: Settings, r: redis.Redis
) -> None:
    """Given a shard whose count of a submission's entries (lua/enqueue.lua's guard) was last set
    long ago, when a chunk goes only to other shards, then it refreshes that count's TTL: the
    submit's fence reads every count back, and one that expired would fail the submit."""
    keys = Keys(settings.namespace)
    lay = Layout(keys, "long", "normal", "default")
    pipe = r.pipeline(transaction=False)
    lay.add(pipe, {0: [(b"a", 1)], 1: [(b"b", 1)]}, first=True, token="t")
    pipe.execute()
    guard = keys.enqueued(1, "long", "t")
    r.expire(guard, 5)
    lay._touched[1] -= GUARD_TTL_S  # its TTL was last set a long while ago
    pipe = r.pipeline(transaction=False)
    lay.add(pipe, {0: [(b"c", 1)]}, first=False, token="t")
    pipe.execute()
    assert r.ttl(guard) > GUARD_TTL_S - 60
    assert lay.counts("t") == {keys.enqueued(0, "long", "t"): 2, guard: 1}
