"""What expires, and when: stored prefixes live ``prefix_ttl_s`` from the last submit that used
them; a finished burst's record, results and events live ``result_ttl_s`` after its last write
(README's settings table; docs/architecture.md, "Keys")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis

from helpers import FakeWorker, wait_burst, wait_until
from prefixq.client import Producer
from prefixq.client.producer import HEAD
from prefixq.core.settings import Settings

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
