"""Priorities end to end on a real vLLM CPU worker, through the CLI: a high-priority burst
submitted while a 2,000-request normal one runs is admitted ahead of the normal burst's waiting
requests.

What is asserted is the order the worker admits in (each result's ``timings.admitted``), not a
speed: a CPU engine under load turns its in-flight window over in waves of several seconds, so
"no result for N seconds" is no sign of a stall, and a bound computed from a measured rate is
noise. Waits are on progress: they fail only when nothing moved for far longer than the longest
gap already seen between two of the normal burst's results."""

from __future__ import annotations

import itertools
import json
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from helpers import cli, wait_burst, wait_until
from prefixq.cli.redis_server import RedisServer
from prefixq.core import wire
from prefixq.core.keys import Keys
from prefixq.core.records import Result
from prefixq.core.settings import Settings

#: vllm_compat: the engine is started with scheduling_policy=priority and given priorities
pytestmark = [pytest.mark.engine, pytest.mark.vllm_compat]

#: the worker's in-flight window: at most this many requests are inside its engine, so one read
#: round already under way when the high burst lands admits at most this many normal ones
WINDOW = 16
#: the high burst: several windows, so that admitting the two bursts in turn (or in order of
#: arrival) puts far more than WINDOW normal admissions among the high ones
HIGH = 4 * WINDOW
NORMAL = 2000
#: a stall is this many times the longest gap seen between two normal results
STALL_FACTOR = 10


def lines(path: Path, tag: str, n: int) -> str:
    path.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"{tag}{i}",
                    "prompt": f"Request {tag}{i}: write the numbers from one to forty:",
                    "max_tokens": 24,
                    "ignore_eos": True,
                }
            )
            + "\n"
            for i in range(n)
        )
    )
    return str(path)


def results_of(r: redis.Redis, keys: Keys, burst: str) -> list[Result]:
    return [Result.from_wire(wire.decode(v)) for v in r.hgetall(keys.results(burst)).values()]


def longest_gap(res: list[Result]) -> float:
    done = sorted(x.timings.finished for x in res)
    return max((b - a for a, b in itertools.pairwise(done)), default=0.0)


def wait_progress(count: Callable[[], int], target: int, stall_s: float, what: str) -> None:
    """Until ``count()`` reaches ``target``; fail if it stays the same for ``stall_s``."""
    last, since = count(), time.monotonic()
    while last < target:
        time.sleep(0.2)
        now = count()
        if now > last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since > stall_s:
            raise AssertionError(
                f"{what}: stuck at {last} of {target} for {stall_s:.1f}s ({STALL_FACTOR} x the "
                "longest gap seen between two normal results)"
            )


def test_a_high_priority_burst_from_the_cli_is_admitted_ahead_of_a_running_normal_one(
    redis_server: RedisServer, start_worker: Callable[..., Any], tmp_path: Path
) -> None:
    """Given a `prefixq worker` (vLLM on the CPU, 16 requests in flight) running a 2,000-request
    normal burst, a high-priority burst from `prefixq submit --priority high` is admitted ahead of
    the normal burst's waiting requests: once it is all enqueued, at most one read round (the
    in-flight window) of normal requests is admitted before its last request is, while normal
    requests still wait; and it completes long before the normal burst."""
    s = Settings(redis_url=redis_server.url, namespace=f"prio{secrets.token_hex(3)}", shards=1)
    w = start_worker(s, name="prio-w", extra=["--max-inflight", str(WINDOW)]).wait_up()
    r = redis.Redis.from_url(s.redis_url)
    keys = Keys(s.namespace)
    normal = ""
    try:
        p = cli(s, "submit", lines(tmp_path / "n.jsonl", "n", NORMAL))
        assert p.returncode == 0, p.stderr
        normal = p.stdout.split()[-1]
        n_done = lambda: r.hlen(keys.results(normal))  # noqa: E731
        # the engine's first waves (its warm-up included)
        wait_until(lambda: n_done() >= 3 * WINDOW, 600, "the normal burst running", every=0.2)
        stall_s = STALL_FACTOR * longest_gap(results_of(r, keys, normal))

        p = cli(s, "submit", lines(tmp_path / "h.jsonl", "h", HIGH), "--priority", "high")
        sent = time.time()  # every high entry is in Redis by now
        assert p.returncode == 0, p.stderr
        high = p.stdout.split()[-1]
        wait_progress(lambda: r.hlen(keys.results(high)), HIGH, stall_s, "the high burst")
        highs = wait_burst(r, s, high, 10)
        left = NORMAL - n_done()
        last_high = max(x.timings.admitted for x in highs)
        # every normal request admitted before the last high one has left the engine once a
        # window of normal ones admitted after it has (the engine runs same-priority requests
        # first come, first served)
        after = lambda: sum(  # noqa: E731
            x.timings.admitted > last_high for x in results_of(r, keys, normal)
        )
        wait_progress(after, WINDOW, stall_s, "normal requests admitted after the high burst")
        among = sorted(
            x.timings.admitted - sent
            for x in results_of(r, keys, normal)
            if sent < x.timings.admitted <= last_high
        )
        print(
            f"  high burst: {HIGH} admitted {min(x.timings.admitted for x in highs) - sent:+.2f}s"
            f" to {last_high - sent:+.2f}s after it was enqueued; normal admissions among them "
            f"{len(among)} (bound {WINDOW}); normal left when it completed {left}; stall bound "
            f"{stall_s:.1f}s"
        )
        assert left > WINDOW, f"the normal burst had only {left} requests left: none waited"
        assert len(among) <= WINDOW, (
            f"{len(among)} normal requests were admitted after the high burst was enqueued and "
            f"before its last request was (more than one window of {WINDOW}), at "
            f"{[round(t, 2) for t in among]} s after it was enqueued"
        )
    finally:
        if normal:  # the rest of it is not needed: cancelled, it ends at once
            cli(s, "cancel", normal)
        r.close()
        w.stop()  # its engine is not needed by any other test
