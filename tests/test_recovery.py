"""Dead letters, fast: `prefixq dead --requeue`'s resolved and skipped paths, and the dead-letter
stream's cap, on a real Redis with the real `Worker` loop over tests/fake_engine.py
(docs/delivery.md, "`prefixq dead` and `prefixq dead --requeue`"; "Limits").

The whole reclaim -> dead letter -> requeue path through the CLI is in
tests/test_faults_recovery.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

from helpers import FakeWorker, cli, requests, wait_burst, wait_settled, wait_until
from prefixq.client import Producer
from prefixq.core.keys import FIELD, GROUP, Keys
from prefixq.core.settings import Settings
from prefixq.ops.recovery import Recovery, RequeueReport

MakeWorker = Callable[..., FakeWorker]

#: docs/delivery.md: "The dead-letter stream is capped at about 100,000 entries per shard"
DEAD_CAP = 100_000
#: approximate trimming (MAXLEN ~) removes whole stream nodes (stream-node-max-entries = 100)
NODE = 100


def dead_letter(r: redis.Redis, s: Settings, data: bytes | None, **fields: object) -> bytes:
    """A dead letter as a worker writes it, straight into the shard's dead-letter stream."""
    record: dict[str, object] = {
        "entry": "1-0",
        "shard": 0,
        "reason": "delivered 3 times (max_attempts=3)",
        "delivered": 3,
        "at": time.time(),
        "worker": "w",
        **fields,
    }
    if data is not None:
        record[FIELD.decode()] = data
    return r.xadd(Keys(s.namespace).dead(0), record)  # type: ignore[arg-type]


def test_requeue_only_deletes_a_dead_letter_whose_request_has_succeeded(
    settings: Settings, fake_worker: MakeWorker, r: redis.Redis
) -> None:
    """Given a dead letter whose request has a successful result anyway (an earlier delivery
    finished after all), `dead --requeue` deletes it as resolved and runs nothing again."""
    s, keys = settings, Keys(settings.namespace)
    burst = Producer(s).submit(requests(1))
    ((entry_id, fields),) = r.xrange(keys.stream(0))
    fake_worker(s)
    wait_burst(r, s, burst, 20)
    wait_settled(r, s)
    before = r.hgetall(keys.results(burst))
    dead_letter(r, s, fields[FIELD], entry=entry_id, burst=burst, index=0)

    rep = Recovery(s).requeue()
    assert rep == RequeueReport(requeued=0, cleared=0, resolved=1, skipped=[])
    assert r.xlen(keys.dead(0)) == 0
    time.sleep(0.3)  # nothing was queued for the worker: nothing recorded again
    assert (r.xlen(keys.stream(0)), r.hgetall(keys.results(burst))) == (0, before)
    assert r.xlen(keys.events(burst)) == 1


def test_requeue_skips_dead_letters_without_a_payload_it_could_run_and_leaves_them(
    settings: Settings, r: redis.Redis
) -> None:
    """Dead letters without a payload (the entry had no 'd' field) or whose payload does not
    decode are skipped with the reason, left in place, and nothing is queued; `prefixq dead
    --requeue` reports them on stderr and exits 0."""
    s, keys = settings, Keys(settings.namespace)
    r.hset(keys.config, "shards", 1)
    bare = dead_letter(r, s, None, reason="entry has no 'd' field", delivered=1)
    garbage = dead_letter(r, s, b"\x01garbage", reason="undecodable: corrupt", delivered=1)

    rep = Recovery(s).requeue()
    assert (rep.requeued, rep.cleared, rep.resolved) == (0, 0, 0)
    assert [(i, why.split(" (")[0]) for i, why in rep.skipped] == [
        (bare.decode(), "no payload to requeue"),
        (garbage.decode(), "payload does not decode"),
    ]
    assert [i for i, _ in r.xrange(keys.dead(0))] == [bare, garbage]
    assert not r.exists(keys.stream(0))

    p = cli(s, "dead", "--requeue")
    assert p.returncode == 0, p.stderr
    assert "requeued 0" in p.stdout and "2 skipped" in p.stdout
    assert f"skipped {bare.decode()}: no payload to requeue" in p.stderr
    assert f"skipped {garbage.decode()}: payload does not decode" in p.stderr
    assert r.xlen(keys.dead(0)) == 2


def test_the_dead_letter_stream_is_capped_and_trims_its_oldest(
    make_settings: Callable[..., Settings], fake_worker: MakeWorker, r: redis.Redis
) -> None:
    """Given a shard's dead-letter stream already past its cap, a worker's new dead letter and
    one `prefixq reclaim` writes trim it back to about 100,000 entries, oldest first; the new
    letters are kept."""
    s = make_settings(max_attempts=1)
    keys = Keys(s.namespace)
    r.hset(keys.config, "shards", 1)
    pipe = r.pipeline(transaction=False)
    for i in range(DEAD_CAP + 5 * NODE):
        pipe.xadd(keys.dead(0), {"entry": "0-1", "reason": f"old {i}"})
        if i % 10_000 == 0:
            pipe.execute()
    pipe.execute()
    first_old = r.xrange(keys.dead(0), count=1)[0][0]

    with fake_worker(s):
        bad = r.xadd(keys.stream(0), {FIELD: b"\x01garbage"})
        wait_until(lambda: r.xrevrange(keys.dead(0), count=1)[0][1][b"entry"] == bad, 10, "dead")
    n = r.xlen(keys.dead(0))
    assert DEAD_CAP <= n <= DEAD_CAP + NODE, n

    # an entry pending on a dead consumer, past max_attempts: `prefixq reclaim` dead-letters it
    burst = Producer(s).submit(requests(1))
    ((_, got),) = r.xreadgroup(GROUP, "ghost", {keys.stream(0): ">"}, count=1)
    (rep,) = Recovery(s).reclaim(idle_s=0)
    assert rep.dead == 1
    last = r.xrevrange(keys.dead(0), count=1)[0][1]
    assert (last[b"entry"], last[b"burst"].decode()) == (got[0][0], burst)
    assert DEAD_CAP <= r.xlen(keys.dead(0)) <= DEAD_CAP + NODE
    assert r.xrange(keys.dead(0), count=1)[0][0] > first_old, "the oldest were trimmed"


def test_requeue_of_an_id_that_is_no_dead_letter_says_so(
    settings: Settings, r: redis.Redis
) -> None:
    """`dead --requeue --id X` for an X that is not (or no longer) a dead letter reported
    "0 skipped" and nothing else; it is now skipped with the reason, the others still run."""
    s, keys = settings, Keys(settings.namespace)
    r.hset(keys.config, "shards", 1)
    bare = dead_letter(r, s, None, reason="entry has no 'd' field", delivered=1).decode()
    rep = Recovery(s).requeue(ids=["1-0", bare, "1-0"])
    assert [(i, why.split(" (")[0]) for i, why in rep.skipped] == [
        (bare, "no payload to requeue"),
        ("1-0", "no such dead letter"),
    ]
    p = cli(s, "dead", "--requeue", "--id", "2-0")
    assert p.returncode == 0 and "1 skipped" in p.stdout, p.stdout
    assert "skipped 2-0: no such dead letter" in p.stderr


def test_requeue_leaves_the_dead_letters_of_a_batch_whose_files_are_written(
    make_settings: Callable[..., Settings], fake_worker: MakeWorker, r: redis.Redis
) -> None:
    """Given a Batch API batch's request dead-lettered (its burst has the batch's id), when the
    batch is final (its output and error files written from the burst's results), then `prefixq
    dead --requeue` leaves the letter, saying why, and the failed result stays; while the batch is
    in progress, the letter is requeued and its request runs again. (Before: a final batch's
    request ran again, its burst finished a second time, and the batch's files and counts no
    longer matched its results.)"""
    s = make_settings(max_attempts=1)
    keys = Keys(s.namespace)
    r.hset(keys.config, "shards", 1)
    r.xgroup_create(keys.stream(0), GROUP, id="0", mkstream=True)  # no worker has joined yet
    for status, runs in (("completed", False), ("in_progress", True)):
        burst = Producer(s).submit(requests(1), burst_id=f"batch_{status}")
        r.hset(keys.oai_batch(burst), mapping={"status": status, "burst": burst})
        assert r.xreadgroup(GROUP, "ghost", {keys.stream(0): ">"}, count=10)
        (rep,) = Recovery(s).reclaim(idle_s=0)
        assert rep.dead == 1
        assert wait_burst(r, s, burst, 5)[0].error_code == "dead_lettered"
        got = Recovery(s).requeue()
        if runs:
            assert (got.requeued, got.cleared, got.skipped) == (1, 1, [])
            with fake_worker(s, name="rq0"):
                wait_until(lambda: r.hget(keys.burst(burst), "done") == b"1", 20, "served")  # noqa: B023
        else:
            ((_, why),) = got.skipped
            assert (
                got.requeued == 0 and why == f"batch {burst!r} is completed: its files are written"
            )
            assert r.xlen(keys.dead(0)) == 1
            assert wait_burst(r, s, burst, 5)[0].error_code == "dead_lettered"
            r.delete(keys.dead(0))
