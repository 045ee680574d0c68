"""Fault injection: nothing lost, nothing doubled (issue 4; DESIGN decision 6; docs/delivery.md).

Every test injects faults into real parts (redis-server processes it kills and restarts, worker
processes it kills, signals or supervises, entries it writes straight into the streams), prints
what it did and what was lost, and adds its real measurements to a ledger; the test session's
summary ends with one line from it (conftest.py): ``faults injected: N, requests lost: L,
duplicated: D``.

Lost and duplicated are measured, never assumed: for each burst, a request is lost when its index
has no result, and duplicated when its burst counted it twice (events stream entries beyond one
per index, or done + failed above the number of results). Workers are real `Worker` loops; the
engine is the real vLLM CPU engine (two `prefixq worker` processes, the kill -9 tests) or the
deterministic tests/fake_engine.py (in a thread, or in a process through tests/fault_worker.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import pickle
import secrets
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import msgpack
import pytest
import redis
import zstandard

from conftest import WorkerProc
from fake_engine import FakeEngine
from ledger import LEDGER, account
from prefixq import wire
from prefixq.consumers.worker import Worker
from prefixq.errors import ConfigError, ValidationError
from prefixq.keys import CARRIED, FIELD, GROUP, Keys
from prefixq.producer import Producer
from prefixq.records import Result
from prefixq.redis_server import RedisServer, free_port
from prefixq.settings import Settings

pytestmark = pytest.mark.slow

TESTS = Path(__file__).parent
PY = sys.executable


def wait_until(pred: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def finished(r: redis.Redis, s: Settings, burst: str) -> bool:
    meta = r.hmget(Keys(s.namespace).burst(burst), "total", "done", "failed")
    total, done, failed = (int(x or 0) for x in meta)
    return total > 0 and done + failed >= total


def wait_burst(r: redis.Redis, s: Settings, burst: str, timeout: float) -> None:
    with contextlib.suppress(AssertionError):  # account() then says what is missing
        wait_until(lambda: finished(r, s, burst), timeout, f"burst {burst}", every=0.1)


def queue_empty(r: redis.Redis, s: Settings, shard: int = 0) -> tuple[int, int]:
    """(entries in the stream, entries pending) of one shard."""
    stream = Keys(s.namespace).stream(shard)
    return r.xlen(stream), r.xpending(stream, GROUP)["pending"] if r.exists(stream) else 0


def requests(n: int, prompt: Callable[[int], str] = lambda i: f"hello {i}") -> list[dict[str, Any]]:
    return [{"id": f"q{i}", "prompt": prompt(i), "max_tokens": 8} for i in range(n)]


# ---- workers ---------------------------------------------------------------------------------
class ThreadWorker:
    """A real `Worker` loop over the FakeEngine, on its own event loop in a thread."""

    def __init__(
        self, settings: Settings, name: str = "fw", *, engine: FakeEngine | None = None
    ) -> None:
        self.settings, self.name = settings, name
        self.engine = engine or FakeEngine(lethal=False)
        self.worker: Worker | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.rc: int | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name=f"worker-{name}", daemon=True)

    def _main(self) -> None:
        async def main() -> int:
            self.loop = asyncio.get_running_loop()
            self.worker = Worker(self.settings, 0, self.engine, name=self.name)
            return await self.worker.run()

        try:
            self.rc = asyncio.run(main())
        except BaseException as e:
            self.error = e

    def start(self, timeout: float = 30) -> ThreadWorker:
        self._thread.start()
        wait_until(
            lambda: self.error is not None or (self.worker is not None and self.worker.engine_up),
            timeout,
            f"worker {self.name} up",
        )
        if self.error is not None:
            raise self.error
        return self

    def stop(self, timeout: float = 60) -> int | None:
        if self._thread.is_alive() and self.loop is not None and self.worker is not None:
            self.loop.call_soon_threadsafe(self.worker.stop)
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"worker {self.name} did not stop in {timeout}s"
        if self.error is not None:
            raise self.error
        return self.rc

    def __enter__(self) -> ThreadWorker:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def settings_flags(s: Settings) -> list[str]:
    return [
        "--redis-url",
        s.redis_url,
        "--namespace",
        s.namespace,
        "--shards",
        str(s.shards),
        "--max-attempts",
        str(s.max_attempts),
        "--claim-idle-s",
        str(s.claim_idle_s),
        "--heartbeat-s",
        str(s.heartbeat_s),
        "--grace-s",
        str(s.grace_s),
        "--max-inflight",
        str(s.max_inflight),
    ]


def fault_worker(
    s: Settings, log: Path, *args: str, mode: str = "worker"
) -> subprocess.Popen[bytes]:
    """tests/fault_worker.py as a process (FakeEngine worker, or the supervisor over them)."""
    cmd = [PY, str(TESTS / "fault_worker.py"), mode, *args, *settings_flags(s)]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=TESTS.parent)


def prefixq(s: Settings | None, *args: str, url: str = "") -> subprocess.CompletedProcess[str]:
    flags = ["--redis-url", url or (s.redis_url if s else "")]
    if s is not None:
        flags += ["--namespace", s.namespace]
    return subprocess.run(
        [PY, "-m", "prefixq", *args, *flags], capture_output=True, text=True, timeout=120
    )


def pending_on(r: redis.Redis, s: Settings, consumer: str, shard: int = 0) -> int:
    stream = Keys(s.namespace).stream(shard)
    try:
        return len(r.xpending_range(stream, GROUP, "-", "+", 10_000, consumername=consumer))
    except redis.ResponseError:  # NOGROUP: that worker has not joined yet
        return 0


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
        claim_idle_s=3.0,
        heartbeat_s=0.5,
        grace_s=30.0,
        max_attempts=3,
    )
    extra = ["--max-inflight", "8", "--heartbeat-ttl-s", "3"]
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


def kill_tree(pid: int) -> int:
    """SIGKILL a process and all its descendants (the engine core) at once; returns how many."""
    import psutil

    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=30)
    return len(procs)


# ---- FakeEngine tests first (the real engines start meanwhile) -------------------------------
def test_crash_after_results_written_before_ack_records_no_duplicate(
    make_settings: Callable[..., Settings], r: redis.Redis, tmp_path: Path
) -> None:
    """Given a worker process that records a batch of results and dies before acking it, when a
    worker with the same name restarts, it is redelivered those entries and only acks them: every
    request has one result and the burst's counters are not raised twice."""
    s = make_settings(max_inflight=4, write_batch=64)
    proc = fault_worker(s, tmp_path / "crash.log", "--name", "w0", "--crash-after-record")
    burst = Producer(s).submit(requests(12, lambda i: f"sleep:0.2 crash {i}"))
    assert proc.wait(60) == 137, (tmp_path / "crash.log").read_text()[-3000:]
    LEDGER.fault("worker process died (exit 137) between recording results and acking them")
    keys = Keys(s.namespace)
    recorded = r.hlen(keys.results(burst))
    unacked = pending_on(r, s, "w0")
    before = r.hgetall(keys.burst(burst))
    print(f"  after the crash: {recorded} results recorded, {unacked} entries still pending")
    assert recorded >= 1 and unacked >= recorded

    with ThreadWorker(s, "w0") as w:  # the restart: same consumer name, its backlog first
        wait_burst(r, s, burst, 60)
        assert w.worker is not None
        dupes = w.worker.writer.duplicates
    out = account(r, s, burst, 12)
    print(f"  the restarted worker found {dupes} results already recorded and only acked them")
    assert (out.lost, out.duplicated, out.done, out.failed) == (0, 0, 12, 0)
    assert dupes == recorded
    assert int(before[b"done"]) == recorded  # counted once, before the crash
    assert queue_empty(r, s) == (0, 0)


def test_redis_kill_9_mid_burst_with_aof_burst_completes(r: redis.Redis) -> None:
    """Given a burst enqueued on a redis-server with AOF (appendfsync everysec) and given time to
    fsync (>1 s; Redis 7.0 has no WAITAOF), when redis-server is killed with SIGKILL mid-burst and
    restarted on the same port, the worker and the waiter reconnect and every request ends with
    exactly one result."""
    with RedisServer(appendonly=True) as srv:
        s = Settings(
            redis_url=srv.url,
            namespace="aof",
            shards=1,
            max_inflight=4,
            heartbeat_s=0.5,
            claim_idle_s=3.0,
        )
        rr = redis.Redis.from_url(srv.url)
        try:
            with ThreadWorker(s, "aofw"):
                burst = Producer(s).submit(requests(120, lambda i: f"sleep:0.05 aof {i}"))
                time.sleep(1.5)  # everysec: the whole enqueued burst is on disk now
                done = wait_until(
                    lambda: int(rr.hget(Keys(s.namespace).burst(burst), "done") or 0) >= 20,
                    30,
                    "20 results",
                )
                assert done
                before = rr.hlen(Keys(s.namespace).results(burst))
                srv.kill()
                LEDGER.fault(f"kill -9 redis-server mid-burst ({before}/120 results recorded)")
                time.sleep(1.0)
                srv.start()
                print("  redis-server restarted on the same port from its AOF")
                wait_burst(rr, s, burst, 90)
                out = account(rr, s, burst, 120)
            assert (out.lost, out.duplicated, out.failed) == (0, 0, 0)
            assert queue_empty(rr, s) == (0, 0)
        finally:
            rr.close()


def test_producer_and_worker_retry_while_redis_restarts() -> None:
    """Given redis-server down (killed), when a producer submits while it is being restarted,
    the producer's retries with backoff carry the burst through; the worker, which saw Redis
    vanish while idle, resumes and serves it."""
    with RedisServer(appendonly=True) as srv:
        s = Settings(redis_url=srv.url, namespace="retry", shards=1, heartbeat_s=0.5)
        rr = redis.Redis.from_url(srv.url)
        try:
            with ThreadWorker(s, "rw"):
                srv.kill()
                LEDGER.fault("kill -9 redis-server; restarted 1.5 s later, during a submit")
                restart = threading.Timer(1.5, srv.start)
                restart.start()
                t0 = time.monotonic()
                burst = Producer(s).submit(requests(10))
                took = time.monotonic() - t0
                restart.join()
                print(f"  submit went through after {took:.1f}s of retries")
                wait_burst(rr, s, burst, 60)
                out = account(rr, s, burst, 10)
            assert took >= 1.0
            assert (out.lost, out.duplicated, out.done) == (0, 0, 10)
        finally:
            rr.close()


def test_lost_consumer_group_is_recreated_and_nothing_is_lost(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Given a worker mid-burst, when its consumer group disappears (XGROUP DESTROY: what a Redis
    restart without persistence does to it), the worker joins again (NOGROUP), is delivered the
    entries not yet done, and the burst completes with one result per request."""
    s = make_settings(max_inflight=2)
    with ThreadWorker(s, "ng"):
        burst = Producer(s).submit(requests(30, lambda i: f"sleep:0.05 group {i}"))
        wait_until(lambda: r.hlen(Keys(s.namespace).results(burst)) >= 6, 30, "6 results")
        r.xgroup_destroy(Keys(s.namespace).stream(0), GROUP)
        LEDGER.fault("XGROUP DESTROY of the shard's consumer group mid-burst")
        wait_burst(r, s, burst, 60)
        out = account(r, s, burst, 30)
    assert (out.lost, out.duplicated, out.failed) == (0, 0, 0)
    assert queue_empty(r, s) == (0, 0)


def test_group_lost_while_the_engine_starts_worker_rejoins(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Given a worker that joined its group and is starting its engine, when the group disappears
    (Redis restarted empty) before it serves, its start-up dead-letter pass finds nothing pending
    instead of failing, and it serves a burst."""
    s = make_settings()
    keys = Keys(s.namespace)

    class SlowStart(FakeEngine):
        async def start(self) -> None:
            await asyncio.to_thread(
                wait_until, lambda: r.exists(keys.stream(0)) == 1, 30, "the group joined"
            )
            r.delete(keys.stream(0))  # the stream and its group, as an empty restart leaves them
            LEDGER.fault("stream and group deleted while the engine starts")
            await super().start()

    with ThreadWorker(s, "gl", engine=SlowStart(lethal=False)):
        burst = Producer(s).submit(requests(5))
        wait_burst(r, s, burst, 60)
        out = account(r, s, burst, 5)
    assert (out.lost, out.duplicated, out.done) == (0, 0, 5)


def test_redis_restart_without_persistence_worker_rejoins() -> None:
    """Given a worker on a redis-server without AOF, when the server is killed and restarted
    empty, the worker recreates its stream and group and serves the next burst."""
    with RedisServer(appendonly=False) as srv:
        s = Settings(redis_url=srv.url, namespace="empty", shards=1, heartbeat_s=0.5)
        rr = redis.Redis.from_url(srv.url)
        try:
            with ThreadWorker(s, "ew"):
                srv.kill()
                LEDGER.fault("kill -9 redis-server without persistence (restarts empty)")
                time.sleep(0.5)
                srv.start()
                burst = Producer(s).submit(requests(5))
                wait_burst(rr, s, burst, 60)
                out = account(rr, s, burst, 5)
            assert (out.lost, out.duplicated, out.done) == (0, 0, 5)
        finally:
            rr.close()


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
        LEDGER.fault(f"SIGTERM to a worker with {in_flight} requests in flight (grace {grace}s)")
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
    with ThreadWorker(s.replace(max_inflight=12), "st"):  # the restart, same name
        wait_burst(r, s, burst, 60)
        out = account(r, s, burst, 12)
    assert (out.lost, out.duplicated, out.failed) == (0, 0, 0)


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
        restarts = log.read_text().count("restarting")
        LEDGER.fault("a poison request killing the engine and its 3 neighbours", 2)
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
    assert (out.lost, out.duplicated, out.done, out.failed) == (0, 0, 11, 1)
    assert out.results[5].error == "dead-lettered: delivered 2 times (max_attempts=2)"
    assert [(f[b"index"], f[b"delivered"]) for _, f in dead] == [(b"5", b"2")]
    assert queue_empty(r, s) == (0, 0)


# ---- bad input -------------------------------------------------------------------------------
def _entry(burst: str, **over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "v": 1,
        "b": burst,
        "i": 0,
        "id": "bad",
        "p": "hello world",
        "e": time.time(),
        "k": 0,
        "w": 1,
        "pc": 0,
    }
    for k, v in over.items():
        if v is _DROP:
            d.pop(k, None)
        else:
            d[k] = v
    return d


_DROP = object()
GIB = 1 << 30


def _zlib_bomb() -> bytes:
    c = zlib.compressobj(9)
    chunk = bytes(1 << 20)
    return b"\x01" + b"".join(c.compress(chunk) for _ in range(GIB >> 20)) + c.flush()


def _zstd_bomb(declared: bool) -> bytes:
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=declared)
    c = cctx.compressobj(size=GIB if declared else -1)
    chunk = bytes(1 << 20)
    return b"\x02" + b"".join(c.compress(chunk) for _ in range(GIB >> 20)) + c.flush()


def _nested(depth: int) -> Any:
    v: Any = 1
    for _ in range(depth):
        v = [v]
    return v


def _packed(obj: Any) -> bytes:
    return b"\x00" + msgpack.packb(obj, use_bin_type=True)


def _d(data: bytes) -> dict[bytes, bytes]:
    return {FIELD: data}


# (id, fields to XADD given the burst id, expected outcome, what the outcome must say)
#   dead: a dead letter with that reason, and no result (the entry names no request)
#   dead+failed: a dead letter and a failed result for its request (burst and index decode)
#   failed: a failed result with that error
#   ok: served (unknown keys in an entry are ignored)
#   ignored: acked, nothing recorded (the index is outside its burst)
BAD_ENTRIES: list[tuple[str, Callable[[str], dict[bytes, bytes]], str, str]] = [
    ("zlib-bomb-1GiB", lambda b: _d(_zlib_bomb()), "dead", "inflates past 33554432 bytes"),
    ("zstd-bomb-1GiB-declared", lambda b: _d(_zstd_bomb(True)), "dead", "declares 1073741824"),
    ("zstd-bomb-1GiB-streamed", lambda b: _d(_zstd_bomb(False)), "dead", "inflates past"),
    ("truncated-zlib", lambda b: _d(wire.encode(_entry(b))[:-6]), "dead", "truncated zlib"),
    (
        "truncated-zstd",
        lambda b: _d(wire.encode(_entry(b), "zstd")[:-5]),
        "dead",
        "truncated zstd",
    ),
    (
        "truncated-msgpack",
        lambda b: _d(wire.encode(_entry(b), "none")[:-3]),
        "dead",
        "truncated msgpack",
    ),
    ("unknown-codec-tag", lambda b: _d(b"\x07" + wire.pack(_entry(b))), "dead", "codec tag 0x07"),
    ("pickle-is-never-unpickled", lambda b: _d(pickle.dumps(_entry(b))), "dead", "codec tag 0x80"),
    ("empty-entry", lambda b: _d(b""), "dead", "empty entry"),
    ("malformed-msgpack", lambda b: _d(b"\x00\xc1"), "dead", "invalid msgpack"),
    (
        "deeply-nested-msgpack",
        lambda b: _d(_packed(_entry(b, s=_nested(200)))),
        "dead",
        "nested past 32 levels",
    ),
    ("not-a-map", lambda b: _d(_packed([1, 2, 3])), "dead", "not a map"),
    (
        "ext-type",
        lambda b: _d(b"\x00" + msgpack.packb(msgpack.ExtType(5, b"x"))),
        "dead",
        "ext type",
    ),
    ("wrong-version", lambda b: _d(_packed(_entry(b, v=99))), "dead", "unsupported entry version"),
    ("missing-d-field", lambda b: {b"x": b"y"}, "dead", "no 'd' field"),
    (
        "oversized-entry",
        lambda b: _d(_packed(_entry(b, p="a" * (5 << 20)))),
        "dead",
        "(max_entry_bytes)",
    ),
    ("index-wrong-type", lambda b: _d(_packed(_entry(b, i="0"))), "dead", "'i' must be int"),
    (
        "counter-infinite",
        lambda b: _d(_packed(_entry(b, w=math.inf))),
        "dead+failed",
        "malformed entry",
    ),
    (
        "sampling-not-a-map",
        lambda b: _d(_packed(_entry(b, s=[1]))),
        "dead+failed",
        "sampling is not a map",
    ),
    (
        "missing-prompt",
        lambda b: _d(_packed(_entry(b, p=_DROP))),
        "dead+failed",
        "exactly one of p, m, t",
    ),
    (
        "prompt-and-messages",
        lambda b: _d(_packed(_entry(b, m=[{"role": "user", "content": "x"}]))),
        "dead+failed",
        "exactly one of p, m, t",
    ),
    (
        "prompt-wrong-type",
        lambda b: _d(_packed(_entry(b, p=123))),
        "failed",
        "'p' must be a string, not int",
    ),
    (
        "token-ids-not-a-list",
        lambda b: _d(_packed(_entry(b, p=_DROP, t=5))),
        "failed",
        "'t' must be a list",
    ),
    (
        "negative-token-id",
        lambda b: _d(_packed(_entry(b, p=_DROP, t=[-1]))),
        "failed",
        "prompt_token_ids must be a non-empty list of token ids",
    ),
    (
        "negative-temperature",
        lambda b: _d(_packed(_entry(b, s={"temperature": -1.0}))),
        "failed",
        "temperature=-1.0 must be between 0 and 100",
    ),
    (
        "max-tokens-0",
        lambda b: _d(_packed(_entry(b, s={"max_tokens": 0}))),
        "failed",
        "max_tokens=0 must be between 1",
    ),
    (
        "top-p-2",
        lambda b: _d(_packed(_entry(b, s={"top_p": 2}))),
        "failed",
        "top_p=2 must be in (0, 1]",
    ),
    (
        "stop-int",
        lambda b: _d(_packed(_entry(b, s={"stop": 5}))),
        "failed",
        "stop has the wrong type (int)",
    ),
    (
        "unknown-sampling-field",
        lambda b: _d(_packed(_entry(b, s={"logit_bias": {}}))),
        "failed",
        "unknown sampling field 'logit_bias'",
    ),
    (
        "bad-message-role",
        lambda b: _d(_packed(_entry(b, p=_DROP, m=[{"role": "wizard", "content": "hi"}]))),
        "failed",
        "unknown role 'wizard'",
    ),
    (
        "huge-prompt",
        lambda b: _d(wire.encode(_entry(b, p="a" * 4_000_001))),
        "failed",
        "4000001 characters, over 4000000",
    ),
    (
        "missing-stored-prefix",
        lambda b: _d(_packed(_entry(b, xr="0" * 32))),
        "failed",
        "not found (expired or never stored)",
    ),
    (
        "unknown-field-naming-a-function",
        lambda b: _d(_packed(_entry(b, call="os:system", args=["rm -rf /"]))),
        "ok",
        "",
    ),
    ("index-outside-its-burst", lambda b: _d(_packed(_entry(b, i=7))), "ignored", ""),
]


@pytest.fixture(scope="module")
def bad_input_worker(redis_server: RedisServer) -> Iterator[ThreadWorker]:
    """One FakeEngine worker that every bad entry of the table is thrown at."""
    s = Settings(redis_url=redis_server.url, namespace=f"bad{secrets.token_hex(3)}", shards=1)
    with ThreadWorker(s, "badw") as w:
        yield w


@pytest.mark.parametrize(
    ("fields", "expect", "says"),
    [pytest.param(f, e, m, id=i) for i, f, e, m in BAD_ENTRIES],
)
def test_bad_entry_gets_its_reason_and_the_worker_keeps_serving(
    bad_input_worker: ThreadWorker,
    r: redis.Redis,
    fields: Callable[[str], dict[bytes, bytes]],
    expect: str,
    says: str,
) -> None:
    """Given an entry written straight into the stream (bypassing the producer's validation),
    the worker gives it its expected outcome (a dead letter with the reason, or a failed result
    with the error) and serves the next request."""
    w = bad_input_worker
    s, keys = w.settings, Keys(w.settings.namespace)
    burst = f"bad-{secrets.token_hex(4)}"
    r.hset(keys.burst(burst), mapping={"total": 1, "done": 0, "failed": 0, "status": "queued"})
    entry_id = r.xadd(keys.stream(0), fields(burst))
    LEDGER.fault(f"bad entry {entry_id.decode()} written straight into the stream")

    def dead_letter() -> dict[bytes, bytes] | None:
        for _, f in r.xrange(keys.dead(0)):
            if f[b"entry"] == entry_id:
                return f
        return None

    def settled() -> bool:
        gone = not r.xrange(keys.stream(0), entry_id, entry_id)
        return gone and (
            expect == "ignored" or bool(r.hlen(keys.results(burst))) or bool(dead_letter())
        )

    wait_until(settled, 30, "the bad entry's outcome")
    if expect in ("dead+failed", "failed", "ok"):
        wait_until(lambda: r.hlen(keys.results(burst)), 10, "its result")
    letter = dead_letter()
    got = r.hget(keys.results(burst), 0)
    res = Result.from_wire(wire.decode(got)) if got else None
    print(
        f"  outcome: dead letter {letter[b'reason'].decode() if letter else None!r}; "
        f"result error {res.error if res else None!r}"
    )
    lost = 0
    if expect == "dead":
        assert letter is not None and says in letter[b"reason"].decode()
        assert b"burst" not in letter and res is None
    elif expect == "dead+failed":
        assert letter is not None and says in letter[b"reason"].decode()
        assert res is not None and res.error is not None and says in res.error
        assert (letter[b"burst"].decode(), letter[b"index"]) == (burst, b"0")
    elif expect == "failed":
        assert letter is None
        assert res is not None and res.error is not None and says in res.error, res
    elif expect == "ok":
        assert letter is None and res is not None and res.error is None
    else:
        assert letter is None and res is None
        assert r.hgetall(keys.burst(burst))[b"done"] == b"0"
    if expect != "dead" and expect != "ignored":
        lost = account(r, s, burst, 1, what="its burst").lost
    assert lost == 0

    probe = Producer(s).submit([{"id": "probe", "prompt": "still serving", "max_tokens": 4}])
    wait_burst(r, s, probe, 20)
    assert account(r, s, probe, 1, what="next request").done == 1
    assert w.worker is not None and w.worker.engine_up and w.error is None
    assert queue_empty(r, s)[1] == 0


BAD_REQUESTS: list[tuple[str, dict[str, Any] | list[dict[str, Any]], str]] = [
    ("negative-temperature", {"prompt": "x", "temperature": -1}, "temperature=-1 must be"),
    ("nan-temperature", {"prompt": "x", "temperature": float("nan")}, "must be finite"),
    ("max-tokens-0", {"prompt": "x", "max_tokens": 0}, "max_tokens=0 must be between 1"),
    ("max-tokens-string", {"prompt": "x", "max_tokens": "9"}, "max_tokens has the wrong type"),
    ("top-p-2", {"prompt": "x", "top_p": 2}, r"top_p=2 must be in \(0, 1\]"),
    ("top-k-float", {"prompt": "x", "top_k": 1.5}, "top_k has the wrong type"),
    ("ignore-eos-int", {"prompt": "x", "ignore_eos": 1}, "ignore_eos has the wrong type"),
    ("stop-int", {"prompt": "x", "stop": 5}, r"stop has the wrong type \(int\)"),
    ("stop-17-strings", {"prompt": "x", "stop": ["a"] * 17}, "at most 16 strings"),
    ("missing-prompt", {"max_tokens": 4}, "exactly one of prompt, messages"),
    (
        "prompt-and-messages",
        {"prompt": "x", "messages": [{"role": "user", "content": "y"}]},
        "exactly one of prompt, messages",
    ),
    ("prompt-not-a-string", {"prompt": 7}, "prompt must be a string"),
    ("empty-prompt", {"prompt": ""}, "prompt is empty"),
    (
        "bad-message-role",
        {"messages": [{"role": "wizard", "content": "hi"}]},
        "unknown role 'wizard'",
    ),
    ("messages-not-a-list", {"messages": "hi"}, "messages must be a non-empty list"),
    (
        "too-many-messages",
        {"messages": [{"role": "user", "content": "x"}] * 5},
        "5 messages, over 4",
    ),
    ("token-ids-not-a-list", {"prompt_token_ids": "1 2 3"}, "non-empty list of token ids"),
    ("token-id-negative", {"prompt_token_ids": [1, -2]}, "non-empty list of token ids"),
    ("unknown-field", {"prompt": "x", "colour": "red"}, "unknown fields: colour"),
    ("huge-prompt", {"prompt": "a" * 2001}, "2001 characters, over 2000"),
    ("id-too-long", {"id": "i" * 513, "prompt": "x"}, "id longer than 512"),
    ("entry-too-large", {"prompt": secrets.token_hex(900)}, "over max_entry_bytes=1024"),
    (
        "duplicate-ids",
        [{"id": "same", "prompt": "x"}, {"id": "same", "prompt": "y"}],
        "duplicate request ids",
    ),
    ("empty-burst", [], "the burst is empty"),
]


@pytest.mark.parametrize(("req", "says"), [pytest.param(q, m, id=i) for i, q, m in BAD_REQUESTS])
def test_producer_refuses_bad_request_before_enqueueing(
    make_settings: Callable[..., Settings],
    r: redis.Redis,
    req: dict[str, Any] | list[dict[str, Any]],
    says: str,
) -> None:
    """Given a request with a bad field, the producer refuses the whole burst with a
    ValidationError saying which request and what is wrong, and enqueues nothing."""
    s = make_settings(max_prompt_chars=2000, max_messages=4, max_entry_bytes=1024)
    reqs = req if isinstance(req, list) else [{"id": "q", **req}]
    with pytest.raises(ValidationError, match=says) as err:
        Producer(s).submit(reqs)
    LEDGER.fault("a bad request submitted through the producer")
    print(f"  refused: {err.value}")
    assert r.xlen(Keys(s.namespace).stream(0)) == 0


# ---- TLS and ACL -----------------------------------------------------------------------------
def make_certs(d: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it (openssl req -x509)."""
    ca_key, ca, key, csr, crt = (d / n for n in ("ca.key", "ca.crt", "s.key", "s.csr", "s.crt"))
    ext = d / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run = [
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca,
         "-days", "2", "-subj", "/CN=prefixq test CA"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
         "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-out", crt, "-days", "2", "-extfile", ext],
    ]  # fmt: skip
    for args in run:
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)
    return ca, crt, key


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, Path]]:
    """redis-server with TLS only (--port 0) and ACL users: alice may use keys tls:*, mallory
    only other:*, the default user is off."""
    ca, crt, key = make_certs(tmp_path_factory.mktemp("tls"))
    port = free_port()
    users = [
        ["--user", "default", "off"],
        ["--user", "alice", "on", ">s3cret-pw", "~tls:*", "+@all"],
        ["--user", "mallory", "on", ">mallory-pw", "~other:*", "+@all"],
    ]
    srv = RedisServer(
        port=port,
        extra_args=[
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--tls-cert-file",
            str(crt),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(ca),
            "--tls-auth-clients",
            "no",
            *(a for u in users for a in u),
        ],
    )
    srv.scheme = "rediss"
    with srv:
        yield srv, ca


def tls_url(srv: RedisServer, ca: Path, user: str, password: str) -> str:
    return (
        f"rediss://{user}:{password}@127.0.0.1:{srv.port}/0"
        f"?ssl_ca_certs={ca}&ssl_cert_reqs=required"
    )


def test_tls_and_acl_user_end_to_end(tls_server: tuple[RedisServer, Path]) -> None:
    """Given redis-server speaking only TLS and an ACL user limited to the namespace's keys, a
    producer and a worker configured by a rediss:// URL (user, password, CA in the query) run a
    burst end to end, and the CLI reads it over the same URL."""
    srv, ca = tls_server
    s = Settings(redis_url=tls_url(srv, ca, "alice", "s3cret-pw"), namespace="tls", shards=1)
    rr = redis.Redis.from_url(s.redis_url)
    try:
        with ThreadWorker(s, "tlsw"):
            burst = Producer(s).submit(requests(8))
            wait_burst(rr, s, burst, 30)
            out = account(rr, s, burst, 8, what="TLS burst")
        assert (out.lost, out.duplicated, out.done) == (0, 0, 8)
        p = prefixq(s, "inspect", "--json", "--burst", burst)
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["bursts"][0]["done"] == 8
        assert "s3cret-pw" not in p.stdout + p.stderr
    finally:
        rr.close()


@pytest.mark.parametrize(
    ("user", "password", "ca", "says"),
    [
        ("alice", "wrong-pw", True, "refused the credentials"),
        ("mallory", "mallory-pw", True, "refused the credentials or command"),
        ("alice", "s3cret-pw", False, "does not verify"),
    ],
    ids=["wrong-password", "no-access-to-the-namespace", "untrusted-certificate"],
)
def test_denied_user_gets_a_clear_error_at_once(
    tls_server: tuple[RedisServer, Path],
    tmp_path: Path,
    user: str,
    password: str,
    ca: bool,
    says: str,
) -> None:
    """Given credentials Redis refuses (or a server certificate the client cannot verify), the
    producer raises ConfigError at once (no retry can fix it), the CLI exits 2 with the hint and
    without the password, and a worker exits 2 instead of retrying for ever."""
    srv, ca_path = tls_server
    url = tls_url(srv, ca_path, user, password)
    if not ca:
        url = f"rediss://{user}:{password}@127.0.0.1:{srv.port}/0"
    s = Settings(redis_url=url, namespace="tls", shards=1)
    LEDGER.fault(f"denied connection: {says}", 3)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=says) as err:
        Producer(s).submit(requests(1))
    took = time.monotonic() - t0
    print(f"  producer: ConfigError after {took:.2f}s: {err.value}")
    assert took < 3.0
    assert password not in str(err.value)

    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "prompt": "hi"}\n')
    p = prefixq(s, "submit", str(src))
    print(f"  prefixq submit: exit {p.returncode}: {p.stderr.strip()[-300:]}")
    assert p.returncode == 2 and says in p.stderr and password not in p.stderr

    proc = fault_worker(s, tmp_path / "denied.log", "--name", "denied")
    rc = proc.wait(30)
    print(f"  worker: exit {rc}")
    assert rc == 2 and says in (tmp_path / "denied.log").read_text()


# ---- prefixq reclaim / prefixq dead ----------------------------------------------------------
def test_prefixq_reclaim_and_dead_requeue(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """Given entries pending on consumers that died (no heartbeat), `prefixq reclaim` moves the
    ones under max_attempts back to the stream (carrying their delivery count) and dead-letters
    the one past it (failing its request once); an entry on a live consumer is left alone; a
    worker then serves the moved ones, and dead-letters a moved entry whose carried count reaches
    the limit. `prefixq dead` lists the dead letters; `prefixq dead --requeue` takes their failed
    results back and re-submits them, and the burst ends with one successful result each."""
    s = make_settings(max_attempts=3, claim_idle_s=1.0, heartbeat_s=0.5)
    keys = Keys(s.namespace)
    stream = keys.stream(0)
    burst = Producer(s).submit(requests(8))
    r.xgroup_create(stream, GROUP, id="0")
    got = r.xreadgroup(GROUP, "ghost", {stream: ">"}, count=8)
    ids = [entry_id for entry_id, _ in got[0][1]]
    r.xclaim(stream, GROUP, "ghost", 0, [ids[5]])  # delivered 3 times: past max_attempts
    r.xclaim(stream, GROUP, "ghost", 0, [ids[5]])
    r.xclaim(stream, GROUP, "ghost", 0, [ids[6]])  # delivered 2 times
    r.xclaim(stream, GROUP, "busy", 0, [ids[7]], justid=True)  # on a live consumer
    r.set(keys.heartbeat(0, "busy"), "1", ex=60)
    LEDGER.fault("8 entries left pending on consumers that died", 8)

    p = prefixq(s, "reclaim", "--idle-s", "0", "--json")
    assert p.returncode == 0, p.stderr
    (rep,) = json.loads(p.stdout)
    print(f"  prefixq reclaim: {rep}")
    assert (rep["moved"], rep["dead"], rep["live"]) == (6, 1, 1)
    carried = {int(f.get(CARRIED, b"0")) for _, f in r.xrange(stream) if CARRIED in f}
    assert carried == {1, 2}
    # the moved entries are read by a consumer that dies too: for the one that had 2 deliveries,
    # that read was its 3rd, so the live worker's reclaimer dead-letters it instead of a 4th
    assert len(r.xreadgroup(GROUP, "ghost2", {stream: ">"}, count=100)[0][1]) == 6
    r.delete(keys.heartbeat(0, "busy"))  # the busy consumer dies as well

    with ThreadWorker(s, "rw") as w:
        wait_burst(r, s, burst, 30)
        out = account(r, s, burst, 8, what="after reclaim")
        assert w.worker is not None
    assert (out.lost, out.duplicated, out.done, out.failed) == (0, 0, 6, 2)
    assert out.results[5].error == "dead-lettered: delivered 3 times (max_attempts=3)"
    assert out.results[6].error == "dead-lettered: delivered 3 times (max_attempts=3)"

    p = prefixq(s, "dead", "--json")
    assert p.returncode == 0, p.stderr
    letters = json.loads(p.stdout)
    print("  prefixq dead:", [(d["index"], d["delivered"], d["reason"]) for d in letters])
    assert sorted((d["burst"], d["index"], d["delivered"]) for d in letters) == [
        (burst, 5, 3),
        (burst, 6, 3),
    ]
    assert {d["worker"] for d in letters} == {"prefixq-reclaim", "rw"}

    p = prefixq(s, "dead", "--requeue", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) | {"skipped": []} == {
        "requeued": 2,
        "cleared": 2,
        "resolved": 0,
        "skipped": [],
    }
    assert r.hget(keys.burst(burst), "failed") == b"0"
    with ThreadWorker(s, "rw"):
        wait_burst(r, s, burst, 30)
        out = account(r, s, burst, 8, taken_back=2, what="after requeue")
    assert (out.lost, out.duplicated, out.done, out.failed) == (0, 0, 8, 0)
    assert r.xlen(keys.dead(0)) == 0 and queue_empty(r, s) == (0, 0)
    p = prefixq(s, "dead")
    assert p.returncode == 0 and p.stdout == ""


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

    in_flight = wait_until(a_mid_burst, 120, f"{a.name} mid-burst", 0.02)
    n = kill_tree(a.proc.pid)
    left = pending_on(r, s, a.name)
    LEDGER.fault(f"kill -9 of worker {a.name} and its engine ({n} processes), {left} in flight")
    wait_burst(r, s, burst, 300)
    out = account(r, s, burst, 40, what="kill -9 burst")
    took = time.monotonic() - t0
    reclaimed = int(r.hget(keys.heartbeat(0, b.name), "reclaimed") or 0)
    by = Counter(x.worker for x in out.results.values())
    print(f"  {took:.1f}s; results by worker {dict(by)}; {b.name} reclaimed {reclaimed} entries")
    assert (out.lost, out.duplicated, out.done, out.failed) == (0, 0, 40, 0)
    assert in_flight and reclaimed >= left >= 1 and by[a.name] >= 1
    assert b.proc.poll() is None
    assert queue_empty(r, s) == (0, 0)


@pytest.mark.engine
def test_real_engine_refuses_bad_prompts_and_keeps_serving(
    real_pair: RealPair, r: redis.Redis
) -> None:
    """Given prompts that only the engine can judge (a token id outside the vocabulary, a prompt
    longer than max_model_len), each fails its own request with the engine's reason and the
    worker serves the rest."""
    s, b = real_pair.settings, real_pair.b
    b.wait_up()
    reqs = [
        {"id": "oov", "prompt_token_ids": [1, 2, 1_000_000], "max_tokens": 4},
        {"id": "long", "prompt": "word " * 9000, "max_tokens": 4},
        {"id": "fine", "prompt": "The capital of France is", "max_tokens": 4},
    ]
    burst = Producer(s).submit(reqs)
    LEDGER.fault("requests the real engine must refuse", 2)
    wait_burst(r, s, burst, 120)
    out = account(r, s, burst, 3, what="engine-judged burst")
    for x in out.results.values():
        print(f"    {x.id}: {x.error or x.text!r}")
    assert (out.lost, out.duplicated, out.done, out.failed) == (0, 0, 1, 2)
    assert "out of vocabulary" in (out.results[0].error or "")
    assert "maximum context length" in (out.results[1].error or "")
    assert b.proc.poll() is None


@pytest.mark.engine
def test_engine_core_killed_worker_exits_3_leaving_in_flight_requests_pending(
    real_pair: RealPair, r: redis.Redis
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
    LEDGER.fault(f"kill -9 of the vLLM engine core of {b.name} with {in_flight} in flight")
    rc = b.proc.wait(120)
    keys = Keys(s.namespace)
    failed = int(r.hget(keys.burst(burst), "failed") or 0)
    left = pending_on(r, s, b.name)
    print(f"  worker exit {rc}; {left} entries left pending, {failed} failed results")
    assert rc == 3, b.tail()
    assert failed == 0 and left >= 1

    with ThreadWorker(s, "after-engine-death"):  # claims b's idle entries after claim_idle_s
        wait_burst(r, s, burst, 60)
        out = account(r, s, burst, 12, what="engine-death burst")
    assert (out.lost, out.duplicated, out.done, out.failed) == (0, 0, 12, 0)
    assert queue_empty(r, s) == (0, 0)
