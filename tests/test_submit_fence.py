"""A submit's writes beside the record (client/enqueue.py `BurstWriter`): the deadline's index
entry must not be lost silently at create, and the submit's fence rides through an error that
a failover elsewhere leaves (adversarial probe, 5 December)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from prefixq.client import Producer
from prefixq.client import enqueue as enqueue_mod
from prefixq.core.errors import PrefixqError
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings


def test_a_deadline_the_index_refuses_at_create_fails_the_submit_and_cancels_the_burst(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """The deadline index's ZADD is refused while the record's script runs (on a cluster they
    are two masters: one down, the other up; here the index key holds another type): the submit
    fails and its burst is cancelled. Before: the error reply was ignored, submit returned, and
    the burst, never indexed, could never expire."""
    s = make_settings()
    keys = Keys(s.namespace)
    r.set(keys.deadlines, "not a sorted set")
    reqs = [{"id": f"q{i}", "prompt": f"hi {i}", "max_tokens": 4} for i in range(3)]
    with pytest.raises(PrefixqError, match="WRONGTYPE"):
        Producer(s).submit(reqs, burst_id="dl-refused", deadline=time.time() + 60)
    assert r.hget(keys.burst("dl-refused"), "status") == b"cancelled"


def test_the_submits_fence_rides_through_a_transient_error(
    make_settings: Callable[..., Settings],
    r: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A fence that meets a stale connection (a master not involved in the burst failed over and
    came back while the submit ran) fences again instead of failing and cancelling the burst;
    what it reads back is the submit's writes: the record, the deadline index entry and the
    stored prefix its entries refer to."""
    s = make_settings(min_replicas_acked=1, prefix_store_min_chars=16)
    calls: list[dict[str, Any]] = []

    async def afence(r: Any, settings: Settings, **proofs: Any) -> int:
        calls.append(proofs)
        if len(calls) == 1:
            raise redis.ConnectionError("Connection closed by server.")
        return 1

    monkeypatch.setattr(enqueue_mod, "afence", afence)
    reqs = [{"id": f"q{i}", "prefix": "a shared document " * 4, "prompt": f"q {i}",
             "max_tokens": 4} for i in range(8)]  # fmt: skip
    with caplog.at_level(logging.WARNING):
        burst = Producer(s).submit(reqs, burst_id="fence-again", deadline=time.time() + 60)
    # the deadline's own fence before the record (failed once, again), then the submit's
    assert str(burst) == "fence-again" and len(calls) == 3
    assert (
        calls[0]
        == calls[1]
        == {"written": (), "scored": {Keys(s.namespace).deadlines: ["fence-again"]}}
    )
    keys = Keys(s.namespace)
    assert r.hget(keys.burst("fence-again"), "status") == b"queued"
    proofs = calls[-1]
    assert set(proofs["scored"]) == {keys.deadlines}
    assert proofs["keys"] and all(k.startswith(keys.prefix("")) for k in proofs["keys"])
    assert all(r.exists(k) for k in proofs["keys"])
    assert "confirming its writes on the replicas" in caplog.text


def test_a_deadline_that_passes_during_the_submit_is_not_a_lost_write(
    make_settings: Callable[..., Settings], r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker may expire a burst whose deadline passed while it was being submitted, and drop
    its index entry: the fence does not read that entry back (it would fail a healthy submit
    as writes lost); a later deadline it does."""
    s = make_settings(min_replicas_acked=1)
    seen: list[dict[str, Any]] = []

    async def afence(r: Any, settings: Settings, **proofs: Any) -> int:
        seen.append(proofs)
        return 1

    monkeypatch.setattr(enqueue_mod, "afence", afence)
    reqs = [{"id": "q", "prompt": "hi", "max_tokens": 4}]
    Producer(s).submit(reqs, burst_id="soon", deadline=time.time() + 1)
    Producer(s).submit(reqs, burst_id="later", deadline=time.time() + 600)
    keys = Keys(s.namespace)
    # each: the deadline's own fence before the record, then the submit's
    assert [p["scored"] for p in seen] == [
        {keys.deadlines: ["soon"]},
        {},
        {keys.deadlines: ["later"]},
        {keys.deadlines: ["later"]},
    ]
