"""What expires, and when: stored prefixes live ``prefix_ttl_s`` from the last submit that used
them; a finished burst's record, results and events live ``result_ttl_s`` after its last write
(README's settings table; docs/architecture.md, "Keys")."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from helpers import FakeWorker, wait_burst, wait_until
from prefixq.client import Producer
from prefixq.client import producer as producer_module
from prefixq.client.producer import HEAD
from prefixq.core.settings import Settings
from prefixq.worker import lane_scripts

DOC = "A shared document about the subject at hand, long enough to be stored once. " * 12


def questions(tag: str, n: int = HEAD + 2) -> list[dict[str, Any]]:
    """``n`` requests sharing DOC as their prefix (stored once, referenced by hash, by the
    requests after the burst's head, which carries it inline)."""
    return [
        {"id": f"{tag}{i}", "prefix": DOC, "prompt": f" question {i}", "max_tokens": 4}
        for i in range(n)
    ]


def test_a_stored_prefix_lives_prefix_ttl_s_from_the_last_submit_that_used_it(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """A prefix used by several requests is stored once with a prefix_ttl_s TTL; a later submit that
    uses it again (the value already stored) sets its TTL back to prefix_ttl_s."""
    s = make_settings(prefix_ttl_s=100)
    Producer(s).submit(questions("a"))
    (key,) = r.keys(f"{s.namespace}:prefix:*")
    assert 90 < r.ttl(key) <= 100
    r.expire(key, 5)  # as if most of its life had passed
    stored = r.get(key)
    Producer(s).submit(questions("b"))
    assert r.keys(f"{s.namespace}:prefix:*") == [key] and r.get(key) == stored
    assert 90 < r.ttl(key) <= 100, "the second submit refreshed it"


def test_a_burst_expires_result_ttl_s_after_its_last_write(
    make_settings: Callable[..., Settings], fake_worker: Callable[..., FakeWorker], r: redis.Redis
) -> None:
    """With result_ttl_s=2, a finished burst's record, results and events carry a TTL of at
    most 2 s from its last recorded result, and are gone once it has passed."""
    s = make_settings(result_ttl_s=2)
    fake_worker(s)
    burst = Producer(s).submit([{"id": f"q{i}", "prompt": f"hi {i}"} for i in range(3)])
    wait_burst(r, s, burst, 20)
    keys = [s.keys.burst(burst), s.keys.results(burst), s.keys.events(burst)]
    ttls = [r.pttl(k) for k in keys]
    assert all(0 < t <= 2000 for t in ttls), ttls
    wait_until(lambda: r.exists(*keys) == 0, 10, "the burst's keys expired")


class ProducerDied(BaseException):
    """The producer ends here: nothing after it runs (no cancel, no seal)."""


def test_the_lane_of_a_burst_whose_producer_died_goes_once_the_burst_expired(
    make_settings: Callable[..., Settings],
    fake_worker: Callable[..., FakeWorker],
    r: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given a producer that died after its burst's second chunk (the burst has a lane on the
    shard, never sealed), when the burst's deadline passes, a worker expires it and, once the
    lane has been idle `ENDED_IDLE_MS`, closes it: the lane's stream and its lane index entry
    are gone. Before: an unsealed lane counted as one that may still grow at every refresh of
    the lane index, so the worker never asked to close it, and both stayed for good."""
    monkeypatch.setattr(lane_scripts, "ENDED_IDLE_MS", 300)
    send, calls = producer_module._Submission._send, [0]

    async def dies_after_two(self: Any, *a: Any, **kw: Any) -> None:
        await send(self, *a, **kw)
        calls[0] += 1
        if calls[0] == 2:
            raise ProducerDied

    monkeypatch.setattr(producer_module._Submission, "_send", dies_after_two)
    s = make_settings(shards=1)
    keys = s.keys
    r.hset(keys.config, "shards", 1)
    with pytest.raises(ProducerDied):
        Producer(s).submit(questions("x", 60), burst_id="died", deadline=time.time() + 1.5)
    assert r.hget(keys.lanes(0), "died") is not None, "the second chunk made a lane"
    fake_worker(s)
    wait_until(lambda: r.hget(keys.burst("died"), "status") == b"expired", 15, "the expiry")
    lane = [keys.lane(0, "died"), keys.lanes(0)]
    wait_until(lambda: r.exists(*lane) == 0, 10, "the lane and its index entry to go")
