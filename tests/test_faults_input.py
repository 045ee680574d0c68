"""Bad input: hostile entries written straight into a stream, bad requests refused by the producer,
prompts only the real engine can judge (docs/delivery.md, "Bad input never stops a worker").

Entries bypassing the producer are served by a real `Worker` loop over tests/fake_engine.py; each
test adds the faults it saw land and what its bursts lost or doubled to the ledger
(tests/ledger.py).
"""

from __future__ import annotations

import asyncio
import json
import math
import pickle
import secrets
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import redis
import redis.asyncio as aredis
import zstandard

from helpers import FakeWorker, cli, wait_burst, wait_settled, wait_until
from ledger import LEDGER, account
from prefixq.cli.redis_server import RedisServer
from prefixq.client import Producer
from prefixq.core import wire
from prefixq.core.errors import ValidationError
from prefixq.core.keys import FIELD, Keys
from prefixq.core.records import Result
from prefixq.core.settings import Settings
from prefixq.worker import control

pytestmark = pytest.mark.slow


# ---- bad input -------------------------------------------------------------------------------
def _entry(burst: str, **over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "v": 1,
        "b": burst,
        "i": 0,
        "id": "bad",
        "p": "hello world",
        "e": time.time(),
        "k": 0,
        "w": 1,
        "pc": 0,
    }
    for k, v in over.items():
        if v is _DROP:
            d.pop(k, None)
        else:
            d[k] = v
    return d


_DROP = object()
GIB = 1 << 30


def _zlib_bomb() -> bytes:
    c = zlib.compressobj(9)
    chunk = bytes(1 << 20)
    return b"\x01" + b"".join(c.compress(chunk) for _ in range(GIB >> 20)) + c.flush()


def _zstd_bomb(declared: bool) -> bytes:
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=declared)
    c = cctx.compressobj(size=GIB if declared else -1)
    chunk = bytes(1 << 20)
    return b"\x02" + b"".join(c.compress(chunk) for _ in range(GIB >> 20)) + c.flush()


def _nested(depth: int) -> Any:
    v: Any = 1
    for _ in range(depth):
        v = [v]
    return v


def _packed(obj: Any) -> bytes:
    return b"\x00" + msgpack.packb(obj, use_bin_type=True)


def _d(data: bytes) -> dict[bytes, bytes]:
    return {FIELD: data}


# (id, fields to XADD given the burst id, expected outcome, what the outcome must say)
#   dead: a dead letter with that reason, and no result (the entry names no request)
#   dead+failed: a dead letter and a failed result for its request (burst and index decode, or
#     an entry over a limit names them in its first bytes)
#   failed: a failed result with that error
#   ok: served (unknown keys in an entry are ignored)
#   ignored: acked, nothing recorded (the index is outside its burst)
BAD_ENTRIES: list[tuple[str, Callable[[str], dict[bytes, bytes]], str, str]] = [
    ("zlib-bomb-1GiB", lambda b: _d(_zlib_bomb()), "dead", "inflates past 33554432 bytes"),
    ("zstd-bomb-1GiB-declared", lambda b: _d(_zstd_bomb(True)), "dead", "declares 1073741824"),
    ("zstd-bomb-1GiB-streamed", lambda b: _d(_zstd_bomb(False)), "dead", "inflates past"),
    ("truncated-zlib", lambda b: _d(wire.encode(_entry(b))[:-6]), "dead", "truncated zlib"),
    (
        "truncated-zstd",
        lambda b: _d(wire.encode(_entry(b), "zstd")[:-5]),
        "dead",
        "truncated zstd",
    ),
    (
        "truncated-msgpack",
        lambda b: _d(wire.encode(_entry(b), "none")[:-3]),
        "dead",
        "truncated msgpack",
    ),
    ("unknown-codec-tag", lambda b: _d(b"\x07" + wire.pack(_entry(b))), "dead", "codec tag 0x07"),
    ("pickle-is-never-unpickled", lambda b: _d(pickle.dumps(_entry(b))), "dead", "codec tag 0x80"),
    ("empty-entry", lambda b: _d(b""), "dead", "empty entry"),
    ("malformed-msgpack", lambda b: _d(b"\x00\xc1"), "dead", "invalid msgpack"),
    (  # over a limit but well-formed: identified from its first bytes (dead_letters.envelope)
        "deeply-nested-msgpack",
        lambda b: _d(_packed(_entry(b, s=_nested(200)))),
        "dead+failed",
        "nested past 32 levels",
    ),
    ("not-a-map", lambda b: _d(_packed([1, 2, 3])), "dead", "not a map"),
    (
        "ext-type",
        lambda b: _d(b"\x00" + msgpack.packb(msgpack.ExtType(5, b"x"))),
        "dead",
        "ext type",
    ),
    ("wrong-version", lambda b: _d(_packed(_entry(b, v=99))), "dead", "unsupported entry version"),
    ("missing-d-field", lambda b: {b"x": b"y"}, "dead", "no 'd' field"),
    (
        "oversized-entry",
        lambda b: _d(_packed(_entry(b, p="a" * (5 << 20)))),
        "dead+failed",
        "(max_entry_bytes)",
    ),
    ("index-wrong-type", lambda b: _d(_packed(_entry(b, i="0"))), "dead", "'i' must be int"),
    (
        "counter-infinite",
        lambda b: _d(_packed(_entry(b, w=math.inf))),
        "dead+failed",
        "malformed entry",
    ),
    (  # the enqueue time names the burst's incarnation: the result was dropped as another's
        "enqueued-infinite",
        lambda b: _d(_packed(_entry(b, e=math.inf))),
        "dead+failed",
        "enqueue time inf is not a time",
    ),
    (
        "deadline-nan",
        lambda b: _d(_packed(_entry(b, dl=math.nan))),
        "dead+failed",
        "deadline is not a number",
    ),
    (
        "sampling-not-a-map",
        lambda b: _d(_packed(_entry(b, s=[1]))),
        "dead+failed",
        "sampling is not a map",
    ),
    (
        "missing-prompt",
        lambda b: _d(_packed(_entry(b, p=_DROP))),
        "dead+failed",
        "exactly one of p, m, t",
    ),
    (
        "prompt-and-messages",
        lambda b: _d(_packed(_entry(b, m=[{"role": "user", "content": "x"}]))),
        "dead+failed",
        "exactly one of p, m, t",
    ),
    (
        "prompt-wrong-type",
        lambda b: _d(_packed(_entry(b, p=123))),
        "failed",
        "'p' must be a string, not int",
    ),
    (
        "token-ids-not-a-list",
        lambda b: _d(_packed(_entry(b, p=_DROP, t=5))),
        "failed",
        "'t' must be a list",
    ),
    (
        "negative-token-id",
        lambda b: _d(_packed(_entry(b, p=_DROP, t=[-1]))),
        "failed",
        "prompt_token_ids must be a non-empty list of token ids",
    ),
    (
        "negative-temperature",
        lambda b: _d(_packed(_entry(b, s={"temperature": -1.0}))),
        "failed",
        "temperature=-1.0 must be between 0 and 100",
    ),
    (
        "max-tokens-0",
        lambda b: _d(_packed(_entry(b, s={"max_tokens": 0}))),
        "failed",
        "max_tokens=0 must be between 1",
    ),
    (
        "top-p-2",
        lambda b: _d(_packed(_entry(b, s={"top_p": 2}))),
        "failed",
        "top_p=2 must be in (0, 1]",
    ),
    (
        "stop-int",
        lambda b: _d(_packed(_entry(b, s={"stop": 5}))),
        "failed",
        "stop has the wrong type (int)",
    ),
    (
        "unknown-sampling-field",
        lambda b: _d(_packed(_entry(b, s={"colour": "red"}))),
        "failed",
        "unknown sampling field 'colour'",
    ),
    (
        "bad-message-role",
        lambda b: _d(_packed(_entry(b, p=_DROP, m=[{"role": "wizard", "content": "hi"}]))),
        "failed",
        "unknown role 'wizard'",
    ),
    (
        "huge-prompt",
        lambda b: _d(wire.encode(_entry(b, p="a" * 4_000_001))),
        "failed",
        "4000001 characters, over 4000000",
    ),
    (
        "missing-stored-prefix",
        lambda b: _d(_packed(_entry(b, xr="0" * 32))),
        "failed",
        "not found (expired or never stored)",
    ),
    (  # served without its prefix, silently: the prefix kind must be the prompt's
        "text-prompt-after-a-token-id-prefix",
        lambda b: _d(_packed(_entry(b, x={"t": [1, 2, 3]}))),
        "failed",
        "entry field 'p' cannot follow a prefix of 't'",
    ),
    (
        "token-ids-after-a-text-prefix",
        lambda b: _d(_packed(_entry(b, p=_DROP, t=[5], x={"x": "a document"}))),
        "failed",
        "entry field 't' cannot follow a prefix of 'x'",
    ),
    (
        "pooling-on-a-generation-entry",
        lambda b: _d(_packed(_entry(b, po={"dimensions": 4}))),
        "failed",
        "pooling options but no embeddings input",
    ),
    (
        "unknown-field-naming-a-function",
        lambda b: _d(_packed(_entry(b, call="os:system", args=["rm -rf /"]))),
        "ok",
        "",
    ),
    ("index-outside-its-burst", lambda b: _d(_packed(_entry(b, i=7))), "ignored", ""),
]


@pytest.fixture(scope="module")
def bad_input_worker(redis_server: RedisServer) -> Iterator[FakeWorker]:
    """One FakeEngine worker that every bad entry of the table is thrown at (module-scoped, so
    built here rather than by the per-test `fake_worker` fixture; stopped at the module's end)."""
    s = Settings(redis_url=redis_server.url, namespace=f"bad{secrets.token_hex(3)}", shards=1)
    with FakeWorker(s, name="badw") as w:
        yield w


@pytest.mark.parametrize(
    ("fields", "expect", "says"),
    [pytest.param(f, e, m, id=i) for i, f, e, m in BAD_ENTRIES],
)
def test_bad_entry_gets_its_reason_and_the_worker_keeps_serving(
    bad_input_worker: FakeWorker,
    r: redis.Redis,
    fields: Callable[[str], dict[bytes, bytes]],
    expect: str,
    says: str,
) -> None:
    """Given an entry written straight into the stream (bypassing the producer's validation),
    the worker gives it its expected outcome (a dead letter with the reason, or a failed result
    with the error) and serves the next request."""
    w = bad_input_worker
    s, keys = w.settings, Keys(w.settings.namespace)
    burst = f"bad-{secrets.token_hex(4)}"
    r.hset(keys.burst(burst), mapping={"total": 1, "done": 0, "failed": 0, "status": "queued"})
    entry_id = r.xadd(keys.stream(0), fields(burst))

    def dead_letter() -> dict[bytes, bytes] | None:
        for _, f in r.xrange(keys.dead(0)):
            if f[b"entry"] == entry_id:
                return f
        return None

    def settled() -> bool:
        gone = not r.xrange(keys.stream(0), entry_id, entry_id)
        return gone and (
            expect == "ignored" or bool(r.hlen(keys.results(burst))) or bool(dead_letter())
        )

    wait_until(settled, 30, "the bad entry's outcome")
    if expect in ("dead+failed", "failed", "ok"):
        wait_until(lambda: r.hlen(keys.results(burst)), 10, "its result")
    letter = dead_letter()
    got = r.hget(keys.results(burst), 0)
    res = Result.from_wire(wire.decode(got)) if got else None
    print(
        f"  outcome: dead letter {letter[b'reason'].decode() if letter else None!r}; "
        f"result error {res.error if res else None!r}"
    )
    lost = 0
    if expect == "dead":
        assert letter is not None and says in letter[b"reason"].decode()
        assert b"burst" not in letter and res is None
    elif expect == "dead+failed":
        assert letter is not None and says in letter[b"reason"].decode()
        assert res is not None and res.error is not None and says in res.error
        assert (letter[b"burst"].decode(), letter[b"index"]) == (burst, b"0")
    elif expect == "failed":
        assert letter is None
        assert res is not None and res.error is not None and says in res.error, res
    elif expect == "ok":
        assert letter is None and res is not None and res.error is None
    else:
        assert letter is None and res is None
        assert r.hgetall(keys.burst(burst))[b"done"] == b"0"
    LEDGER.fault(f"bad entry {entry_id.decode()} written straight into the stream, handled")
    if expect != "dead" and expect != "ignored":
        lost = account(r, s, burst, 1, what="its burst").lost
    assert lost == 0

    probe = Producer(s).submit([{"id": "probe", "prompt": "still serving", "max_tokens": 4}])
    wait_burst(r, s, probe, 20)
    assert account(r, s, probe, 1, what="next request").done == 1
    assert w.running
    wait_settled(r, s)


BAD_REQUESTS: list[tuple[str, dict[str, Any] | list[dict[str, Any]], str]] = [
    ("negative-temperature", {"prompt": "x", "temperature": -1}, "temperature=-1 must be"),
    ("nan-temperature", {"prompt": "x", "temperature": float("nan")}, "must be finite"),
    ("max-tokens-0", {"prompt": "x", "max_tokens": 0}, "max_tokens=0 must be between 1"),
    ("max-tokens-string", {"prompt": "x", "max_tokens": "9"}, "max_tokens has the wrong type"),
    ("top-p-2", {"prompt": "x", "top_p": 2}, r"top_p=2 must be in \(0, 1\]"),
    ("top-k-float", {"prompt": "x", "top_k": 1.5}, "top_k has the wrong type"),
    ("ignore-eos-int", {"prompt": "x", "ignore_eos": 1}, "ignore_eos has the wrong type"),
    ("stop-int", {"prompt": "x", "stop": 5}, r"stop has the wrong type \(int\)"),
    ("stop-17-strings", {"prompt": "x", "stop": ["a"] * 17}, "at most 16 strings"),
    ("missing-prompt", {"max_tokens": 4}, "exactly one of prompt, messages"),
    (
        "prompt-and-messages",
        {"prompt": "x", "messages": [{"role": "user", "content": "y"}]},
        "exactly one of prompt, messages",
    ),
    ("prompt-not-a-string", {"prompt": 7}, "prompt must be a string"),
    ("empty-prompt", {"prompt": ""}, "prompt is empty"),
    (
        "bad-message-role",
        {"messages": [{"role": "wizard", "content": "hi"}]},
        "unknown role 'wizard'",
    ),
    ("messages-not-a-list", {"messages": "hi"}, "messages must be a non-empty list"),
    # messages ordering looks at before validation (client/order.py): refused, not a TypeError
    (
        "system-content-a-number",
        {"messages": [{"role": "system", "content": 7}, {"role": "user", "content": "x"}]},
        "message 0 content must be a string",
    ),
    (
        "content-part-text-a-number",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        "message 0 content part 0 needs a string 'text'",
    ),
    (
        "prefix-message-content-a-number",
        {"prefix": [{"content": 5}], "prompt": "?"},
        "a token-id prefix goes with prompt_token_ids",
    ),
    (
        "too-many-messages",
        {"messages": [{"role": "user", "content": "x"}] * 5},
        "5 messages, over 4",
    ),
    ("token-ids-not-a-list", {"prompt_token_ids": "1 2 3"}, "non-empty list of token ids"),
    ("token-id-negative", {"prompt_token_ids": [1, -2]}, "non-empty list of token ids"),
    ("unknown-field", {"prompt": "x", "colour": "red"}, "unknown fields: colour"),
    ("huge-prompt", {"prompt": "a" * 2001}, "2001 characters, over 2000"),
    ("id-too-long", {"id": "i" * 513, "prompt": "x"}, "id longer than 512"),
    ("entry-too-large", {"prompt": secrets.token_hex(900)}, "over max_entry_bytes=1024"),
    (
        "duplicate-ids",
        [{"id": "same", "prompt": "x"}, {"id": "same", "prompt": "y"}],
        "duplicate request ids",
    ),
    ("empty-burst", [], "the burst is empty"),
]


@pytest.mark.parametrize(("req", "says"), [pytest.param(q, m, id=i) for i, q, m in BAD_REQUESTS])
def test_producer_refuses_bad_request_before_enqueueing(
    make_settings: Callable[..., Settings],
    r: redis.Redis,
    req: dict[str, Any] | list[dict[str, Any]],
    says: str,
) -> None:
    """Given a request with a bad field, the producer refuses the whole burst with a
    ValidationError saying which request and what is wrong, and enqueues nothing."""
    s = make_settings(max_prompt_chars=2000, max_messages=4, max_entry_bytes=1024)
    reqs = req if isinstance(req, list) else [{"id": "q", **req}]
    with pytest.raises(ValidationError, match=says) as err:
        Producer(s).submit(reqs)
    print(f"  refused: {err.value}")
    assert r.xlen(Keys(s.namespace).stream(0)) == 0
    # its traceback shows no unrelated "no running event loop" first (the check for a running
    # loop was an except block the refusal was raised within)
    assert err.value.__context__ is None or isinstance(err.value.__context__, ValidationError)


@pytest.mark.engine
def test_real_engine_refuses_bad_prompts_and_keeps_serving(engines: Any, r: redis.Redis) -> None:
    """Given prompts that only the engine can judge (a token id outside the vocabulary, a prompt
    longer than max_model_len), each fails its own request with the engine's reason and the
    workers (the session's real vLLM CPU deployment) serve the rest."""
    s = engines.settings
    reqs = [
        {"id": "oov", "prompt_token_ids": [1, 2, 1_000_000], "max_tokens": 4},
        {"id": "long", "prompt": "word " * 9000, "max_tokens": 4},
        {"id": "fine", "prompt": "The capital of France is", "max_tokens": 4},
    ]
    burst = Producer(s).submit(reqs)
    wait_burst(r, s, burst, 120)
    out = account(r, s, burst, 3, what="engine-judged burst")
    for x in out.results.values():
        print(f"    {x.id}: {x.error or x.text!r}")
    assert (out.lost, out.duplicated, out.done, out.failed) == (0, 0, 1, 2)
    assert "out of vocabulary" in (out.results[0].error or "")
    assert "maximum context length" in (out.results[1].error or "")
    assert all(w.proc.poll() is None for w in engines.workers)


# ---- garbage in the namespace's other keys ---------------------------------------------------
def test_garbage_in_the_deadline_index_does_not_stop_expiry_nor_a_control_entry_the_control_loop(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: Callable[..., FakeWorker]
) -> None:
    """Given a deadline index member that is no UTF-8 burst id, and a burst with a deadline whose
    record's total is not a count, a worker still expires a burst whose deadline passes (its
    requests in the engine are aborted and failed as expired) and drops the two from the index;
    given a control entry whose fields are not UTF-8, it still answers `stats`. (Both used to
    kill the worker's expiry task, or its control loop, for good, without a word.)"""
    s = make_settings()
    keys = Keys(s.namespace)
    w = fake_worker(s, name="gw")
    corrupt = "corrupt-total"
    r.hset(keys.burst(corrupt), mapping={"total": "many", "done": 0, "failed": 0})
    r.zadd(keys.deadlines, {b"\xff\xfe": 1, corrupt: 2})
    r.xadd(keys.control, {"cmd": b"\xff\xfe", "id": b"\xff"})
    burst = Producer(s).submit(
        [{"id": f"q{i}", "prompt": f"sleep:30 q{i}", "max_tokens": 4} for i in range(3)],
        deadline=time.time() + 1.5,
    )
    wait_until(lambda: r.hget(keys.burst(burst), "status") == b"expired", 15, "the expiry")
    # the burst leaves the index once its expiry is done, a moment after its status says so
    wait_until(lambda: r.zcard(keys.deadlines) == 0, 10, "the deadline index emptied")
    LEDGER.fault("garbage in the deadline index, the worker expired the burst anyway")
    out = account(r, s, burst, 3, what="its burst")
    assert (out.lost, out.duplicated, out.failed) == (0, 0, 3)
    assert {x.error_code for x in out.results.values()} == {"expired"}

    async def stats() -> dict[str, Any]:
        ar = aredis.Redis.from_url(s.redis_url)
        try:
            return await control.send(ar, keys, "stats", ["gw"], wait_s=10)
        finally:
            await ar.aclose()

    assert asyncio.run(stats())["gw"]["ok"] is True
    LEDGER.fault("a control entry that is not UTF-8, the worker answered the next command")
    assert w.running


def test_corrupt_records_are_clear_errors_in_cancel_dead_and_reclaim_never_a_traceback(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Given a burst record whose counters are not counts, `prefixq cancel` exits 1 saying the
    record is corrupt and changes nothing; given a dead letter whose numbers are garbage,
    `prefixq dead` still lists it (and the others); given a shard count in the config hash that
    is no positive number, `prefixq reclaim` and `prefixq dead` exit 2 naming it. (Each was a
    Python traceback.)"""
    s = make_settings()
    keys = Keys(s.namespace)
    burst = Producer(s).submit([{"id": "q0", "prompt": "x"}])
    r.hset(keys.burst(burst), "done", "lots")
    p = cli(s, "cancel", burst)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert f"burst {burst!r}: its record is corrupt" in p.stderr
    assert r.hget(keys.burst(burst), "status") == b"queued" and not r.exists(keys.results(burst))

    bad = r.xadd(keys.dead(0), {"delivered": "abc", "at": "nan", "index": "٣", "reason": "x"})
    good = r.xadd(keys.dead(0), {"delivered": 3, "at": 1.5, "index": 0, "burst": burst})
    p = cli(s, "dead", "--json")
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    listed = {d["id"]: d for d in json.loads(p.stdout)}
    assert (listed[bad.decode()]["delivered"], listed[bad.decode()]["index"]) == (0, None)
    assert (listed[good.decode()]["delivered"], listed[good.decode()]["index"]) == (3, 0)

    for stored in ("abc", "0"):
        r.hset(keys.config, "shards", stored)
        for cmd in ("reclaim", "dead"):
            p = cli(s, cmd)
            assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
            assert f"corrupt shard count b'{stored}'" in p.stderr, p.stderr
