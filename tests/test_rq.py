"""Bursts as RQ jobs and completion callbacks, on a real Redis and a real `rq worker` process.

The prefixq side is the real `Worker` loop with the deterministic tests/fake_engine.py, run in a
background thread's event loop (the `fake_worker` fixture; it also carries the completion hook
under test); the tests
marked ``engine`` run the same path once on the session's real vLLM CPU workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aredis
from rq import Queue, Retry
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from helpers import FakeWorker, queue_empty, wait_until
from prefixq.client import Producer, results
from prefixq.core.errors import BurstTimeout, ValidationError
from prefixq.core.keys import GROUP, Keys
from prefixq.core.settings import Settings
from prefixq.integrations import rq_jobs
from prefixq.integrations.rq_callbacks import aenqueue_on_complete, callback_job_id, callback_path
from prefixq.integrations.rq_jobs import _too_many_failed
from prefixq.ops.recovery import Recovery
from prefixq.store.burst_end import cancel
from rq_targets import calls_key

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"
RUN_BURST = "prefixq.rq_jobs.run_burst"
MARK_DONE = "rq_targets:mark_done"

THREE = [
    {"id": "q0", "prompt": "a b", "max_tokens": 8},
    {"id": "q1", "prompt": "fail:nope", "max_tokens": 8},
    {"id": "q2", "prompt": "c d e", "max_tokens": 8},
]


# ---- helpers --------------------------------------------------------------------------------
def rq_worker(url: str, *queues: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run a stock `rq worker --burst` (JSON serializer) until its queues are empty."""
    path = [str(TESTS), str(SRC), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    cmd = [sys.executable, "-m", "rq.cli", "worker", "--burst", "--url", url]
    cmd += ["--serializer", "rq.serializers.JSONSerializer", *queues]
    logs = Path(tempfile.mkdtemp(prefix="rq-worker-"))
    with open(logs / "out", "w") as out, open(logs / "err", "w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)
    deadline = time.monotonic() + timeout

    def said() -> str:
        return (logs / "out").read_text() + (logs / "err").read_text()

    # rq 3.0 on a loaded machine can linger a minute after its last job ("done, quitting", then
    # its pubsub thread): its work is over at that line
    while proc.poll() is None and time.monotonic() < deadline and "done, quitting" not in said():
        time.sleep(0.1)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
    lingered = proc.poll() is None
    if lingered:
        proc.kill()
        proc.wait()
    assert time.monotonic() < deadline, f"rq worker not done in {timeout}s: {said()[-3000:]}"
    rc = 0 if lingered and "done, quitting" in said() else proc.returncode
    done = subprocess.CompletedProcess(
        cmd, rc, (logs / "out").read_text(), (logs / "err").read_text()
    )
    shutil.rmtree(logs, ignore_errors=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def queue(r: redis.Redis, settings: Settings) -> Queue:
    """An RQ queue of this test alone (named after its namespace)."""
    return Queue(f"rq-{settings.namespace}", connection=r, serializer=JSONSerializer)


def enqueue_run_burst(q: Queue, settings: Settings, requests: Any, **options: Any) -> Job:
    """Enqueue `run_burst` the way an upstream pipeline would (by its dotted path)."""
    options = {"redis_url": settings.redis_url, "namespace": settings.namespace} | options
    return q.enqueue(RUN_BURST, requests, job_timeout=120, **options)


def failure(job: Job) -> str:
    """The traceback text of a failed job."""
    res = job.latest_result()
    assert res is not None and res.exc_string, f"job {job.id} has no failure recorded"
    return str(res.exc_string)


def finished_burst(r: redis.Redis, settings: Settings, **meta: Any) -> str:
    """A burst record that says it is finished (enough for the callback code)."""
    burst = f"b-{time.monotonic_ns()}"
    fields = {"total": 1, "done": 1, "failed": 0, "status": "finished"} | meta
    r.hset(Keys(settings.namespace).burst(burst), mapping=fields)
    return burst


MakeWorker = Callable[..., FakeWorker]


@pytest.fixture
def s(make_settings: Callable[..., Settings]) -> Settings:
    return make_settings(gc_freeze=False, heartbeat_s=0.5)


# ---- run_burst through a stock rq worker --------------------------------------------------
def test_run_burst_job_returns_the_summary_with_counts(
    s: Settings, r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """A stock rq worker runs run_burst; the job's return value is the burst's JSON summary."""
    q = queue(r, s)
    job = enqueue_run_burst(q, s, THREE, timeout=60)
    with fake_worker(s):
        rq_worker(s.redis_url, q.name)
    assert job.get_status(refresh=True) == JobStatus.FINISHED
    summary = job.return_value(refresh=True)
    assert summary is not None
    assert (summary["total"], summary["done"], summary["failed"]) == (3, 2, 1)
    assert summary["status"] == "finished"
    assert summary["namespace"] == s.namespace
    assert summary["results_key"] == Keys(s.namespace).results(summary["burst"])
    assert summary["requests_per_s"] > 0 and summary["elapsed_s"] > 0
    assert summary["finished_at"] >= summary["created"]
    assert summary["per_shard"] == [3] and summary["out"] is None
    got = results.collect(summary["burst"], s, client=r)
    assert [g.text for g in got] == ["b a", "", "e d c"]


def test_run_burst_reads_a_jsonl_path_and_writes_out(
    s: Settings, r: redis.Redis, fake_worker: MakeWorker, tmp_path: Path
) -> None:
    """Given a JSONL path and out=, the results are written there in input order."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in THREE), encoding="utf-8")
    q = queue(r, s)
    job = enqueue_run_burst(q, s, str(src), out=str(out))
    with fake_worker(s):
        rq_worker(s.redis_url, q.name)
    summary = job.return_value(refresh=True)
    assert summary is not None, job.latest_result()
    assert summary["out"] == str(out) and summary["written"] == 3
    lines = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    assert [x["id"] for x in lines] == ["q0", "q1", "q2"]
    assert lines[1]["error"] == "fake engine refused: nope"


def test_burst_over_max_failed_fails_the_rq_job_with_a_clear_message(
    s: Settings, r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """max_failed=0 and one failed request: the RQ job fails with BurstFailed naming it."""
    q = queue(r, s)
    job = enqueue_run_burst(q, s, THREE, max_failed=0)
    with fake_worker(s):
        rq_worker(s.redis_url, q.name)
    assert job.get_status(refresh=True) == JobStatus.FAILED
    text = failure(job)
    assert "BurstFailed" in text
    assert "1 of 3 requests failed, over max_failed=0" in text
    assert "first failure: request 'q1': fake engine refused: nope" in text


def test_burst_past_its_timeout_fails_the_rq_job(s: Settings, r: redis.Redis) -> None:
    """No prefixq worker serves the shard: after timeout s the job fails with BurstTimeout."""
    q = queue(r, s)
    job = enqueue_run_burst(q, s, THREE, timeout=1, shards=1)
    rq_worker(s.redis_url, q.name)
    assert job.get_status(refresh=True) == JobStatus.FAILED
    text = failure(job)
    assert "BurstTimeout" in text and "0/3 results after 1s (timeout=1s)" in text
    assert "the burst keeps running" in text


def test_wait_ends_before_the_rq_job_timeout(s: Settings, r: redis.Redis) -> None:
    """A job_timeout shorter than the burst timeout still fails with BurstTimeout, not RQ's
    own timeout exception."""
    q = queue(r, s)
    options = {"redis_url": s.redis_url, "namespace": s.namespace, "shards": 1}
    job = q.enqueue(RUN_BURST, THREE, job_timeout=3, **options)
    rq_worker(s.redis_url, q.name)
    # the job's own time, as RQ recorded it: the `rq worker` process can outlive its last job by
    # a minute on a loaded machine (rq 3.0 after "done, quitting"), which is not the job's wait
    job.refresh()
    assert job.started_at is not None and job.ended_at is not None
    assert (job.ended_at - job.started_at).total_seconds() < 3
    text = failure(job)
    assert "BurstTimeout" in text and "JobTimeoutException" not in text


def test_a_retried_run_burst_job_waits_on_its_burst_instead_of_submitting_it_again(
    s: Settings, r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """RQ's Retry (and a requeue of the failed job) runs run_burst again: every attempt waits on
    the burst the first one submitted; the requests are enqueued once."""
    q = queue(r, s)
    job = enqueue_run_burst(q, s, THREE, timeout=1, shards=1, retry=Retry(max=1))
    rq_worker(s.redis_url, q.name)  # no prefixq worker: both attempts time out
    assert job.get_status(refresh=True) == JobStatus.FAILED
    bursts = r.zrange(Keys(s.namespace).bursts, 0, -1)
    assert len(bursts) == 1
    assert failure(job).count(bursts[0].decode()) >= 1
    with fake_worker(s):
        q.failed_job_registry.requeue(job.id)
        rq_worker(s.redis_url, q.name)
    summary = job.return_value(refresh=True)
    assert summary is not None, failure(job)
    assert summary["burst"] == bursts[0].decode() and summary["total"] == 3
    assert r.zrange(Keys(s.namespace).bursts, 0, -1) == bursts


def test_a_run_burst_job_whose_rq_worker_was_killed_reattaches_when_retried(
    s: Settings, r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """kill -9 of the rq worker while run_burst waits: RQ retries the abandoned job, which waits
    on the burst already submitted and returns its summary."""
    q = queue(r, s)
    job = enqueue_run_burst(q, s, THREE, timeout=60, shards=1, retry=Retry(max=1))
    path = [str(TESTS), str(SRC), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    cmd = [sys.executable, "-m", "rq.cli", "worker", "--url", s.redis_url]
    cmd += ["--serializer", "rq.serializers.JSONSerializer", q.name]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        keys = Keys(s.namespace)
        burst = wait_until(lambda: r.zrange(keys.bursts, 0, -1), 60, "the burst submitted")
        wait_until(lambda: r.hexists(keys.burst(burst[0].decode()), "per_shard"), 60, "in full")
        time.sleep(0.3)  # the job waits on it
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker and its work horse
        proc.wait()
    assert job.get_status(refresh=True) == JobStatus.STARTED
    StartedJobRegistry(queue=q).cleanup(time.time() + 10**6)  # what RQ does once it sees it dead
    if job.get_status(refresh=True) == JobStatus.FAILED:  # an RQ that does not retry abandoned
        q.failed_job_registry.requeue(job.id)  # jobs: requeued by hand
    assert job.get_status(refresh=True) == JobStatus.QUEUED
    with fake_worker(s):
        rq_worker(s.redis_url, q.name)
    summary = job.return_value(refresh=True)
    assert summary is not None, failure(job)
    assert r.zrange(Keys(s.namespace).bursts, 0, -1) == [summary["burst"].encode()]
    assert (summary["done"], summary["failed"]) == (2, 1)


def test_a_burst_an_earlier_attempt_left_half_submitted_is_cancelled_and_submitted_anew(
    s: Settings, r: redis.Redis
) -> None:
    """An attempt killed while submitting left a burst record without its per-shard counts: the
    retry cancels that burst as a whole and submits the requests as a new one."""
    q = queue(r, s)
    keys = Keys(s.namespace)
    job = enqueue_run_burst(q, s, THREE, timeout=1, shards=1)
    half = "half-submitted"
    Producer(s).submit(THREE, burst_id=half, metadata={"rq_job": job.id})
    r.hdel(keys.burst(half), "per_shard")  # as if killed before the last step
    job.meta.update({"prefixq_run_burst": half, "prefixq_run_namespace": s.namespace})
    job.save_meta()
    rq_worker(s.redis_url, q.name)  # no prefixq worker: the new burst times out
    assert r.hmget(keys.burst(half), "status", "cancelled") == [b"cancelled", b"3"]
    new = {b.decode() for b in r.zrange(keys.bursts, 0, -1)} - {half}
    assert len(new) == 1
    assert job.get_meta(refresh=True)["prefixq_run_burst"] == new.pop()


def test_a_new_job_under_a_used_job_id_submits_its_own_requests(
    s: Settings, r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """RQ keeps an old job's meta when a new job is enqueued under the same ``job_id``: the new
    job took the old one's burst for an earlier attempt of its own and returned its results,
    and its own requests never ran. A retry or requeue of the same job still reattaches
    (test_a_run_burst_job_whose_rq_worker_was_killed_reattaches_when_retried)."""
    q = queue(r, s)
    other = [{"id": "n0", "prompt": "x y", "max_tokens": 8}, {"id": "n1", "prompt": "z"}]
    with fake_worker(s):
        first = enqueue_run_burst(q, s, THREE, timeout=60, job_id="fixed-job")
        rq_worker(s.redis_url, q.name)
        one = first.return_value(refresh=True)
        second = enqueue_run_burst(q, s, other, timeout=60, job_id="fixed-job")
        rq_worker(s.redis_url, q.name)
        two = second.return_value(refresh=True)
    assert one is not None and two is not None, failure(second)
    assert one["burst"] != two["burst"] and (two["total"], two["done"]) == (2, 2)
    assert r.zcard(Keys(s.namespace).bursts) == 2


def test_run_burst_does_not_reattach_to_a_burst_of_another_job(s: Settings, r: redis.Redis) -> None:
    """A burst_id that is already taken fails the job (and its retry) as taken: it is not a
    burst this job submitted, so no attempt waits on it."""
    other = Producer(s).submit(THREE[:1], burst_id="taken")
    q = queue(r, s)
    job = enqueue_run_burst(q, s, THREE, burst_id=other, timeout=5, retry=Retry(max=1))
    rq_worker(s.redis_url, q.name)
    assert job.get_status(refresh=True) == JobStatus.FAILED
    assert "burst 'taken' already exists" in failure(job)


def test_a_burst_cancelled_while_run_burst_waits_fails_the_job(
    s: Settings, r: redis.Redis, tmp_path: Path
) -> None:
    """`prefixq cancel` of the burst a run_burst job waits on ends the wait, and the job fails
    saying the burst was cancelled (with no max_failed too): it did not finish. Its out file is
    written all the same."""
    q = queue(r, s)
    out = tmp_path / "out.jsonl"
    job = enqueue_run_burst(q, s, THREE, timeout=60, shards=1, out=str(out))
    keys = Keys(s.namespace)

    def cancel_it() -> None:
        burst = wait_until(lambda: r.zrange(keys.bursts, 0, -1), 60, "the burst submitted")
        wait_until(lambda: r.hexists(keys.burst(burst[0].decode()), "per_shard"), 60, "submitted")
        cancel(burst[0].decode(), s)

    canceller = threading.Thread(target=cancel_it)
    canceller.start()
    t0 = time.monotonic()
    rq_worker(s.redis_url, q.name)
    canceller.join()
    assert time.monotonic() - t0 < 50  # the cancel ended the wait, not the timeout
    assert job.get_status(refresh=True) == JobStatus.FAILED
    text = failure(job)
    assert "BurstFailed" in text
    assert "was cancelled before it finished: 0 done, 3 failed (3 cancelled) of 3" in text
    assert len(out.read_text(encoding="utf-8").splitlines()) == 3


@pytest.mark.parametrize(
    ("requests", "options", "error"),
    [
        (THREE, {"timeout": "30"}, "ConfigError: timeout must be a positive number"),
        (THREE, {"timeout": None}, "ConfigError: timeout must be a positive number"),
        (THREE, {"timeout": True}, "ConfigError: timeout must be a positive number"),
        (THREE, {"out": 5}, "ConfigError: out must be a file path"),
        (THREE, {"out": "/no/such/folder/out.jsonl"}, "ConfigError: out '/no/such/folder/"),
        (THREE, {"out": "/tmp"}, "ConfigError: out '/tmp' is a folder"),
        (THREE, {"token_ids": "yes"}, "ConfigError: token_ids must be true or false"),
        (THREE, {"token_ids": True}, "ConfigError: token_ids goes with out"),
        (5, {}, "ValidationError: run_burst takes a list of request objects or a JSONL path"),
    ],
)
def test_run_burst_refuses_bad_options_before_it_submits_anything(
    s: Settings, r: redis.Redis, requests: Any, options: dict[str, Any], error: str
) -> None:
    """An option of the wrong type or an out path that cannot be written fails the job with our
    error before the burst is submitted, not with a TypeError or after the burst ran."""
    q = queue(r, s)
    job = enqueue_run_burst(q, s, requests, **options)
    rq_worker(s.redis_url, q.name)
    assert job.get_status(refresh=True) == JobStatus.FAILED
    assert error in failure(job)
    assert r.zcard(Keys(s.namespace).bursts) == 0


def test_run_burst_draws_a_new_burst_id_again_when_the_one_drawn_is_taken(
    s: Settings, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run_burst makes its burst id itself (to note it in the job first): one another producer
    drew in the same second failed the job with "already exists"; it is drawn again."""
    Producer(s).submit(THREE[:1], burst_id="same")
    drawn = iter(["same", "other"])
    monkeypatch.setattr(rq_jobs, "new_burst_id", lambda: next(drawn))
    with pytest.raises(BurstTimeout, match="burst other: 0/3 results"):
        rq_jobs.run_burst(THREE, timeout=0.5, redis_url=s.redis_url, namespace=s.namespace)


@pytest.mark.parametrize(
    ("failed", "total", "max_failed", "over"),
    [
        (0, 3, None, False),
        (3, 3, None, False),
        (1, 3, 0, True),
        (1, 3, 1, False),
        (2, 3, 1, True),
        (1, 3, 0.5, False),
        (2, 3, 0.5, True),
        (3, 3, 1.0, False),
        (1, 10, 0.1, False),
        (29, 100, 0.29, False),  # 0.29 * 100 is 28.999999999999996 in floats
        (57, 100, 0.57, False),
        (30, 100, 0.29, True),
    ],
)
def test_max_failed_is_a_count_when_int_and_a_share_when_float(
    failed: int, total: int, max_failed: float | None, over: bool
) -> None:
    """An int allows that many failed requests; a float allows that share of the burst."""
    assert _too_many_failed(failed, total, max_failed) is over


# ---- completion callbacks ------------------------------------------------------------------
def test_on_complete_job_runs_once_even_when_the_last_result_is_redelivered(
    s: Settings, r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """The worker that records the last result enqueues the callback; redelivered entries of
    the finished burst (recorded again as duplicates) enqueue nothing more; it runs once."""
    q = queue(r, s)
    keys = Keys(s.namespace)
    burst = Producer(s).submit(THREE, on_complete=MARK_DONE, rq_queue=q.name)
    entries = r.xrange(keys.stream(0))
    with fake_worker(s):
        results.wait(burst, s, timeout=30, client=r)
        wait_until(lambda: q.count == 1, 10, "the callback enqueued")
        before = r.hgetall(keys.burst(burst))
        for _, fields in entries:  # the same entries delivered again (a crash before XACK)
            r.xadd(keys.stream(0), fields)
        wait_until(lambda: queue_empty(r, s) == (0, 0), 30, "the redeliveries acked")
        assert r.hgetall(keys.burst(burst)) == before  # recorded nothing: only acked
    assert q.count == 1
    rq_worker(s.redis_url, q.name)
    assert r.get(calls_key(burst)) == b"1"
    assert r.hget(keys.burst(burst), "callback_job") == callback_job_id(s.namespace, burst).encode()


def test_on_complete_is_not_enqueued_again_when_a_requeued_dead_letter_completes_the_burst(
    s: Settings, r: redis.Redis, fake_worker: MakeWorker
) -> None:
    """A burst whose last outstanding request is dead-lettered finishes (one failed) and
    enqueues its callback; `dead --requeue` takes the failure back, the request runs again and
    completes the burst a second time, which enqueues nothing more: the callback runs once."""
    s = s.replace(max_attempts=2, claim_idle_s=0.5)
    q = queue(r, s)
    keys = Keys(s.namespace)
    burst = Producer(s).submit(THREE[::2], on_complete=MARK_DONE, rq_queue=q.name)
    stream = keys.stream(0)
    r.xgroup_create(stream, GROUP, id="0")  # a worker read both entries and died, the second
    ids = [i for i, _ in r.xreadgroup(GROUP, "ghost", {stream: ">"}, count=2)[0][1]]
    r.xclaim(stream, GROUP, "ghost", 0, [ids[1]])  # ... after its max_attempts-th delivery
    fw = fake_worker(s)
    first = results.wait(burst, s, timeout=30, client=r)
    assert (first.done, first.failed) == (1, 1)
    wait_until(lambda: q.count == 1, 10, "the callback enqueued")
    job = r.hget(keys.burst(burst), "callback_job")

    rep = Recovery(s).requeue()
    assert (rep.requeued, rep.cleared) == (1, 1)
    wait_until(lambda: r.hget(keys.burst(burst), "done") == b"2", 30, "the requeued request")
    assert r.hget(keys.burst(burst), "status") == b"finished"
    fw.stop()  # its burst-done hooks have run
    assert q.count == 1
    assert r.hget(keys.burst(burst), "callback_job") == job
    rq_worker(s.redis_url, q.name)
    assert r.get(calls_key(burst)) == b"1"


def test_concurrent_enqueue_on_complete_enqueues_one_job(s: Settings, r: redis.Redis) -> None:
    """Eight concurrent calls for one finished burst: one enqueues the job, seven see it done."""
    q = queue(r, s)
    burst = finished_burst(r, s, on_complete=MARK_DONE, rq_queue=q.name)

    async def main() -> list[str | None]:
        clients = [aredis.Redis.from_url(s.redis_url) for _ in range(8)]
        try:
            return await asyncio.gather(*(aenqueue_on_complete(c, s, burst) for c in clients))
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))

    got = asyncio.run(main())
    assert [g for g in got if g is not None] == [callback_job_id(s.namespace, burst)]
    assert q.count == 1
    assert q.jobs[0].func_name == "rq_targets.mark_done" and q.jobs[0].args == [burst]


def enqueue_once(s: Settings, burst: str) -> str | None:
    """`aenqueue_on_complete` for ``burst`` from a fresh asyncio client, as a worker calls it."""

    async def main() -> str | None:
        c = aredis.Redis.from_url(s.redis_url)
        try:
            return await aenqueue_on_complete(c, s, burst)
        finally:
            await c.aclose()

    return asyncio.run(main())


def test_burst_without_on_complete_enqueues_nothing(s: Settings, r: redis.Redis) -> None:
    """A finished burst that asked for no callback gets none."""
    burst = finished_burst(r, s)

    assert enqueue_once(s, burst) is None
    assert r.hget(Keys(s.namespace).burst(burst), "callback_job") is None


def test_unfinished_burst_gets_no_callback_yet(s: Settings, r: redis.Redis) -> None:
    """A burst still running is not claimed, so its real completion can still enqueue."""
    q = queue(r, s)
    burst = finished_burst(r, s, status="queued", on_complete=MARK_DONE, rq_queue=q.name)

    assert enqueue_once(s, burst) is None
    assert q.count == 0


@pytest.mark.parametrize(
    ("spec", "dotted"),
    [("pkg.module:func", "pkg.module.func"), ("m:f", "m.f"), ("a.b:C.method", "a.b.C.method")],
)
def test_callback_path_turns_colon_form_into_rq_dotted_path(spec: str, dotted: str) -> None:
    """'pkg.module:func' becomes the dotted path RQ imports."""
    assert callback_path(spec) == dotted


@pytest.mark.parametrize("spec", ["pkg.module.func", "pkg:", ":f", "a b:f", "pkg:f()", "1x:f"])
def test_callback_path_refuses_what_is_not_module_colon_function(spec: str) -> None:
    """Anything but dotted identifiers around one colon is refused with ValidationError."""
    with pytest.raises(ValidationError, match=r"package\.module:function"):
        callback_path(spec)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"on_complete": "a b:c"}, "package.module:function"),
        ({"on_complete": "myapp.pipeline:summarize-burst"}, "package.module:function"),
        ({"on_complete": "m:f()"}, "package.module:function"),
        ({"on_complete": 5}, "package.module:function"),
        ({"on_complete": MARK_DONE, "rq_queue": ""}, "rq_queue must be an RQ queue name"),
        ({"on_complete": MARK_DONE, "rq_queue": 5}, "rq_queue must be an RQ queue name"),
    ],
)
def test_a_malformed_on_complete_is_refused_at_submit(
    s: Settings, r: redis.Redis, options: dict[str, Any], match: str
) -> None:
    """A callback that can never be enqueued (not dotted names around one colon, not a string,
    no queue name) is refused before anything is written, not left for the worker to skip."""
    with pytest.raises(ValidationError, match=match):
        Producer(s).submit(THREE, **options)
    assert r.zcard(Keys(s.namespace).bursts) == 0


def test_cancel_of_a_burst_whose_recorded_callback_is_malformed_succeeds(
    s: Settings, r: redis.Redis
) -> None:
    """A burst record holding an on_complete that does not parse (written before submit checked
    it): the cancel that ends the burst logs and skips the callback instead of raising."""
    burst = Producer(s).submit(THREE)
    r.hset(Keys(s.namespace).burst(burst), mapping={"on_complete": "a b:c", "rq_queue": "x"})
    rep = cancel(burst, s)
    assert rep.ended and rep.cancelled == 3
    assert r.hget(Keys(s.namespace).burst(burst), "callback_job") is None


def test_callback_job_id_is_stable_and_in_rq_alphabet() -> None:
    """The callback's RQ job id is fixed per (namespace, burst) and uses only [A-Za-z0-9_-]."""
    a = callback_job_id("ns", "burst/with:odd chars")
    assert a == callback_job_id("ns", "burst/with:odd chars")
    assert a != callback_job_id("other", "burst/with:odd chars")
    assert all(c.isalnum() or c in "_-" for c in a)


# ---- once on the real engine ---------------------------------------------------------------
@pytest.mark.engine
def test_run_burst_on_the_real_engine(engines: Any, r: redis.Redis, tmp_path: Path) -> None:
    """RQ -> run_burst -> real vLLM CPU workers: every request done, text in the out file."""
    s = engines.settings
    q = queue(r, s)
    reqs = [
        {"id": "a", "prompt": "The capital of Italy is", "max_tokens": 8, "temperature": 0.0},
        {"id": "b", "prompt": "List three colours:", "max_tokens": 8, "temperature": 0.0},
    ]
    out = tmp_path / "out.jsonl"
    job = q.enqueue(
        RUN_BURST,
        reqs,
        redis_url=s.redis_url,
        namespace=s.namespace,
        out=str(out),
        max_failed=0,
        timeout=300,
        job_timeout=400,
    )
    rq_worker(s.redis_url, q.name, timeout=420)
    summary = job.return_value(refresh=True)
    assert summary is not None, job.latest_result()
    assert (summary["total"], summary["done"], summary["failed"]) == (2, 2, 0)
    lines = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    assert [x["id"] for x in lines] == ["a", "b"]
    assert all(x["text"] and x["output_tokens"] > 0 for x in lines)


@pytest.mark.engine
def test_on_complete_runs_once_after_a_burst_on_the_real_engine(
    engines: Any, r: redis.Redis
) -> None:
    """A burst spread over both real workers enqueues its callback once; it runs once."""
    s = engines.settings
    q = queue(r, s)
    reqs = [{"id": str(i), "prompt": f"Count to {i}:", "max_tokens": 4} for i in range(4)]
    burst = Producer(s).submit(
        reqs, placement="round-robin", on_complete=MARK_DONE, rq_queue=q.name
    )
    results.wait(burst, s, timeout=300, client=r)
    deadline = time.monotonic() + 30
    while q.count < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert q.count == 1
    rq_worker(s.redis_url, q.name)
    assert r.get(calls_key(burst)) == b"1"
