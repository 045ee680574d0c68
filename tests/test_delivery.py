"""The delivery guarantees, fast: leases, record-then-ack and dead-lettering by delivery count, on
a real Redis with the real `Worker` loop over tests/fake_engine.py (docs/delivery.md).

These are the fast tests that catch a broken guarantee (scripts/mutations.py breaks each one in a
copy of the package and runs them); the fault suite (tests/test_faults_*.py) shows the same
guarantees under real crashes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import redis

from helpers import (
    FakeWorker,
    pending_on,
    queue_empty,
    requests,
    wait_burst,
    wait_settled,
    wait_until,
)
from prefixq.client import Producer
from prefixq.core.keys import GROUP, Keys
from prefixq.core.settings import Settings

MakeWorker = Callable[..., FakeWorker]


def pending_rows(r: redis.Redis, s: Settings, shard: int = 0) -> list[dict[str, Any]]:
    """XPENDING rows of the shard's group: message_id, consumer, time_since_delivered (ms),
    times_delivered."""
    return list(r.xpending_range(Keys(s.namespace).stream(shard), GROUP, "-", "+", 1000))


def test_a_long_request_stays_leased_and_a_peer_never_takes_it(
    make_settings: Callable[..., Settings], fake_worker: MakeWorker, r: redis.Redis
) -> None:
    """Given a request that runs for three times claim_idle_s, its entry's idle time keeps being
    reset by its worker's heartbeat (never reaching claim_idle_s, delivered once), so the
    reclaimer of a live peer never takes it; its own worker records its result."""
    s = make_settings(claim_idle_s=1.0, heartbeat_s=0.2)
    fake_worker(s, name="a")
    burst = Producer(s).submit(requests(1, lambda i: "sleep:3 long"))
    wait_until(lambda: pending_on(r, s, "a") == 1, 10, "the request in flight on a")
    fake_worker(s, name="b")  # its reclaimer looks every 0.5 s for entries idle past 1 s
    seen: list[tuple[bytes, int, int]] = []
    deadline = time.monotonic() + 15
    while r.hlen(Keys(s.namespace).results(burst)) == 0:
        assert time.monotonic() < deadline, f"no result after 15 s; pending seen: {seen[-3:]}"
        for p in pending_rows(r, s):
            seen.append((p["consumer"], p["time_since_delivered"], p["times_delivered"]))
        time.sleep(0.05)
    assert len(seen) >= 20, "sampled while the request ran"
    assert {c for c, _, _ in seen} == {b"a"}, "only its own worker ever held it"
    assert max(idle for _, idle, _ in seen) < 1000, "idle time reset before claim_idle_s"
    assert {n for _, _, n in seen} == {1}, "never charged a second delivery"
    (res,) = wait_burst(r, s, burst, 10)
    assert (res.error, res.worker) == (None, "a")


def test_a_result_redis_refuses_to_record_leaves_its_entry_pending_until_recorded(
    settings: Settings, fake_worker: MakeWorker, r: redis.Redis
) -> None:
    """Given a finished request whose result Redis refuses to record (here the results key holds
    the wrong type, as a stand-in for OOM or READONLY), its entry is not acked: it stays pending
    and in the stream while the writer retries; once the record goes through, the entry is acked
    and deleted and the burst has its one result."""
    s, keys = settings, Keys(settings.namespace)
    fw = fake_worker(s)
    # 2 s in the engine: the results key is spoiled long before the record, even on a machine
    # busy enough to delay this process for a moment after the submit (0.3 s was missed so)
    burst = Producer(s).submit(requests(1, lambda i: "sleep:2 refused"))
    r.set(keys.results(burst), "not a hash")  # every record of this burst now fails (WRONGTYPE)
    try:
        wait_until(lambda: fw.engine.seen and not fw.engine.active, 10, "the request served")
        deadline = time.monotonic() + 1.5  # the writer tries at once, then backs off and retries
        while time.monotonic() < deadline:
            assert queue_empty(r, s) == (1, 1), "acked or deleted without its result"
            time.sleep(0.05)
        assert r.type(keys.results(burst)) == b"string", "nothing recorded meanwhile"
    finally:
        r.delete(keys.results(burst))  # the record goes through (and the worker can stop)
    (res,) = wait_burst(r, s, burst, 15)
    assert res.error is None and res.text == "refused sleep:2"
    wait_settled(r, s)
    assert r.hget(keys.burst(burst), "done") == b"1"


def ghost_deliveries(r: redis.Redis, s: Settings, consumer: str, times: list[int]) -> list[bytes]:
    """Deliver the shard's entries to ``consumer`` (a worker that then died): entry i is
    delivered ``times[i]`` times. Returns the entry ids."""
    stream = Keys(s.namespace).stream(0)
    r.xgroup_create(stream, GROUP, id="0")
    got = r.xreadgroup(GROUP, consumer, {stream: ">"}, count=len(times))
    ids = [entry_id for entry_id, _ in got[0][1]]
    for entry_id, n in zip(ids, times, strict=True):
        for _ in range(n - 1):
            r.xclaim(stream, GROUP, consumer, 0, [entry_id])
    rows = {p["message_id"]: p["times_delivered"] for p in pending_rows(r, s)}
    assert [rows[i] for i in ids] == times
    return ids


def test_an_entry_delivered_max_attempts_times_to_a_dead_worker_is_dead_lettered_not_run(
    make_settings: Callable[..., Settings], fake_worker: MakeWorker, r: redis.Redis
) -> None:
    """Given entries pending on a worker that died, delivered 1, 3 (= max_attempts) and 2 times,
    a live worker's reclaimer serves the first and the last and moves the one at the limit to
    the dead-letter stream with a failed result, without running it a fourth time."""
    s = make_settings(max_attempts=3, claim_idle_s=0.5, heartbeat_s=0.2)
    keys = Keys(s.namespace)
    burst = Producer(s).submit(requests(3))
    ids = ghost_deliveries(r, s, "ghost", [1, 3, 2])
    fw = fake_worker(s, name="live")
    got = wait_burst(r, s, burst, 20)
    assert [g.error for g in got] == [
        None,
        "dead-lettered: delivered 3 times (max_attempts=3)",
        None,
    ]
    assert not [x for x in fw.engine.seen if ids[1].decode() in x], "the dead letter never ran"
    (letter,) = [f for _, f in r.xrange(keys.dead(0))]
    assert (letter[b"entry"], letter[b"index"], letter[b"delivered"]) == (ids[1], b"1", b"3")
    wait_settled(r, s)


def test_a_restarted_worker_dead_letters_its_own_over_limit_entries_before_serving(
    make_settings: Callable[..., Settings], fake_worker: MakeWorker, r: redis.Redis
) -> None:
    """Given a worker that died with entries pending on its name, one of them delivered
    max_attempts times, the same worker restarted (long claim_idle_s: no reclaimer involved)
    dead-letters that one first and serves the others from its backlog."""
    s = make_settings(max_attempts=3, claim_idle_s=300.0)
    burst = Producer(s).submit(requests(3))
    ids = ghost_deliveries(r, s, "w0", [1, 3, 1])
    fw = fake_worker(s, name="w0")
    got = wait_burst(r, s, burst, 20)
    assert [g.error for g in got] == [
        None,
        "dead-lettered: delivered 3 times (max_attempts=3)",
        None,
    ]
    assert not [x for x in fw.engine.seen if ids[1].decode() in x], "the dead letter never ran"
    assert r.xlen(Keys(s.namespace).dead(0)) == 1
    wait_settled(r, s)
