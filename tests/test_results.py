"""Reading a burst's results (`prefixq.client.results`, `prefixq results`) when its record is gone
or
partial: nothing reads as finished that is not."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from helpers import FakeWorker, cli, cli_argv, wait_settled, wait_until
from prefixq.client import Producer, results
from prefixq.core.errors import BurstNotFound, BurstRecordLost, BurstTimeout, ValidationError
from prefixq.core.settings import Settings


def served_burst(s: Settings, n: int = 10) -> str:
    """A burst of ``n`` requests, every one recorded by a real Worker loop (fake engine)."""
    with FakeWorker(s, name="res0"):
        burst = Producer(s).submit([{"id": f"q{i}", "prompt": f"hi {i}"} for i in range(n)])
        results.wait(burst, s, timeout=30)
    return burst


def every_reader(burst: str, s: Settings) -> dict[str, Callable[[], Any]]:
    return {
        "status": lambda: results.status(burst, s),
        "wait": lambda: results.wait(burst, s, timeout=5),
        "iterate": lambda: list(results.iterate(burst, s, timeout=5)),
        "collect": lambda: results.collect(burst, s),
        "write_jsonl": lambda: results.write_jsonl(burst, io.StringIO(), s, timeout=5),
    }


def prefixq_results(s: Settings, burst: str) -> subprocess.CompletedProcess[str]:
    return cli(s, "results", burst, timeout=60)


def test_a_burst_whose_record_is_gone_is_not_found_and_says_why(
    settings: Settings, r: redis.Redis
) -> None:
    """With its record deleted (expired or evicted) while its 10 results remain, every reader
    raises BurstNotFound saying it was never submitted, expired or evicted; `prefixq results`
    exits 1 with that message."""
    burst = served_burst(settings)
    assert r.hlen(settings.keys.results(burst)) == 10
    r.delete(settings.keys.burst(burst))
    for name, read in every_reader(burst, settings).items():
        with pytest.raises(BurstNotFound, match="never submitted, or its record expired") as e:
            read()
        assert type(e.value) is BurstNotFound, name
    p = prefixq_results(settings, burst)
    assert p.returncode == 1 and p.stdout == ""
    assert "expired (result_ttl_s) or was evicted" in p.stderr


def test_a_partial_burst_record_never_reads_as_finished(settings: Settings, r: redis.Redis) -> None:
    """With its record lost and written again without ``total`` (as a late result re-created it),
    every reader raises BurstRecordLost saying the record is incomplete, instead of returning a
    finished burst; `prefixq results` exits 1 with that message, not 0 with nothing."""
    burst = served_burst(settings)
    r.delete(settings.keys.burst(burst))
    r.hset(settings.keys.burst(burst), mapping={"done": 10, "prompt_tokens": 30})
    for read in every_reader(burst, settings).values():
        with pytest.raises(BurstRecordLost, match="its record is incomplete"):
            read()
    p = prefixq_results(settings, burst)
    assert p.returncode == 1 and p.stdout == ""
    assert "its record is incomplete" in p.stderr and "Traceback" not in p.stderr


def test_a_record_outliving_a_short_result_ttl_while_queued(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Given result_ttl_s=1 and a burst that waits 2 s in the queue before any worker runs,
    the burst's record does not expire while it runs: the worker records every result, and the
    record expires result_ttl_s after the last one."""
    s = make_settings(result_ttl_s=1)
    burst = Producer(s).submit([{"id": f"q{i}", "prompt": f"hi {i}"} for i in range(10)])
    assert r.ttl(s.keys.burst(burst)) == -1, "a running burst's record has no TTL"
    time.sleep(2)
    with FakeWorker(s, name="late"):
        st = results.wait(burst, s, timeout=30)
    assert (st.total, st.done, st.status) == (10, 10, "finished")
    assert 0 < r.pttl(s.keys.burst(burst)) <= 1000


def test_a_worker_never_recreates_a_record_that_went_away(
    settings: Settings, r: redis.Redis
) -> None:
    """Given a queued burst whose record is deleted (evicted) before a worker runs it, the worker
    records nothing, acks the entries (the queue drains) and never writes a record again, so the
    burst reads as not found instead of finished."""
    burst = Producer(settings).submit([{"id": f"q{i}", "prompt": f"hi {i}"} for i in range(10)])
    r.delete(settings.keys.burst(burst))
    with FakeWorker(settings, name="norec") as fw:
        wait_until(
            lambda: fw.worker is not None and fw.worker.counts["finished"] == 10, 30, "10 served"
        )
        wait_settled(r, settings)
    assert not r.exists(settings.keys.burst(burst))
    assert r.hlen(settings.keys.results(burst)) == 0
    with pytest.raises(BurstNotFound):
        results.wait(burst, settings, timeout=2)


def test_an_infinite_timeout_waits_and_a_nan_one_is_refused(
    settings: Settings, fake_worker: Callable[..., FakeWorker], tmp_path: Any
) -> None:
    """`submit --wait --timeout inf` ended in an OverflowError traceback, `--timeout nan` in a
    ValueError one (and `results --timeout nan` waited forever). inf is no limit; nan and a
    negative timeout are usage errors; `results.wait(timeout=nan)` is a ValidationError."""
    fake_worker(settings)
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "prompt": "hi"}\n{"id": "b", "prompt": "there"}\n')
    p = cli(settings, "submit", str(src), "--wait", "--timeout", "inf", timeout=60)
    assert p.returncode == 0, p.stderr
    burst = p.stdout.split()[-1]
    assert results.wait(burst, settings, timeout=float("inf")).done == 2
    with pytest.raises(ValidationError, match="not nan"):
        results.wait(burst, settings, timeout=float("nan"))
    for args in (("submit", str(src), "--wait"), ("results", burst)):
        for bad in ("nan", "-1"):
            p = cli(settings, *args, "--timeout", bad, timeout=60)
            assert p.returncode == 2 and "--timeout must be >= 0" in p.stderr, p.stderr


@pytest.mark.parametrize("garbage", [b"\xff\xfe not a result", b"", b"\x00" + b"\x81\xa1x\x01"])
def test_one_unreadable_result_costs_its_own_line_not_the_burst(
    settings: Settings, r: redis.Redis, garbage: bytes
) -> None:
    """A recorded result written over in Redis (garbage, empty, a valid encoding of the wrong
    shape) reads as a failed result with code internal_error that names its request; every
    other result of the burst is still read, in order, by every reader and by the command."""
    s = settings
    burst = served_burst(s, 6)
    r.hset(s.keys.results(burst), "3", garbage)
    for name in ("iterate", "collect"):
        got = every_reader(burst, s)[name]()
        assert [g.index for g in got] == list(range(6)), name
        assert [g.id for g in got] == [f"q{i}" for i in range(6)], name
        bad = got[3]
        assert bad.error_code == "internal_error" and "does not decode" in (bad.error or ""), name
        assert all(g.error is None for i, g in enumerate(got) if i != 3), name
    p = prefixq_results(s, burst)
    assert p.returncode == 0, p.stderr
    lines = [json.loads(x) for x in p.stdout.splitlines()]
    assert [x["id"] for x in lines] == [f"q{i}" for i in range(6)]
    assert "does not decode" in lines[3]["error"] and lines[2]["error"] is None


@pytest.mark.parametrize("bad", ["1", True, [1]], ids=repr)
def test_a_timeout_that_is_not_a_number_is_a_validation_error(
    settings: Settings, r: redis.Redis, bad: Any
) -> None:
    """`results.wait(timeout="1")` was a TypeError from math; `timeout=True` waited 1 s."""
    burst = Producer(settings).submit([{"id": "a", "prompt": "hi"}])
    with pytest.raises(ValidationError, match="timeout must be a number of seconds or None"):
        results.wait(burst, settings, timeout=bad)
    with pytest.raises(ValidationError, match="timeout must be a number of seconds or None"):
        next(results.iterate(burst, settings, timeout=bad))


def test_iterate_blocks_no_longer_than_its_timeout_leaves(
    settings: Settings, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`iterate(timeout=0.2)` on a burst nobody serves blocked a whole second per wait before it
    looked at its deadline; each wait is now cut to the time left."""
    burst = Producer(settings).submit([{"id": "a", "prompt": "hi"}])
    waits: list[int] = []
    block = results._Session.block

    def spy(self: Any, last: str, ms: int) -> str:
        waits.append(ms)
        return block(self, last, ms)

    monkeypatch.setattr(results._Session, "block", spy)
    with pytest.raises(BurstTimeout):
        list(results.iterate(burst, settings, timeout=0.2))
    assert waits and max(waits) <= 200


def test_a_read_in_order_that_waits_learns_the_record_is_gone(
    settings: Settings, r: redis.Redis
) -> None:
    """Given a burst with no worker and readers in input order waiting for its first result
    (`iterate`, `aiterate`, `prefixq results` without a timeout), when Redis loses its record
    (restarted empty, evicted), then each stops within seconds with BurstNotFound, `prefixq
    results` exiting 1 (before: they waited forever, or until their timeout)."""
    r.hset(settings.keys.config, "shards", 1)
    burst = Producer(settings).submit([{"id": f"q{i}", "prompt": "hi"} for i in range(3)]).id
    errors: dict[str, BaseException] = {}

    def sync() -> None:
        try:
            list(results.iterate(burst, settings))
        except BaseException as e:
            errors["iterate"] = e

    def aio() -> None:
        async def go() -> None:
            async for _ in results.aiterate(burst, settings):
                pass

        try:
            asyncio.run(go())
        except BaseException as e:
            errors["aiterate"] = e

    threads = [threading.Thread(target=f, daemon=True) for f in (sync, aio)]
    for t in threads:
        t.start()
    proc = subprocess.Popen(
        cli_argv(settings, "results", burst),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.5)  # each is waiting now
    assert not errors and proc.poll() is None
    for key in r.scan_iter(match=f"{settings.namespace}:*"):
        r.delete(key)
    for t in threads:
        t.join(10)
    assert {k: type(e) for k, e in errors.items()} == {
        "iterate": BurstNotFound,
        "aiterate": BurstNotFound,
    }, errors
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "never submitted, or its record expired" in err, err


@pytest.mark.parametrize(
    "value",
    [
        [1, 2],
        5,
        "hello",
        {"id": "q0", "i": 0, "x": 5},
        {"id": "q0", "i": 0, "x": "t", "ti": "abc"},
        {"id": "q0", "i": 0, "x": "t", "t": [1.0, "x", 0, 0]},
        {"id": "q0", "i": 0, "x": "t", "ch": [[0, None, None, "stop", [[1]]]]},
        {"i": 0, "x": "t"},
    ],
    ids=["list", "int", "str", "text-int", "token-ids-str", "timings-str", "choices", "no-id"],
)
def test_a_recorded_result_of_another_shape_costs_its_own_line_only(
    settings: Settings, r: redis.Redis, value: Any
) -> None:
    """Given a burst of 10 whose result 0 is overwritten in Redis with msgpack of another shape
    (not a map, or a map whose fields have other types), every reader returns the other 9 as
    they were and result 0 as a failed internal_error result that says it does not decode: it
    used to raise AttributeError out of collect(), or read a text of 5 as a success."""
    from prefixq.core import wire

    burst = served_burst(settings)
    r.hset(settings.keys.results(burst), "0", wire.encode(value))
    got = results.collect(burst, settings)
    assert len(got) == 10 and [x.error for x in got[1:]] == [None] * 9
    assert got[0].error_code == "internal_error" and "does not decode" in (got[0].error or "")
    assert got[0].id == "q0"
    first = next(iter(results.iterate(burst, settings, timeout=5)))
    assert first.error_code == "internal_error"
    p = prefixq_results(settings, burst)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.splitlines()[0])["error_code"] == "internal_error"
