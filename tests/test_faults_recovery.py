"""Recovery without an engine: `prefixq reclaim`, `prefixq dead` and `dead --requeue`
(docs/delivery.md, "Stuck work").
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable

import pytest
import redis

from helpers import (
    FakeWorker,
    cli,
    pending_on,
    queue_empty,
    queue_keys,
    requests,
    wait_burst,
    wait_until,
)
from ledger import LEDGER, account
from prefixq.client import Producer
from prefixq.core import wire
from prefixq.core.entries import Entry
from prefixq.core.keys import CARRIED, FIELD, GROUP, Keys
from prefixq.core.records import Result
from prefixq.core.settings import Settings
from prefixq.ops.recovery import Recovery

pytestmark = pytest.mark.slow

MakeWorker = Callable[..., FakeWorker]


# ---- prefixq reclaim / prefixq dead ----------------------------------------------------------
def test_prefixq_reclaim_and_dead_requeue(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """Given entries pending on consumers that died (no heartbeat), in the shard's intake and in
    the burst's lane, `prefixq reclaim` moves the ones under max_attempts back to the intake
    (carrying their delivery count) and dead-letters
    the one past it (failing its request once); an entry on a live consumer is left alone; a
    worker then serves the moved ones, and dead-letters a moved entry whose carried count reaches
    the limit. `prefixq dead` lists the dead letters; `prefixq dead --requeue` takes their failed
    results back and re-submits them, and the burst ends with one successful result each."""
    s = make_settings(max_attempts=3, claim_idle_s=1.0, heartbeat_s=0.5)
    keys = Keys(s.namespace)
    stream = keys.stream(0)
    burst = Producer(s).submit(requests(8))
    queues = queue_keys(r, s)  # its head and doorbell in the intake, the rest in its lane
    for key in queues[:-1]:  # the lane has its group since the producer made it
        r.xgroup_create(key, GROUP, id="0", mkstream=True)
    got = r.xreadgroup(GROUP, "ghost", dict.fromkeys(queues, ">"), count=8)
    where = {  # input index -> (stream, entry id)
        Entry.from_wire(wire.decode(f[FIELD])).index: (key.decode(), entry_id)
        for key, rows in got
        for entry_id, f in rows
    }
    assert sorted(where) == list(range(8)) and len({k for k, _ in where.values()}) == 2

    def claim(i: int, consumer: str = "ghost", **kw: bool) -> None:
        key, entry_id = where[i]
        r.xclaim(key, GROUP, consumer, 0, [entry_id], **kw)

    claim(5)  # delivered 3 times: past max_attempts
    claim(5)
    claim(6)  # delivered 2 times
    claim(7, "busy", justid=True)  # on a live consumer
    r.set(keys.heartbeat(0, "busy"), "1", ex=60)
    assert (pending_on(r, s, "ghost"), pending_on(r, s, "busy")) == (7, 1)
    LEDGER.fault("a consumer died with 7 entries pending")

    p = cli(s, "reclaim", "--idle-s", "0", "--json")
    assert p.returncode == 0, p.stderr
    (rep,) = json.loads(p.stdout)
    print(f"  prefixq reclaim: {rep}")
    assert (rep["moved"], rep["dead"], rep["live"]) == (6, 1, 1)
    carried = {int(f.get(CARRIED, b"0")) for _, f in r.xrange(stream) if CARRIED in f}
    assert carried == {1, 2}
    # the moved entries are read by a consumer that dies too: for the one that had 2 deliveries,
    # that read was its 3rd, so the live worker's reclaimer dead-letters it instead of a 4th
    assert len(r.xreadgroup(GROUP, "ghost2", {stream: ">"}, count=100)[0][1]) == 6
    assert pending_on(r, s, "ghost2") == 6
    LEDGER.fault("a consumer died with 6 moved entries pending")
    r.delete(keys.heartbeat(0, "busy"))  # the busy consumer dies as well
    assert pending_on(r, s, "busy") == 1
    LEDGER.fault("a consumer's heartbeat expired with 1 entry pending")

    with fake_worker(s, name="rw"):
        wait_burst(r, s, burst, 30)
        out = account(r, s, burst, 8, what="after reclaim")
    assert (out.lost, out.duplicated, out.done, out.failed) == (0, 0, 6, 2)
    assert out.results[5].error == "dead-lettered: delivered 3 times (max_attempts=3)"
    assert out.results[6].error == "dead-lettered: delivered 3 times (max_attempts=3)"

    p = cli(s, "dead", "--json")
    assert p.returncode == 0, p.stderr
    letters = json.loads(p.stdout)
    print("  prefixq dead:", [(d["index"], d["delivered"], d["reason"]) for d in letters])
    assert sorted((d["burst"], d["index"], d["delivered"]) for d in letters) == [
        (burst, 5, 3),
        (burst, 6, 3),
    ]
    assert {d["worker"] for d in letters} == {"prefixq-reclaim", "rw"}

    p = cli(s, "dead", "--requeue", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {
        "requeued": 2,
        "cleared": 2,
        "resolved": 0,
        "skipped": [],
    }
    assert r.hget(keys.burst(burst), "failed") == b"0"
    with fake_worker(s, name="rw"):
        wait_burst(r, s, burst, 30)
        out = account(r, s, burst, 8, taken_back=2, what="after requeue")
    assert (out.lost, out.duplicated, out.done, out.failed) == (0, 0, 8, 0)
    assert r.xlen(keys.dead(0)) == 0 and queue_empty(r, s) == (0, 0)
    p = cli(s, "dead")
    assert p.returncode == 0 and p.stdout == ""


def test_dead_requeue_leaves_a_cancelled_bursts_letters_and_its_results_and_counts_alone(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """Given a burst whose entries died on a consumer, one dead-lettered before `prefixq cancel`
    and two after it (their requests already failed as cancelled), `dead --requeue` deletes the
    two as resolved (the cancel's result is their one result) and skips the first with the
    reason, leaving it in place: it takes back no result (neither the cancel's nor
    dead-lettering's), queues nothing, and the burst stays `cancelled` with its counts, also
    after a worker has run. (It used to take the cancelled results back and run the requests
    again: the burst then read `finished`, with `cancelled` counted twice.)"""
    s = make_settings(max_attempts=1)
    keys = Keys(s.namespace)
    burst = Producer(s).submit(requests(3))
    queues = queue_keys(r, s)
    for key in queues:
        with contextlib.suppress(redis.ResponseError):  # a lane has its group already
            r.xgroup_create(key, GROUP, id="0", mkstream=True)
    r.xreadgroup(GROUP, "ghost", dict.fromkeys(queues, ">"), count=1)
    assert pending_on(r, s, "ghost") == 1
    p = cli(s, "reclaim", "--idle-s", "0", "--max-attempts", "1", "--json")
    assert p.returncode == 0 and json.loads(p.stdout)[0]["dead"] == 1, p.stdout + p.stderr
    r.xreadgroup(GROUP, "ghost", dict.fromkeys(queues, ">"), count=8)
    assert pending_on(r, s, "ghost") == 2
    assert cli(s, "cancel", burst).returncode == 0
    p = cli(
        s, "reclaim", "--idle-s", "0", "--max-attempts", "1", "--json"
    )  # records nothing: they have results
    assert p.returncode == 0 and json.loads(p.stdout)[0]["dead"] == 2, p.stdout + p.stderr
    assert r.xlen(keys.dead(0)) == 3
    LEDGER.fault("a cancelled burst's 3 entries died on a consumer and were dead-lettered")
    record = r.hgetall(keys.burst(burst))
    results = r.hgetall(keys.results(burst))
    codes = sorted(Result.from_wire(wire.decode(v)).error_code or "" for v in results.values())
    assert codes == ["cancelled", "cancelled", "dead_lettered"]
    assert (record[b"status"], record[b"failed"], record[b"cancelled"]) == (
        b"cancelled",
        b"3",
        b"2",
    )

    p = cli(s, "dead", "--requeue", "--json")
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert (rep["requeued"], rep["cleared"], rep["resolved"]) == (0, 0, 2)
    assert [why for _, why in rep["skipped"]] == [
        f"burst {burst!r} was cancelled: it does not run again"
    ]
    assert r.xlen(keys.dead(0)) == 1
    assert queue_empty(r, s) == (0, 0)
    with fake_worker(s, name="rw"):
        time.sleep(1.0)  # a worker finds nothing to run
    out = account(r, s, burst, 3, what="after requeue of a cancelled burst")
    assert (out.lost, out.duplicated) == (0, 0)
    assert r.hgetall(keys.results(burst)) == results
    assert r.hgetall(keys.burst(burst)) == record


def test_dead_requeue_skips_a_letter_of_an_earlier_burst_of_the_same_id(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """Given a dead letter of a burst that finished and whose record expired, and a new burst
    submitted under the same id, `dead --requeue` skips the letter (it belongs to the earlier
    burst) and queues nothing: the old request never runs as the new burst's request of that
    index. (It was re-added, and its answer could have become the new burst's result.)"""
    s = make_settings(max_attempts=1, result_ttl_s=1)
    keys = Keys(s.namespace)
    Producer(s).submit(requests(3), burst_id="nightly")
    queues = queue_keys(r, s)
    for key in queues:
        with contextlib.suppress(redis.ResponseError):
            r.xgroup_create(key, GROUP, id="0", mkstream=True)
    r.xreadgroup(GROUP, "ghost", dict.fromkeys(queues, ">"), count=1)
    assert Recovery(s).reclaim(idle_s=0)[0].dead == 1
    LEDGER.fault("an entry of burst 'nightly' died on a consumer and was dead-lettered")
    with fake_worker(s, name="rw"):
        wait_burst(r, s, "nightly", 20)
    wait_until(lambda: not r.exists(keys.burst("nightly")), 10, "the record to expire")
    Producer(s).submit(requests(3, lambda i: f"again {i}"), burst_id="nightly")
    before = sum(r.xlen(k) for k in queue_keys(r, s))

    rep = Recovery(s).requeue()
    assert (rep.requeued, rep.cleared, rep.resolved) == (0, 0, 0)
    assert [why for _, why in rep.skipped] == ["it belongs to an earlier burst 'nightly'"]
    assert sum(r.xlen(k) for k in queue_keys(r, s)) == before == 3
    assert r.xlen(keys.dead(0)) == 1
