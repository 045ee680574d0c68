"""An elastic fleet at its edges, on real worker processes over the FakeEngine
(tests/fault_worker.py) and a real redis-server."""

from __future__ import annotations

import contextlib
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from helpers import cli, doc_burst, fault_worker, queued_entries, wait_until
from ledger import account
from prefixq.client import Producer
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings


def _settings(url: str, shards: int, **kw: Any) -> Settings:
    base: dict[str, Any] = {
        "redis_url": url,
        "namespace": f"edge{secrets.token_hex(3)}",
        "shards": shards,
        "heartbeat_s": 0.3,
        "heartbeat_ttl_s": 1.5,
        "orphan_after_s": 2.0,
        "claim_idle_s": 60.0,
        "grace_s": 3.0,
        "max_inflight": 2,
    }
    return Settings(**(base | kw))


def _start(s: Settings, log: Path, *args: str) -> subprocess.Popen[bytes]:
    ttl, orphan = str(s.heartbeat_ttl_s), str(s.orphan_after_s)
    return fault_worker(s, log, *args, "--heartbeat-ttl-s", ttl, "--orphan-after-s", orphan)


@contextlib.contextmanager
def _worker0(s: Settings, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Shard 0's worker ``w0`` while inside; stopped with SIGTERM at the end, and it exits 0."""
    w0 = _start(s, log, "--shard", "0", "--name", "w0")
    try:
        yield w0
    finally:
        w0.send_signal(signal.SIGTERM)
        assert w0.wait(30) == 0


@contextlib.contextmanager
def _stopped_at_exit(
    procs: list[subprocess.Popen[bytes]],
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``procs`` (the test adds the ones it starts): those still running at the end are stopped
    with SIGTERM."""
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(30)


def _all_once(
    r: redis.Redis, s: Settings, burst: str, n: int, what: str, wait_s: float = 60
) -> None:
    """Every one of the burst's ``n`` results comes within ``wait_s``, each once, none failed."""
    wait_until(lambda: r.hlen(Keys(s.namespace).results(burst)) >= n, wait_s, "every result")
    out = account(r, s, burst, n, what=what)
    assert (out.lost, out.duplicated, out.failed) == (0, 0, 0)


def _up(r: redis.Redis, s: Settings, shard: int, name: str) -> None:
    hb = Keys(s.namespace).heartbeat(shard, name)
    wait_until(lambda: r.hget(hb, "engine_up") == b"1", 60, f"worker {name} up")


def test_both_workers_handing_over_at_once_lose_nothing_and_a_joiner_ends_the_burst(
    redis_server: Any, r: redis.Redis, tmp_path: Path
) -> None:
    s = _settings(redis_server.url, 2)
    ws = [
        _start(s, tmp_path / f"w{k}.log", "--shard", str(k), "--name", f"w{k}", "--hand-over")
        for k in range(2)
    ]
    joiner = None
    try:
        for k in range(2):
            _up(r, s, k, f"w{k}")
        keys = Keys(s.namespace)
        burst = Producer(s).submit(doc_burst(12, 6))
        wait_until(lambda: r.hlen(keys.results(burst.id)) >= 6, 60, "6 results")
        for w in ws:
            w.send_signal(signal.SIGTERM)
        assert [w.wait(60) for w in ws] == [0, 0]
        left = sum(len(queued_entries(r, s, k)) for k in range(2))
        done = r.hlen(keys.results(burst.id))
        print("left", left, "done", done, [len(queued_entries(r, s, k)) for k in range(2)])
        joiner = _start(s, tmp_path / "j.log", "--join", "--name", "j")
        _all_once(r, s, burst.id, 72, "edge", wait_s=90)
    finally:
        for w in [*ws, *([joiner] if joiner else [])]:
            if w.poll() is None:
                w.send_signal(signal.SIGTERM)
                w.wait(30)
        for p in tmp_path.glob("*.log"):
            print(p.name, p.read_text()[-3000:])


def test_a_joiner_that_exits_before_serving_releases_its_shard_and_grows_no_count(
    redis_server: Any, r: redis.Redis, tmp_path: Path
) -> None:
    """Given one shard served, when joiners exit before their first heartbeat (stopped while
    their engine starts, an engine that fails to start, a model that does not exist), then each
    releases its hold: the next joiner takes the same shard, and the shard count grew once (it
    grew at every such restart: the hold stayed until it lapsed, so a crash-looping pod added a
    shard per restart)."""
    s = _settings(redis_server.url, 1)
    keys = Keys(s.namespace)
    with _stopped_at_exit(
        [_start(s, tmp_path / "w0.log", "--shard", "0", "--name", "w0")]
    ) as procs:
        _up(r, s, 0, "w0")
        log = tmp_path / "j1.log"
        j1 = _start(s, log, "--join", "--hold-join", "60", "--name", "j1")
        procs.append(j1)
        wait_until(lambda: b"as shard 1" in log.read_bytes(), 30, "j1 joined")
        assert r.hget(keys.joins, "1") is not None  # held while its engine starts
        j1.send_signal(signal.SIGTERM)
        assert j1.wait(30) == 0
        assert r.hget(keys.joins, "1") is None
        j2 = _start(s, tmp_path / "j2.log", "--join", "--fail-start", "--name", "j2")
        procs.append(j2)
        assert j2.wait(30) == 1
        assert b"as shard 1" in (tmp_path / "j2.log").read_bytes()
        bad = cli(s, "worker", "--join", "--model", str(tmp_path / "no-such-model"))
        assert bad.returncode == 2 and "does not exist" in bad.stderr, bad.stderr
        assert "as shard 1" in bad.stderr
        assert r.hget(keys.joins, "1") is None
        assert r.hget(keys.config, "shards") == b"2"
        log = tmp_path / "j3.log"
        j3 = _start(s, log, "--join", "--name", "j3")
        procs.append(j3)
        wait_until(lambda: b"as shard 1" in log.read_bytes(), 30, "j3 joined shard 1")
        _up(r, s, 1, "j3")
        assert r.hget(keys.config, "shards") == b"2"


def test_a_joiner_killed_while_its_engine_starts_holds_its_shard_only_while_it_renews(
    redis_server: Any, r: redis.Redis, tmp_path: Path
) -> None:
    """Given one shard served and a joiner whose engine start outlasts ``join_hold_s`` (1.5 s)
    several times over, its hold is renewed for as long as it starts; killed -9 meanwhile (an OOM
    kill while the model loads), the hold lapses within ``join_hold_s``, and the next joiner
    takes the same shard, serves it, and its first heartbeat ends the hold for good: the count
    grew once. (The hold was a fixed 15 minutes: each kill -9 while starting added a shard.)"""
    s = _settings(redis_server.url, 1)
    keys = Keys(s.namespace)
    hold = ("--join-hold-s", "1.5")
    with _stopped_at_exit(
        [_start(s, tmp_path / "w0.log", "--shard", "0", "--name", "w0")]
    ) as procs:
        _up(r, s, 0, "w0")
        log = tmp_path / "j1.log"
        j1 = _start(s, log, "--join", "--hold-join", "120", "--name", "j1", *hold)
        procs.append(j1)
        wait_until(lambda: b"as shard 1" in log.read_bytes(), 30, "j1 joined")
        first = float(r.hget(keys.joins, "1") or 0)
        time.sleep(4.0)  # past its first hold, more than once
        renewed = float(r.hget(keys.joins, "1") or 0)
        assert renewed > first and renewed > time.time(), (first, renewed, time.time())
        j1.send_signal(signal.SIGKILL)
        j1.wait(30)
        killed = time.time()
        wait_until(lambda: float(r.hget(keys.joins, "1") or 0) < time.time(), 10, "lapsed")
        assert time.time() - killed < 1.5 + 2.0  # the hold, and a loaded machine's delay
        log = tmp_path / "j2.log"
        j2 = _start(s, log, "--join", "--name", "j2", *hold)
        procs.append(j2)
        wait_until(lambda: b"as shard 1" in log.read_bytes(), 30, "j2 joined shard 1")
        _up(r, s, 1, "j2")
        time.sleep(1.0)  # renewals stop once the heartbeat has ended the hold
        assert r.hget(keys.joins, "1") is None
        assert r.hget(keys.config, "shards") == b"2"


def test_garbage_in_the_prefix_map_does_not_stop_an_orphaned_shards_queue_moving(
    redis_server: Any, r: redis.Redis, tmp_path: Path
) -> None:
    """Given an orphaned shard whose groups' prefix map entries hold values that are not shards
    (a hand edit), when the live worker looks, then the queue moves to it and is served (every
    look failed on the value with a traceback, and the queue waited for good)."""
    s = _settings(redis_server.url, 2)
    keys = Keys(s.namespace)
    for k in (0, 1):
        r.hset(keys.live, str(k), repr(time.time()))
    burst = Producer(s).submit(doc_burst(6, 3))
    for cp in r.hkeys(keys.prefix_map):
        r.hset(keys.prefix_map, cp, "garbage")
    r.hset(keys.live, "1", repr(time.time() - 60))  # shard 1's worker is long gone
    assert queued_entries(r, s, 1)
    with _worker0(s, tmp_path / "w0.log"):
        _all_once(r, s, burst.id, 18, "garbage map")
        assert b"Traceback" not in (tmp_path / "w0.log").read_bytes()


def test_times_that_are_not_times_hold_no_shard_live_held_or_unorphaned_for_good(
    redis_server: Any, r: redis.Redis, tmp_path: Path
) -> None:
    """Given shards whose live, orphans or joins fields hold a value that is a number but no time
    (inf, nan, a time centuries ahead: a hand edit, a restore), then a live worker moves their
    queues and serves them, and a joiner takes such a shard. Before, a beat of ``inf`` or
    ``1e300`` held its shard live for good (producers placed on it, its queue never moved), a
    first-seen time ahead kept it from being orphaned for good (HSETNX never replaced it), and such
    a hold made every joiner grow the count."""
    s = _settings(redis_server.url, 4)
    keys = Keys(s.namespace)
    for k in range(4):
        r.hset(keys.live, str(k), repr(time.time()))
    burst = Producer(s).submit(doc_burst(12, 2))
    assert all(queued_entries(r, s, k) for k in (1, 2, 3))
    r.hset(keys.live, mapping={"1": "inf", "2": "1e300", "3": "nan"})
    r.hset(keys.orphans, mapping={"2": "1e300", "3": "inf"})
    r.hdel(keys.live, "3")  # shard 3: never had a worker, as far as the hash says
    assert cli(s, "inspect", "--json").returncode == 0
    with _worker0(s, tmp_path / "w0.log"):
        _all_once(r, s, burst.id, 24, "not times")
        r.hset(keys.joins, mapping={"1": "1e300", "2": "inf", "3": "nan"})
        bad = cli(s, "worker", "--join", "--model", str(tmp_path / "no-such-model"))
        assert "as shard 1" in bad.stderr, bad.stderr
        assert r.hget(keys.config, "shards") == b"4"


def test_a_fleet_key_of_another_type_is_replaced_by_the_next_heartbeat(
    redis_server: Any, r: redis.Redis, tmp_path: Path
) -> None:
    """Given a serving worker, when something writes a string over the fleet's live, orphans,
    joins and tasks hashes and the shard's worker set, then within a few heartbeats each is its
    own type again and a burst submitted afterwards is served whole (before: every heartbeat,
    submit and inspect failed with WRONGTYPE until someone deleted the keys by hand)."""
    s = _settings(redis_server.url, 1)
    keys = Keys(s.namespace)
    with _worker0(s, tmp_path / "w0.log"):
        _up(r, s, 0, "w0")
        wanted = {keys.live: b"hash", keys.tasks: b"hash", keys.workers(0): b"zset"}
        for key in (*wanted, keys.orphans, keys.joins):
            r.delete(key)
            r.set(key, "garbage")

        def repaired() -> bool:
            return all(r.type(k) == t for k, t in wanted.items()) and all(
                r.type(k) in (b"hash", b"none") for k in (keys.orphans, keys.joins)
            )

        wait_until(repaired, 10, "the fleet's keys rebuilt by heartbeats")
        burst = Producer(s).submit(doc_burst(2, 3))
        _all_once(r, s, burst.id, 6, "fleet keys of another type")
        assert cli(s, "inspect", "--json").returncode == 0
        log = (tmp_path / "w0.log").read_text()
        assert "held a string, not a hash: replaced" in log and "Traceback" not in log


def test_placement_hints_of_another_type_are_replaced_by_the_submit_and_the_fleet(
    redis_server: Any, r: redis.Redis, tmp_path: Path
) -> None:
    """Given the load estimate and both generations of the prefix map written over with strings,
    when a burst is submitted (no worker up yet), then the submit replaces them, says so, and
    queues the burst; and when the load estimate is a string again while a worker serves, its
    fleet looks go on (before: every submit failed with WRONGTYPE, and a worker's fleet looks were
    skipped, so no orphaned shard's work moved, until a result happened to rewrite the key)."""
    s = _settings(str(redis_server.url), 1)
    keys = Keys(s.namespace)
    hints = (keys.load, keys.prefix_map, keys.prefix_map_old)
    for key in hints:
        r.set(key, "garbage")
    (tmp_path / "burst.jsonl").write_text(
        "".join(
            f'{{"id": "q{i}", "prefix": "{"document " * 40}", "prompt": "q{i}", "max_tokens": 4}}\n'
            for i in range(6)
        )
    )
    sub = cli(s, "submit", str(tmp_path / "burst.jsonl"), "--shards", "1")
    assert sub.returncode == 0, sub.stderr
    for key in hints:
        assert f"{key} held a string, not a hash: replaced" in sub.stderr, sub.stderr
        assert r.type(key) in (b"hash", b"none")
    burst = sub.stdout.split()[-1]
    log = tmp_path / "w0.log"
    with _worker0(s, log):
        _all_once(r, s, burst, 6, "placement hints of another type")
        r.delete(keys.load)
        r.set(keys.load, "garbage")
        wait_until(lambda: r.type(keys.load) == b"none", 10, "the fleet look replaced the load")
        again = Producer(s).submit(doc_burst(2, 3))
        _all_once(r, s, again.id, 6, "the load estimate of another type, mid-serve")
    text = log.read_text()
    assert "fleet looks skipped" not in text and "Traceback" not in text, text


def test_a_second_worker_under_a_name_in_use_on_the_shard_is_refused(
    redis_server: Any, r: redis.Redis, tmp_path: Path
) -> None:
    """Given worker w0 serving shard 0, when a second process starts on shard 0 as w0, then it
    exits 2 naming the name, the shard and the other process, and w0 goes on serving; a worker
    killed -9 leaves a heartbeat that no longer beats, and its restart under the same name
    starts (before: both served as one consumer, each resuming the other's pending entries)."""
    s = _settings(redis_server.url, 1)
    with _worker0(s, tmp_path / "w0.log") as w0:
        _up(r, s, 0, "w0")
        twin = _start(s, tmp_path / "twin.log", "--shard", "0", "--name", "w0")
        assert twin.wait(30) == 2
        text = (tmp_path / "twin.log").read_text()
        assert f"worker name 'w0' is in use on shard 0: pid {w0.pid}" in text, text
        assert "Traceback" not in text, text
        burst = Producer(s).submit(doc_burst(2, 3))
        _all_once(r, s, burst.id, 6, "the first of two workers under one name")
        other = _start(s, tmp_path / "w1.log", "--shard", "0", "--name", "w1")
        with _stopped_at_exit([other]):
            _up(r, s, 0, "w1")  # another name on the same shard: several workers, allowed
    dead = _start(s, tmp_path / "dead.log", "--shard", "0", "--name", "w9")
    _up(r, s, 0, "w9")
    dead.send_signal(signal.SIGKILL)
    dead.wait(10)
    assert r.exists(Keys(s.namespace).heartbeat(0, "w9"))  # it dies with its heartbeat there
    again = _start(s, tmp_path / "again.log", "--shard", "0", "--name", "w9")
    with _stopped_at_exit([again]):
        _up(r, s, 0, "w9")
        burst = Producer(s).submit(doc_burst(2, 3))
        _all_once(r, s, burst.id, 6, "a restart under a dead worker's name")
    assert "another process beats" not in (tmp_path / "again.log").read_text()  # no twin


def test_two_workers_started_at_once_under_one_name_are_told(
    redis_server: Any, r: redis.Redis, tmp_path: Path
) -> None:
    """Given two processes started at the same moment on shard 0 as w0 (neither beats yet when
    the other checks the name), then within a few heartbeats one is refused or an ERROR line
    names the other process (before: silence)."""
    s = _settings(redis_server.url, 1)
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = [_start(s, log, "--shard", "0", "--name", "w0") for log in logs]
    with _stopped_at_exit(procs):

        def told() -> bool:
            texts = [log.read_text() for log in logs]
            refused = any(p.poll() == 2 for p in procs) and any(
                "worker name 'w0' is in use" in t for t in texts
            )
            return refused or any("another process beats as worker 'w0'" in t for t in texts)

        wait_until(told, 20, "the second worker under one name refused or told")


def test_a_joiner_does_not_take_a_shard_whose_worker_is_starting(
    redis_server: Any, r: redis.Redis, tmp_path: Path
) -> None:
    """Given a 2-shard deployment, shard 0 served, shard 1's worker starting (no heartbeat yet:
    a restart whose last beat expired, its engine still loading), when a worker starts with
    --join, then it takes shard 2 (a new one), not shard 1 (before: both served shard 1, the
    joiner under the same default name)."""
    s = _settings(redis_server.url, 2)
    w0 = _start(s, tmp_path / "w0.log", "--shard", "0", "--name", "w0")
    slow = _start(s, tmp_path / "s1.log", "--shard", "1", "--name", "s1", "--hold-join", "20")
    with _stopped_at_exit([w0, slow]) as procs:
        _up(r, s, 0, "w0")
        wait_until(lambda: r.hexists(Keys(s.namespace).joins, "1"), 10, "shard 1 held")
        joiner = _start(s, tmp_path / "j.log", "--join", "--hold-join", "20")
        procs.append(joiner)
        wait_until(
            lambda: "joins the deployment as shard" in (tmp_path / "j.log").read_text(),
            10,
            "the joiner's shard",
        )
        assert "as shard 2" in (tmp_path / "j.log").read_text()
        assert r.hget(Keys(s.namespace).config, "shards") == b"3"


def test_a_joiner_started_right_after_a_kill_takes_the_dead_workers_shard(
    redis_server: Any, r: redis.Redis, tmp_path: Path
) -> None:
    """Given shards 0 and 1 served, when shard 1's worker is killed -9 and a --join worker
    starts at once (a pod restarted by its kubelet), then the joiner waits for the dead worker's
    heartbeat to lapse and takes shard 1: the count stays 2 (before: it grew to 3, and shard 1
    waited for orphan_after_s, `check` failing meanwhile)."""
    s = _settings(redis_server.url, 2)
    keys = Keys(s.namespace)
    w0 = _start(s, tmp_path / "w0.log", "--shard", "0", "--name", "w0")
    w1 = _start(s, tmp_path / "w1.log", "--shard", "1", "--name", "w1")
    with _stopped_at_exit([w0, w1]) as procs:
        _up(r, s, 0, "w0")
        _up(r, s, 1, "w1")
        w1.send_signal(signal.SIGKILL)
        w1.wait(10)
        joiner = _start(s, tmp_path / "j.log", "--join", "--name", "j")
        procs.append(joiner)
        _up(r, s, 1, "j")
        text = (tmp_path / "j.log").read_text()
        assert "joins the deployment as shard 1" in text, text
        assert r.hget(keys.config, "shards") == b"2"


def test_a_joins_hash_of_another_type_does_not_stop_a_join(
    redis_server: Any, r: redis.Redis, tmp_path: Path
) -> None:
    """Given no live worker (scaled to zero: no heartbeat repairs anything) and a string written
    over the joins hash, when a worker starts with --join, then it replaces the key, says so,
    and serves shard 0 (before: every join failed with WRONGTYPE, for good)."""
    s = _settings(redis_server.url, 1)
    r.hset(Keys(s.namespace).config, "shards", 1)
    r.set(Keys(s.namespace).joins, "garbage")
    joiner = _start(s, tmp_path / "j.log", "--join", "--name", "j")
    with _stopped_at_exit([joiner]):
        _up(r, s, 0, "j")
    text = (tmp_path / "j.log").read_text()
    assert "joins the deployment as shard 0" in text, text
    assert "held a string, not a hash: replaced" in text and "Traceback" not in text
