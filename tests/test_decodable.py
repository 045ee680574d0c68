"""Anything a producer accepts, a worker can decode (docs/delivery.md, "Bad input never stops a
worker"): a request whose entry would go over one of the worker's decode limits (`wire.Limits`:
max_decoded_bytes, the string, list and map caps) or that holds a value the wire cannot carry
is refused at submit, naming the request and the limit; and an entry over a limit that reaches a
worker all the same (a producer with other limits) is identified from its first bytes, so its
request gets a failed result and its burst finishes."""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from helpers import FakeWorker, queued_entries, wait_burst
from prefixq.affinity.placement import Placed
from prefixq.client import Producer
from prefixq.client.encoding import EntryEncoder
from prefixq.client.request_file import read_request_file
from prefixq.core import wire
from prefixq.core.entries import Entry, split_prefix, to_wire
from prefixq.core.errors import LimitExceeded, ValidationError
from prefixq.core.inputs import normalize_one, read_requests
from prefixq.core.records import Request
from prefixq.core.settings import Settings
from prefixq.store.dead_letters import identify

MiB = 1 << 20
_SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "big",
        "schema": {
            "type": "object",
            "properties": {f"f{i}": {"type": "string"} for i in range(5000)},
        },
    },
}

#: (id, the request, what the refusal says); each is over a cap a worker decodes within
OVER_A_CAP: list[tuple[str, dict[str, Any], str]] = [
    (
        "token-ids-over-2^20",
        {"prompt_token_ids": [7] * 1_100_000},
        "prompt_token_ids has 1100000 items, over 1048576",
    ),
    (
        "token-id-prefix-over-2^20",
        {"prompt_token_ids": [7], "prefix": [7] * 1_100_000},
        "prefix has 1100000 items, over 1048576",
    ),
    (
        "embeddings-input-over-2^20",
        {"input": [[7] * 1_100_000]},
        "input[0] has 1100000 items, over 1048576",
    ),
    (
        "json-schema-of-5000-properties",
        {"prompt": "x", "response_format": _SCHEMA},
        "response_format json_schema schema properties has 5000 keys, over 4096",
    ),
    (
        "message-name-of-17MB",
        {"messages": [{"role": "user", "content": "hi", "name": "a" * 17_000_000}]},
        "message 0 name is 17000000 bytes of UTF-8, over 16777216",
    ),
    (
        "message-field-list-over-2^20",
        {"messages": [{"role": "user", "content": "hi", "tags": [0] * (MiB + 1)}]},
        "message 0 tags has 1048577 items, over 1048576",
    ),
]


@pytest.mark.parametrize(("req", "says"), [pytest.param(q, m, id=i) for i, q, m in OVER_A_CAP])
def test_a_request_over_a_wire_cap_is_refused_naming_it_and_the_cap(
    settings: Settings, r: redis.Redis, req: dict[str, Any], says: str
) -> None:
    """Given a request within max_prompt_chars and max_entry_bytes whose entry a worker could not
    decode (a list, map or string over the wire's caps), the Python API refuses the burst with a
    ValidationError naming the request and the cap, and enqueues nothing (before: accepted, then
    dead-lettered with no result, the burst never finishing)."""
    with pytest.raises(ValidationError, match=r"^requests\[1\]: ") as err:
        Producer(settings).submit([{"id": "fine", "prompt": "x"}, {"id": "big", **req}])
    assert says in str(err.value) and "could not decode" in str(err.value)
    assert not queued_entries(r, settings)


def test_a_request_over_max_decoded_bytes_is_refused_naming_it(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """With max_decoded_bytes at 1 MiB (producers and workers alike), a 2,000,000-character prompt
    (under max_prompt_chars, compressing far under max_entry_bytes) is refused at submit naming
    the request and the setting; nothing is enqueued."""
    s = make_settings(max_decoded_bytes=MiB)
    doc = ("The quick brown fox jumps over the lazy dog. " * 50_000)[:2_000_000]
    with pytest.raises(ValidationError, match=r"^requests\[0\]: packs into 20000\d\d bytes") as e:
        Producer(s).submit([{"id": "q0", "prompt": doc}, {"id": "q1", "prompt": "small"}])
    assert "over max_decoded_bytes=1048576" in str(e.value)
    assert not queued_entries(r, s)


def test_a_line_over_max_decoded_bytes_is_refused_naming_the_line(tmp_path: Path) -> None:
    """A file whose line 2 packs into more than max_decoded_bytes is refused naming the file and
    the line, by the reader of `prefixq submit` and by `read_requests`, before any Redis."""
    s = Settings(max_decoded_bytes=64 << 10)
    f = tmp_path / "in.jsonl"
    lines = [{"id": "a", "prompt": "hi"}, {"id": "b", "prompt": "x" * 70_000}]
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    for read in (read_request_file, read_requests):
        with pytest.raises(ValidationError, match=r"in\.jsonl: line 2: packs into \d+ bytes"):
            read(str(f), s)


class _Opaque:
    """Some object of the caller's own, which msgpack cannot pack."""


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ({1, 2}, "message 0 name is a set"),
        (datetime.datetime(2024, 1, 1), "message 0 name is a datetime"),
        (b"raw", "message 0 name is a bytes"),
        (_Opaque(), "message 0 name is a _Opaque"),
        ({"k": [1, frozenset()]}, "message 0 name k[1] is a frozenset"),
        ({(1, 2): "v"}, "message 0 name has a key of type tuple"),
    ],
    ids=["set", "datetime", "bytes", "object", "nested-frozenset", "tuple-key"],
)
def test_a_value_of_no_json_type_in_a_message_is_refused_naming_the_field(
    settings: Settings, r: redis.Redis, value: Any, says: str
) -> None:
    """A set, a datetime, bytes or any other object inside a chat message (or a map key of
    another type than a string or number) is refused with a ValidationError naming the request
    and the field, before anything is enqueued (before: an unlocated WireError from the
    encoder)."""
    bad = {"id": "q1", "messages": [{"role": "user", "content": "hi", "name": value}]}
    with pytest.raises(ValidationError, match=r"^requests\[1\]: ") as err:
        Producer(settings).submit([{"id": "q0", "prompt": "x"}, bad])
    assert says in str(err.value)
    assert not queued_entries(r, settings)


def test_accepted_requests_at_the_edge_of_max_decoded_bytes_decode_at_the_worker(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Prompts around max_decoded_bytes (64 KiB), in a burst whose entries carry the largest
    fields a burst adds (a 200-character burst id, a 64-character tenant, a priority, a
    deadline), are either refused or enqueued as entries that decode within the worker's limits
    (`Limits.from_settings`), head (uncompressed) and rest alike; and a tuple in a message, a
    JSON type on the wire, is taken."""
    s = make_settings(max_decoded_bytes=64 << 10)
    msgs = [{"role": "user", "content": "y", "tags": (1, 2)}]
    ok: list[dict[str, Any]] = [{"id": "chat", "messages": msgs}]
    refused = 0
    for n in range(63_000, 66_000, 250):
        q = {"id": f"p{n}", "prompt": "x" * n}
        try:
            normalize_one(q, 0, s)
        except ValidationError:
            refused += 1
        else:
            ok.append(q)
    assert refused and len(ok) > 4, (refused, len(ok))  # the edge is inside the range
    tail = [{"id": f"tail{i}", "prompt": "t"} for i in range(6)]
    Producer(s).submit(
        ok + tail,
        burst_id="b" * 200,
        tenant="t" * 64,
        priority="high",
        deadline=time.time() + 3600,
    )
    limits = wire.Limits.from_settings(s)
    got = [Entry.from_wire(wire.decode(f[b"d"], limits)) for _, f in queued_entries(r, s)]
    assert sorted(e.id for e in got) == sorted(q["id"] for q in ok + tail)
    assert {e.burst for e in got} == {"b" * 200}


LIMITS = ["max_decoded_bytes", "max_map_len", "max_array_len", "max_depth"]


def _over(limit: str, burst: str) -> tuple[dict[str, Any], wire.Limits]:
    """An entry of ``burst`` (index 3) over ``limit``, and the limits a worker decodes it with."""
    req = Request(id="q3", prompt="hello")
    own: dict[str, Any] = {"p": "hello"}
    limits = wire.DEFAULT_LIMITS
    if limit == "max_decoded_bytes":
        own, limits = {"p": "a" * 200_000}, wire.Limits(max_decoded_bytes=100_000)
    elif limit == "max_map_len":
        req.sampling = {"logit_bias": {str(i): 1 for i in range(5000)}}
    elif limit == "max_array_len":
        own = {"t": [1] * (MiB + 1)}
    elif limit == "max_depth":
        nested: Any = 1
        for _ in range(40):
            nested = [nested]
        req.sampling = {"stop": nested}
    entry = to_wire(
        req, burst=burst, index=3, shard=0, enqueued=1234.5, work=1, predicted_cached=0,
        prefix=None, prefix_ref=None, own=own,
    )  # fmt: skip
    return entry, limits


@pytest.mark.parametrize("codec", ["none", "zlib", "zstd"])
@pytest.mark.parametrize(
    "limit", ["max_decoded_bytes", "max_map_len", "max_array_len", "max_depth"]
)
def test_an_entry_over_a_limit_is_identified_from_its_first_bytes(limit: str, codec: str) -> None:
    """An entry over a decoding limit (written by a producer with other limits) still names its
    burst, index, id and enqueue time to the dead-letter path (`identify`), whatever its codec;
    a truncated entry within the limits is never read in part."""
    entry, limits = _over(limit, "B7")
    data = wire.encode(entry, codec)
    with pytest.raises(LimitExceeded, match=limit):
        wire.decode(data, limits)
    got = identify(data, limits)
    assert got is not None and (got.burst, got.index, got.id, got.enqueued) == (
        "B7",
        3,
        "q3",
        1234.5,
    )
    within = wire.encode(_over("none", "B7")[0], codec)
    assert identify(within[: len(within) // 2], limits) is None  # corrupt: never read in part


def test_a_worker_with_lower_limits_fails_the_request_and_its_burst_finishes(
    make_settings: Callable[..., Settings],
    fake_worker: Callable[..., FakeWorker],
    r: redis.Redis,
) -> None:
    """A producer with the default max_decoded_bytes and a worker with 1 MiB (set apart, against
    the docs): the 2,000,000-character prompt the worker cannot decode gets a dead_lettered
    result naming the limit, the other request is served, and the burst finishes (before: no
    result, the burst queued for ever)."""
    s = make_settings()
    fake_worker(s.replace(max_decoded_bytes=MiB))
    doc = ("The quick brown fox jumps over the lazy dog. " * 50_000)[:2_000_000]
    reqs = [{"id": "q0", "prompt": doc, "max_tokens": 1}, {"id": "q1", "prompt": "hi"}]
    burst = str(Producer(s).submit(reqs))
    res = wait_burst(r, s, burst, 30)
    assert res[0].error_code == "dead_lettered" and "max_decoded_bytes" in (res[0].error or "")
    assert res[1].error is None


@pytest.mark.parametrize("inline", [True, False], ids=["head", "rest"])
def test_the_encoder_refuses_an_entry_over_max_decoded_bytes(inline: bool) -> None:
    """The encoder itself (behind `check_size`) refuses an entry that packs into more than
    max_decoded_bytes, though it compresses far under max_entry_bytes, naming its position, in
    the burst's head (sent uncompressed) and in its rest alike."""
    s = Settings(max_decoded_bytes=64 << 10)
    q = Request(id="big", prompt="x" * 70_000)
    enc = EntryEncoder(s, burst="B", enqueued=1.0)
    with pytest.raises(ValidationError, match=r"request 3 \('big'\): it packs into 700\d\d bytes"):
        enc.encode([q], [split_prefix(q)], [Placed(0, 1)], 2, inline=inline)
