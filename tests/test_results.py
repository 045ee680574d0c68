"""Reading a burst's results (`prefixq.results`, `prefixq results`) when its record is gone or
partial: nothing reads as finished that is not (issue 11 item 7)."""

from __future__ import annotations

import io
import subprocess
from collections.abc import Callable
from typing import Any

import pytest
import redis

from helpers import FakeWorker, cli
from prefixq import results
from prefixq.errors import BurstNotFound, BurstRecordLost
from prefixq.producer import Producer
from prefixq.settings import Settings


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
