"""Priorities end to end on a real vLLM CPU worker, through the CLI: a high-priority
burst submitted while a 2,000-request normal one runs finishes within 1.5x its own service time
plus one admission round."""

from __future__ import annotations

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
from prefixq.core.keys import Keys
from prefixq.core.records import Result
from prefixq.core.settings import Settings

pytestmark = pytest.mark.engine


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


def span(res: list[Result]) -> float:
    return max(x.timings.finished for x in res) - min(x.timings.enqueued for x in res)


def test_a_high_priority_burst_from_the_cli_overtakes_a_running_normal_one(
    redis_server: RedisServer, start_worker: Callable[..., Any], tmp_path: Path
) -> None:
    """Given a `prefixq worker` (vLLM on the CPU, 16 requests in flight) running a 2,000-request
    normal burst, `prefixq submit --priority high --wait` of 20 requests returns within 1.5x the
    time the same 20 took alone plus one admission round (the time the worker's in-flight window
    takes to turn over once at the normal burst's rate), long before the normal burst is done."""
    s = Settings(redis_url=redis_server.url, namespace=f"prio{secrets.token_hex(3)}", shards=1)
    start_worker(s, name="prio-w", extra=["--max-inflight", "16"]).wait_up()
    r = redis.Redis.from_url(s.redis_url)
    keys = Keys(s.namespace)
    normal = ""
    try:
        p = cli(s, "submit", lines(tmp_path / "a.jsonl", "a", 20), "--priority", "high", "--wait")
        assert p.returncode == 0, p.stderr
        own = span(wait_burst(r, s, p.stdout.split()[-1], 10))

        p = cli(s, "submit", lines(tmp_path / "n.jsonl", "n", 2000))
        assert p.returncode == 0, p.stderr
        normal = p.stdout.split()[-1]
        wait_until(lambda: r.hlen(keys.results(normal)) >= 40, 300, "the normal burst running")
        n0, t0 = r.hlen(keys.results(normal)), time.time()
        time.sleep(4.0)
        rate = (r.hlen(keys.results(normal)) - n0) / (time.time() - t0)
        round_s = 16 / rate  # the in-flight window, turned over once

        p = cli(s, "submit", lines(tmp_path / "h.jsonl", "h", 20), "--priority", "high", "--wait")
        assert p.returncode == 0, p.stderr
        took = span(wait_burst(r, s, p.stdout.split()[-1], 10))
        left = 2000 - r.hlen(keys.results(normal))
        print(
            f"  alone {own:.2f}s; behind the normal burst {took:.2f}s (bound 1.5 x {own:.2f} + "
            f"{round_s:.2f}s round at {rate:.1f} req/s); normal left {left}"
        )
        assert left > 1000, "the normal burst was still running"
        assert took <= 1.5 * own + round_s
    finally:
        if normal:  # the rest of it is not needed: cancelled, it ends at once
            cli(s, "cancel", normal)
        r.close()
