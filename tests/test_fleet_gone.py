"""What a worker leaves when it is gone, on real worker processes over the FakeEngine
(tests/fault_worker.py) and a real redis-server: the entries it had in flight go to a live worker
of its shard as soon as its heartbeat lapses (not after ``claim_idle_s``), and the lanes of a
shard left without a worker close."""

from __future__ import annotations

import secrets
import signal
import subprocess
from pathlib import Path
from typing import Any

import redis

from helpers import doc_burst, fault_worker, pending_on, requests, wait_until
from ledger import LEDGER, account
from prefixq.client import Producer
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings


def _settings(url: str, shards: int) -> Settings:
    return Settings(
        redis_url=url,
        namespace=f"gone{secrets.token_hex(3)}",
        shards=shards,
        heartbeat_s=0.3,
        heartbeat_ttl_s=1.5,
        orphan_after_s=2.0,
        claim_idle_s=60.0,  # far past every wait below: only a gone worker's entries move
        grace_s=3.0,
        max_inflight=2,
    )


def _start(s: Settings, log: Path, *args: str) -> subprocess.Popen[bytes]:
    ttl, orphan = str(s.heartbeat_ttl_s), str(s.orphan_after_s)
    return fault_worker(s, log, *args, "--heartbeat-ttl-s", ttl, "--orphan-after-s", orphan)


def _up(r: redis.Redis, s: Settings, shard: int, name: str) -> None:
    hb = Keys(s.namespace).heartbeat(shard, name)
    wait_until(lambda: r.hget(hb, "engine_up") == b"1", 60, f"worker {name} up")


def _reclaimed(r: redis.Redis, s: Settings, shard: int, name: str) -> int:
    return int(r.hget(Keys(s.namespace).heartbeat(shard, name), "reclaimed") or 0)


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        p.wait(30)


def test_a_killed_workers_entries_go_to_live_peers_at_once_and_a_slow_peer_keeps_its_own(
    redis_server: Any, r: redis.Redis, tmp_path: Path
) -> None:
    """Given one shard served by a, b and c, each holding 1.5-second requests, when b is killed -9,
    then a and c take b's entries over once its heartbeat lapses, well before claim_idle_s (60 s),
    and between them exactly as many as b held: a live peer busy with slow requests (its beat
    there) keeps its own, and two claimers do not take one entry from each other; every
    result comes once."""
    s = _settings(redis_server.url, 1)
    names = ("a", "b", "c")
    procs = [_start(s, tmp_path / f"{n}.log", "--shard", "0", "--name", n) for n in names]
    try:
        for n in names:
            _up(r, s, 0, n)
        n_req = 9
        burst = Producer(s).submit(requests(n_req, lambda i: f"sleep:1.5 q{i}"))
        wait_until(lambda: all(pending_on(r, s, n) >= 2 for n in names), 10, "each holds 2")
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(10)
        held = pending_on(r, s, "b")
        assert held >= 2
        LEDGER.fault(f"kill -9 of a worker holding {held} entries, two live peers")
        keys = Keys(s.namespace)
        wait_until(lambda: r.hlen(keys.results(burst.id)) >= n_req, 20, "every result")
        out = account(r, s, burst.id, n_req, what="gone")
        assert (out.lost, out.duplicated, out.failed) == (0, 0, 0)
        assert pending_on(r, s, "b") == 0
        assert _reclaimed(r, s, 0, "a") + _reclaimed(r, s, 0, "c") == held
    finally:
        _stop(procs)


def test_a_joiner_that_takes_a_killed_workers_shard_serves_its_in_flight_entries_at_once(
    redis_server: Any, r: redis.Redis, tmp_path: Path
) -> None:
    """Given the one shard's worker killed -9 with requests in flight, when a --join worker
    takes its shard, then it serves them once the dead worker's heartbeat lapsed (before: they
    waited claim_idle_s for its reclaimer, 60 s here, so a replacement made the burst end later
    than an orphan move without it would have)."""
    s = _settings(redis_server.url, 1)
    w = _start(s, tmp_path / "w.log", "--shard", "0", "--name", "w")
    procs = [w]
    try:
        _up(r, s, 0, "w")
        n_req = 6
        burst = Producer(s).submit(requests(n_req, lambda i: f"sleep:1 q{i}"))
        wait_until(lambda: pending_on(r, s, "w") >= 2, 10, "w holds 2")
        w.send_signal(signal.SIGKILL)
        w.wait(10)
        held = pending_on(r, s, "w")
        assert held >= 2
        LEDGER.fault(f"kill -9 of a worker holding {held} entries, then a joiner")
        procs.append(_start(s, tmp_path / "j.log", "--join", "--name", "j"))
        keys = Keys(s.namespace)
        wait_until(lambda: r.hlen(keys.results(burst.id)) >= n_req, 20, "every result")
        out = account(r, s, burst.id, n_req, what="joiner")
        assert (out.lost, out.duplicated, out.failed) == (0, 0, 0)
        assert _reclaimed(r, s, 0, "j") == held
        assert "joins the deployment as shard 0" in (tmp_path / "j.log").read_text()
    finally:
        _stop(procs)


def test_a_handed_over_shards_drained_lanes_close_with_its_queue_moved(
    redis_server: Any, r: redis.Redis, tmp_path: Path
) -> None:
    """Given a burst whose lanes on shard 1 still hold work, when shard 1's only worker stops
    with --hand-over, then its hand-over moves the queue and closes the emptied sealed lane with
    its lane index field, and the burst ends on shard 0 with every result once (before: a shard
    without a worker kept its bursts' empty lane streams and index fields for good)."""
    s = _settings(redis_server.url, 2)
    keys = Keys(s.namespace)
    w0 = _start(s, tmp_path / "w0.log", "--shard", "0", "--name", "w0")
    w1 = _start(s, tmp_path / "w1.log", "--shard", "1", "--name", "w1", "--hand-over")
    try:
        _up(r, s, 0, "w0")
        _up(r, s, 1, "w1")
        n_req = 8 * 6
        burst = Producer(s).submit(doc_burst(8, 6))
        lane = keys.lane(1, burst.id)
        assert r.exists(lane) and r.hexists(keys.lanes(1), burst.id)
        w1.send_signal(signal.SIGTERM)
        assert w1.wait(30) == 0
        assert "moved" in (tmp_path / "w1.log").read_text()
        assert not r.exists(lane)
        assert not r.hexists(keys.lanes(1), burst.id)
        wait_until(lambda: r.hlen(keys.results(burst.id)) >= n_req, 30, "every result")
        out = account(r, s, burst.id, n_req, what="lanes")
        assert (out.lost, out.duplicated, out.failed) == (0, 0, 0)
    finally:
        _stop([w0, w1])
