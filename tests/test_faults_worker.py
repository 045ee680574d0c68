"""Worker faults: a crash between recording and acking, SIGTERM, a poison entry under the
supervisor, kill -9 of a worker and of its vLLM engine core (docs/delivery.md).

Workers are real `Worker` loops over the deterministic tests/fake_engine.py (in a thread through
the `fake_worker` fixture, or in a process through tests/fault_worker.py), or `prefixq worker`
processes with the real vLLM CPU engine (the tests marked ``engine``). Each test adds the faults it
saw land and the requests its bursts lost or doubled to the ledger (tests/ledger.py).
"""

from __future__ import annotations

import secrets
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from conftest import WorkerProc
from helpers import (
    FakeWorker,
    fault_worker,
    kill_tree,
    pending_on,
    queue_empty,
    requests,
    wait_burst,
    wait_settled,
    wait_until,
)
from ledger import LEDGER, account
from prefixq.cli.redis_server import RedisServer
from prefixq.client import Producer
from prefixq.core import wire
from prefixq.core.keys import Keys
from prefixq.core.records import Result
from prefixq.core.settings import Settings
from prefixq.worker.worker import stop_bound_s

pytestmark = pytest.mark.slow

MakeWorker = Callable[..., FakeWorker]


# ---- kill -9 of a worker, engine death: the real vLLM CPU engine ----------------------------
@dataclass
class RealPair:
    settings: Settings
    a: WorkerProc
    b: WorkerProc


@pytest.fixture(scope="module")
def real_pair(request: pytest.FixtureRequest, redis_server: RedisServer) -> RealPair:
    """Two `prefixq worker` processes (real engine) on one shard of a fresh namespace; started at
    once, so that their ~25 s engine start-up overlaps the FakeEngine tests."""
    start_worker = request.getfixturevalue("start_worker")
    s = Settings(
        redis_url=redis_server.url,
        namespace=f"kill{secrets.token_hex(3)}",
        shards=1,
        # a live worker renews its lease every 0.5 s; 10 s keeps a peer from taking a live
        # worker's entries while two CPU engines and the tests share 2 cores (seen at 3 s in CI)
        claim_idle_s=10.0,
        heartbeat_s=0.5,
        grace_s=30.0,
        max_attempts=3,
    )
    extra = ["--max-inflight", "8", "--heartbeat-ttl-s", "10"]
    a = start_worker(s, name="real-a", extra=extra)
    b = start_worker(s, name="real-b", extra=extra)
    return RealPair(s, a, b)


@pytest.fixture(scope="module", autouse=True)
def _start_engines_early(request: pytest.FixtureRequest) -> None:
    if any(
        item.get_closest_marker("engine") is not None and item.module is request.module
        for item in request.session.items
    ):
        request.getfixturevalue("real_pair")


def test_crash_after_results_written_before_ack_records_no_duplicate(
    make_settings: Callable[..., Settings], r: redis.Redis, tmp_path: Path, fake_worker: MakeWorker
) -> None:
    """Given a worker process that records a batch of results and dies before acking it, when a
    worker with the same name restarts, it is redelivered those entries and only acks them: every
    request has one result and the burst's counters are not raised twice."""
    s = make_settings(max_inflight=4, write_batch=64)
    proc = fault_worker(s, tmp_path / "crash.log", "--name", "w0", "--crash-after-record")
    burst = Producer(s).submit(requests(12, lambda i: f"sleep:0.2 crash {i}"))
    assert proc.wait(60) == 137, (tmp_path / "crash.log").read_text()[-3000:]
    keys = Keys(s.namespace)
    recorded = r.hgetall(keys.results(burst))
    unacked = pending_on(r, s, "w0")
    before = r.hgetall(keys.burst(burst))
    print(f"  after the crash: {len(recorded)} results recorded, {unacked} entries still pending")
    assert len(recorded) >= 1 and unacked >= len(recorded), "it died between record and ack"
    LEDGER.fault("worker process died (exit 137) between recording results and acking them")
    assert int(before[b"done"]) == len(recorded)  # counted once, before the crash

    with fake_worker(s, name="w0"):  # the restart: same consumer name, its backlog first
        wait_burst(r, s, burst, 60)
    out = account(r, s, burst, 12)
    after = r.hgetall(keys.results(burst))
    assert (out.lost, out.duplicated, out.done, out.failed) == (0, 0, 12, 0)
    # the redelivered entries found their results: acked, nothing recorded again
    assert {i: after[i] for i in recorded} == recorded
    assert queue_empty(r, s) == (0, 0)


@pytest.mark.parametrize(
    ("grace", "prompt", "in_flight", "finished_in_grace"),
    [(10.0, "sleep:1", 4, 4), (0.5, "sleep:3", 3, 0)],
    ids=["in-flight-finish-in-grace", "grace-expires"],
)
def test_sigterm_during_burst_exits_0_in_grace_and_nothing_is_lost(
    make_settings: Callable[..., Settings],
    r: redis.Redis,
    tmp_path: Path,
    grace: float,
    prompt: str,
    in_flight: int,
    finished_in_grace: int,
    fake_worker: MakeWorker,
) -> None:
    """Given a worker process with requests in flight, when it gets SIGTERM, it stops reading,
    writes and acks what finishes within the grace period, exits 0 within it, and leaves the rest
    pending or queued; a restarted worker (same name) serves them: nothing is lost or doubled."""
    s = make_settings(max_inflight=in_flight, grace_s=grace)
    log = tmp_path / "sigterm.log"
    proc = fault_worker(s, log, "--name", "st")
    try:
        burst = Producer(s).submit(requests(12, lambda i: f"{prompt} term {i}"))
        wait_until(lambda: pending_on(r, s, "st") >= in_flight, 30, f"{in_flight} in flight")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(grace + 15)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    keys = Keys(s.namespace)
    written, left = r.hlen(keys.results(burst)), pending_on(r, s, "st")
    print(f"  exit {rc} after {took:.1f}s: {written} results written, {left} left pending")
    assert rc == 0, log.read_text()[-3000:]
    assert took < grace + 5
    assert (written, left) == (finished_in_grace, in_flight - finished_in_grace)
    LEDGER.fault(f"SIGTERM to a worker with {in_flight} requests in flight (grace {grace}s)")
    with fake_worker(s.replace(max_inflight=12), name="st"):  # the restart, same name
        wait_burst(r, s, burst, 60)
        out = account(r, s, burst, 12)
    assert (out.lost, out.duplicated, out.failed) == (0, 0, 0)


@pytest.mark.parametrize("hand_over", [False, True], ids=["plain", "hand-over"])
def test_sigterm_while_redis_is_down_exits_0_within_its_bound_and_nothing_is_lost(
    tmp_path: Path, fake_worker: MakeWorker, hand_over: bool
) -> None:
    """Given a worker process (grace_s=3) with requests in flight, when redis-server is killed
    and the worker gets SIGTERM, it exits 0 within `stop_bound_s` (grace_s + FLUSH_S: it took
    18-51 s, retrying its writes for grace_s + 30 s and then each unregister command), leaving
    what it could not write pending; with Redis back, a worker of the same name serves the rest
    and every request has one result. With ``--hand-over`` the same bound holds: the move is
    skipped when Redis did not answer (it raised out of the stop: exit 1 after 14-18 s)."""
    with RedisServer(appendonly=True) as srv:
        s = Settings(
            redis_url=srv.url,
            namespace="down",
            shards=1,
            grace_s=3.0,
            heartbeat_s=0.5,
            claim_idle_s=30.0,
            max_inflight=4,
        )
        rr = redis.Redis.from_url(srv.url)
        log = tmp_path / "down.log"
        proc = fault_worker(s, log, "--name", "dw", *(["--hand-over"] if hand_over else []))
        try:
            burst = Producer(s).submit(requests(40, lambda i: f"sleep:0.5 down {i}"))
            wait_until(lambda: rr.hlen(s.keys.results(burst)) >= 4, 30, "4 results")
            wait_until(lambda: pending_on(rr, s, "dw") >= 1, 30, "requests in flight")
            time.sleep(1.5)  # everysec: the burst is on disk
            srv.kill()
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(120)
            took = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
        bound = stop_bound_s(s)
        print(f"  exit {rc} {took:.1f}s after SIGTERM with Redis down (bound {bound:.0f}s)")
        assert rc == 0, log.read_text()[-3000:]
        assert took <= bound + 1.0, log.read_text()[-3000:]
        assert "Traceback" not in log.read_text()
        if hand_over:
            assert "hand-over of shard 0 skipped: Redis did not answer" in log.read_text()
        LEDGER.fault("SIGTERM to a worker with requests in flight while redis-server is down")
        srv.start()
        with fake_worker(s.replace(max_inflight=16), name="dw"):  # same name: replays its own
            wait_burst(rr, s, burst, 90)
            out = account(rr, s, burst, 40, what="SIGTERM with Redis down")
        rr.close()
    assert (out.lost, out.duplicated, out.failed) == (0, 0, 0)


@pytest.mark.parametrize("redis_state", ["unreachable", "out of memory"])
def test_sigterm_while_the_start_waits_for_redis_exits_0_at_once(
    make_settings: Callable[..., Settings], tmp_path: Path, redis_state: str
) -> None:
    """Given a worker process whose start is waiting for Redis (nothing listens on its port, or
    Redis refuses writes: out of memory), when it gets SIGTERM it exits 0 within a few seconds
    (it kept retrying and ignored SIGTERM: only kill -9 stopped it)."""
    with RedisServer() as srv:
        s = make_settings().replace(redis_url=srv.url)
        r = redis.Redis.from_url(srv.url)
        if redis_state == "unreachable":
            srv.stop()
        else:
            r.config_set("maxmemory", max(1, int(r.info("memory")["used_memory"]) - 1))
        log = tmp_path / "start.log"
        proc = fault_worker(s, log, "--name", "waits")
        try:
            wait_until(lambda: "retrying in" in log.read_text(), 30, "a start-up retry logged")
            assert proc.poll() is None
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(20)
            took = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
        text = log.read_text()
        assert rc == 0 and "SIGTERM during start-up: exiting" in text, text[-3000:]
        assert took < 8, took
        LEDGER.fault(f"SIGTERM to a worker whose start waits for Redis ({redis_state})")


def test_poison_entry_is_dead_lettered_after_max_attempts_and_the_rest_complete(
    make_settings: Callable[..., Settings], r: redis.Redis, tmp_path: Path
) -> None:
    """Given `prefixq workers` (the real supervisor) and a request that kills the engine every
    time it runs, in flight with three others that die with it, the worker exits 3 and is
    restarted, twice; then (max_attempts=2) the poison entry goes to the dead-letter stream with
    its reason and its request gets a failed result, while its neighbours, each run alone on its
    last allowed delivery, and every other request of the burst succeed."""
    s = make_settings(max_attempts=2, max_inflight=4, claim_idle_s=30.0)
    log = tmp_path / "supervisor.log"
    sup = fault_worker(s, log, "--cpu", "1", mode="workers")
    try:
        reqs = requests(12, lambda i: f"sleep:0.3 poison-neighbour {i}")
        reqs[5]["prompt"] = "die:poison"
        burst = Producer(s).submit(reqs)
        wait_burst(r, s, burst, 90)
        restarts = log.read_text().count("; restarting in ")
        out = account(r, s, burst, 12)
        dead = r.xrange(Keys(s.namespace).dead(0))
    finally:
        sup.send_signal(signal.SIGTERM)
        rc = sup.wait(60)
    print(f"  supervisor restarted the worker {restarts} times; dead letters: {len(dead)}")
    for _, f in dead:
        where = f"{f[b'burst'].decode()}:{f[b'index'].decode()}"
        print(f"    dead letter: {where} {f[b'reason'].decode()}")
    assert rc == 0
    assert restarts == 2, log.read_text()[-4000:]
    LEDGER.fault("the engine killed by a poison request (and its neighbours)", restarts)
    assert (out.lost, out.duplicated, out.done, out.failed) == (0, 0, 11, 1)
    assert out.results[5].error == "dead-lettered: delivered 2 times (max_attempts=2)"
    assert [(f[b"index"], f[b"delivered"]) for _, f in dead] == [(b"5", b"2")]
    assert queue_empty(r, s) == (0, 0)


def test_supervisor_does_not_restart_a_worker_that_exits_2(
    settings: Settings, tmp_path: Path
) -> None:
    """Given `prefixq workers` (the real supervisor) whose worker exits 2 (a configuration error,
    here a read_count of 0), the supervisor does not restart it and exits 2 itself."""
    log = tmp_path / "supervisor.log"
    sup = fault_worker(settings, log, "--cpu", "1", "--read-count", "0", mode="workers")
    try:
        rc = sup.wait(60)
    finally:
        if sup.poll() is None:
            sup.kill()
    text = log.read_text()
    print(f"  supervisor exit {rc}")
    assert "read_count must be positive" in text, "the worker exited with its configuration error"
    assert rc == 2, text[-3000:]
    assert text.count("started worker") == 1 and "; restarting" not in text, text[-3000:]
    assert "configuration error (exit 2); not restarting" in text
    LEDGER.fault("a worker exiting 2 (configuration error) under the supervisor")


# ---- the real vLLM CPU engine ----------------------------------------------------------------
@pytest.mark.engine
def test_kill_9_worker_mid_burst_other_worker_reclaims_every_request_once(
    real_pair: RealPair, r: redis.Redis
) -> None:
    """Given two `prefixq worker` processes (real vLLM CPU engine) on one shard, when one is
    killed with SIGKILL together with its engine process while it has requests in flight, the
    other reclaims its entries once they are idle past claim_idle_s, and every request of the
    burst ends with exactly one result."""
    s, a, b = real_pair.settings, real_pair.a, real_pair.b
    a.wait_up()
    b.wait_up()
    reqs = [
        {
            "id": f"k{i}",
            "prompt": f"Tell a short story about the number {i}.",
            "max_tokens": 16 + i % 17,
            "ignore_eos": True,
            "temperature": 0.0,
        }
        for i in range(40)
    ]
    t0 = time.monotonic()
    burst = Producer(s).submit(reqs)
    keys = Keys(s.namespace)

    def a_mid_burst() -> int:
        """A's in-flight count once A has also finished a request of the burst (else 0)."""
        done = r.hvals(keys.results(burst))
        if not any(Result.from_wire(wire.decode(v)).worker == a.name for v in done):
            return 0
        return pending_on(r, s, a.name)

    wait_until(a_mid_burst, 120, f"{a.name} mid-burst", 0.02)
    n = kill_tree(a.proc.pid)
    left = pending_on(r, s, a.name)
    assert a.proc.poll() is not None and n >= 2, "the worker and its engine core are dead"
    assert left >= 1, "it died with requests in flight"
    LEDGER.fault(f"kill -9 of worker {a.name} and its engine ({n} processes), {left} in flight")
    wait_burst(r, s, burst, 300)
    out = account(r, s, burst, 40, what="kill -9 burst")
    took = time.monotonic() - t0
    reclaimed = int(r.hget(keys.heartbeat(0, b.name), "reclaimed") or 0)
    by = Counter(x.worker for x in out.results.values())
    print(f"  {took:.1f}s; results by worker {dict(by)}; {b.name} reclaimed {reclaimed} entries")
    assert (out.lost, out.duplicated, out.done, out.failed) == (0, 0, 40, 0)
    assert reclaimed >= left
    assert b.proc.poll() is None
    wait_settled(r, s)


@pytest.mark.engine
def test_engine_core_killed_worker_exits_3_leaving_in_flight_requests_pending(
    real_pair: RealPair, r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """Given a `prefixq worker` serving a burst, when its vLLM engine core process is killed with
    SIGKILL, the worker fails its in-flight requests back to pending (no failed results), exits 3
    (what `prefixq workers` restarts), and another worker completes the burst exactly once."""
    import psutil

    s, b = real_pair.settings, real_pair.b
    b.wait_up()
    reqs = [
        {"id": f"e{i}", "prompt": f"Count to {i}:", "max_tokens": 48, "ignore_eos": True}
        for i in range(12)
    ]
    burst = Producer(s).submit(reqs)
    in_flight = wait_until(lambda: pending_on(r, s, b.name), 60, "requests in flight", 0.02)
    cores = [
        p
        for p in psutil.Process(b.proc.pid).children(recursive=True)
        if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())
    ]
    assert cores, [p.name() for p in psutil.Process(b.proc.pid).children(recursive=True)]
    for p in cores:
        p.send_signal(signal.SIGKILL)
    rc = b.proc.wait(120)
    keys = Keys(s.namespace)
    failed = int(r.hget(keys.burst(burst), "failed") or 0)
    left = pending_on(r, s, b.name)
    print(f"  worker exit {rc}; {left} entries left pending, {failed} failed results")
    assert rc == 3, b.tail()
    assert failed == 0 and left >= 1
    LEDGER.fault(f"kill -9 of the vLLM engine core of {b.name} with {in_flight} in flight")

    with fake_worker(s, name="after-engine-death"):  # claims b's idle entries after claim_idle_s
        wait_burst(r, s, burst, 60)
        out = account(r, s, burst, 12, what="engine-death burst")
    assert (out.lost, out.duplicated, out.done, out.failed) == (0, 0, 12, 0)
    assert queue_empty(r, s) == (0, 0)
