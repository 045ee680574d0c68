"""Bursts sharing a worker: priorities, equal shares between bursts, tenant weights and
caps, measured on the real worker loop and real Redis with the deterministic FakeEngine, whose
``sleep:S`` prompts take a fixed service time. Bounds are the issue's, over enough requests that
a loaded machine does not move them (scripts/fairness.py measures the same at full size)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import redis

from helpers import FakeWorker, queue_empty, wait_burst, wait_until
from ledger import account
from prefixq.client import Producer
from prefixq.core import wire
from prefixq.core.keys import Keys
from prefixq.core.records import Result
from prefixq.core.settings import Settings
from prefixq.store import burst_end

MakeWorker = Callable[..., FakeWorker]


def sleepy(n: int, secs: float, tag: str = "q") -> list[dict[str, Any]]:
    return [
        {"id": f"{tag}{i}", "prompt": f"sleep:{secs} {tag} {i}", "max_tokens": 4} for i in range(n)
    ]


def done_in(res: list[Result], start: float, end: float) -> int:
    return sum(1 for x in res if start <= x.timings.finished <= end)


def finished(r: redis.Redis, s: Settings, burst: str) -> list[Result]:
    raw = r.hgetall(Keys(s.namespace).results(burst))
    return [Result.from_wire(wire.decode(v)) for v in raw.values()]


def cancel_and_account(r: redis.Redis, s: Settings, burst: str, total: int) -> None:
    """End a long burst early; every request still gets exactly one result."""
    burst_end.cancel(burst, s)
    wait_burst(r, s, burst, 60)
    out = account(r, s, burst, total, what="cancelled after the measurement")
    assert out.lost == 0 and out.duplicated == 0


def test_a_high_priority_burst_overtakes_a_running_normal_one(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """Given a 2,000-request normal burst running, a high-priority burst of four windows is
    admitted ahead of the normal burst's waiting requests: once it is all enqueued, at most one
    read round (the in-flight window) of normal requests is admitted before its last request is.
    The order of admissions is asserted, not a time: a loaded machine does not move it (taking the
    bursts in turn, or in order of arrival, puts about one normal admission per high one, or all
    of them, among the high burst's)."""
    svc, window = 0.2, 8
    s = make_settings(max_inflight=window)
    fake_worker(s)
    normal = Producer(s).submit(sleepy(2000, svc, "n"))
    wait_until(
        lambda: r.hlen(Keys(s.namespace).results(normal)) >= 40, 60, "the normal burst running"
    )
    high = Producer(s).submit(sleepy(4 * window, svc, "h"), priority="high")
    sent = time.time()  # every high entry is in Redis by now
    highs = wait_burst(r, s, high, 60)
    left = 2000 - r.hlen(Keys(s.namespace).results(normal))
    last_high = max(x.timings.admitted for x in highs)
    # a window of normal requests admitted after the last high one has finished: every normal
    # one admitted before it has (the fake engine's service time is the same for all)
    wait_until(
        lambda: sum(x.timings.admitted > last_high for x in finished(r, s, normal)) >= window,
        60,
        "normal requests admitted after the high burst",
    )
    among = [
        x.timings.admitted - sent
        for x in finished(r, s, normal)
        if sent < x.timings.admitted <= last_high
    ]
    print(f"  normal admissions among the high burst's: {len(among)}; normal left {left}")
    assert left > window, f"the normal burst had only {left} requests left: none waited"
    assert len(among) <= window, (
        f"{len(among)} normal requests admitted after the high burst was enqueued and before its "
        f"last request was (bound: one window of {window}), at {sorted(among)} s"
    )
    cancel_and_account(r, s, normal, 2000)


def test_two_equal_bursts_progress_at_equal_rates_whatever_their_size_and_order(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """Bursts of 1,000 and 200 requests submitted 1 s apart: while both have work, their
    completion rates are within 20% of each other."""
    svc = 0.05
    s = make_settings(max_inflight=8)
    fake_worker(s)
    big = Producer(s).submit(sleepy(1000, svc, "b"))
    time.sleep(1.0)
    small = Producer(s).submit(sleepy(200, svc, "s"))
    got = wait_burst(r, s, small, 60)
    start, end = min(x.timings.finished for x in got), max(x.timings.finished for x in got)
    n_big, n_small = done_in(finished(r, s, big), start, end), len(got)
    print(f"  while both ran ({end - start:.2f}s): big {n_big}, small {n_small}")
    assert 1 / 1.2 <= n_big / n_small <= 1.2
    cancel_and_account(r, s, big, 1000)


def test_tenants_with_backlog_are_served_by_their_weights(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """Two tenants weighted 3:1, both with a backlog: served 3:1 (within 10%) while both have
    work."""
    svc = 0.05
    s = make_settings(max_inflight=8, tenant_weights="gold=3,iron=1")
    r.hset(Keys(s.namespace).config, "shards", 1)
    gold = Producer(s).submit(sleepy(300, svc, "g"), tenant="gold")
    iron = Producer(s).submit(sleepy(300, svc, "i"), tenant="iron")
    fake_worker(s)
    got = wait_burst(r, s, gold, 60)
    end = max(x.timings.finished for x in got)
    n_iron = done_in(finished(r, s, iron), 0.0, end)
    print(f"  until gold finished: gold 300, iron {n_iron} ({300 / n_iron:.2f}:1)")
    assert 2.7 <= 300 / n_iron <= 3.3
    wait_burst(r, s, iron, 60)


def test_a_capped_tenant_never_has_more_than_its_cap_in_the_engine(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """A tenant capped at 2 requests in the engine never has more there, however much room the
    worker has; another tenant fills the rest, and both complete."""
    s = make_settings(max_inflight=8, tenant_caps="small=2")
    r.hset(Keys(s.namespace).config, "shards", 1)
    capped = Producer(s).submit(sleepy(40, 0.05, "c"), tenant="small")
    other = Producer(s).submit(sleepy(40, 0.05, "o"), tenant="big")
    fake_worker(s)
    res = wait_burst(r, s, capped, 60)
    events = sorted(
        [(x.timings.admitted, 1) for x in res] + [(x.timings.finished, -1) for x in res]
    )
    most = max(itertools.accumulate(d for _, d in events))
    print(f"  most requests of the capped tenant in the engine at once: {most}")
    assert most <= 2
    wait_burst(r, s, other, 60)


def test_many_small_bursts_all_complete_and_leave_no_lane_behind(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """200 bursts of 10 requests at once (each with a lane beyond its head): each gets its
    results, and once they are done every lane is closed and the shard's queues are empty."""
    s = make_settings()
    fake_worker(s)
    keys = Keys(s.namespace)
    producer = Producer(s)
    ids = [producer.submit(sleepy(10, 0.0, f"b{b}-")) for b in range(200)]
    for burst in ids:
        assert len(wait_burst(r, s, burst, 120)) == 10
    wait_until(lambda: r.hlen(keys.lanes(0)) == 0, 30, "every lane closed")
    assert queue_empty(r, s) == (0, 0)
    assert not list(r.scan_iter(match=f"{s.namespace}:{{s0}}:lane:*"))
