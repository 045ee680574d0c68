"""End to end on a real Redis Cluster (tests/redis_cluster.py: 3 masters, 3 replicas), with the
real `Worker` loop over tests/fake_engine.py: bursts over shards whose `{s<k>}` slots sit on
different masters, cancel, deadlines, reclaim after kill -9, dead letters and requeue, priority
lanes, `prefixq serve` with the official openai client, an RQ `run_burst` (RQ on a plain
redis-server through ``rq_redis_url``), `prefixq check`, and an evicting master refused. The one
real-engine test is at the end (marked ``engine``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from openai import OpenAI
from rq import Queue
from rq.job import JobStatus
from rq.serializers import JSONSerializer

from helpers import (
    cli,
    fault_worker,
    pending_on,
    queue_empty,
    queue_keys,
    requests,
    wait_burst,
    wait_settled,
    wait_until,
)
from ledger import LEDGER, account
from openai_server import Server, completion_line
from prefixq.cli.redis_server import RedisServer
from prefixq.client import Producer, results
from prefixq.core import wire
from prefixq.core.entries import Entry
from prefixq.core.keys import FIELD, GROUP, Keys
from prefixq.core.settings import Settings
from prefixq.core.sharing import PRIORITIES
from prefixq.store import burst_end
from redis_cluster import ClusterFakeWorker, OnShard, RedisCluster
from rq_targets import calls_key

MakeSettings = Callable[..., Settings]
MakeWorker = Callable[..., ClusterFakeWorker]
TESTS = Path(__file__).resolve().parent
RQ_WORKER = [sys.executable, "-m", "rq.cli", "worker", "--burst"]
RQ_WORKER += ["--serializer", "rq.serializers.JSONSerializer"]


def slow(n: int, secs: float, tag: str = "q") -> list[dict[str, Any]]:
    return [
        {"id": f"{tag}{i}", "prompt": f"sleep:{secs} {tag} {i}", "max_tokens": 4} for i in range(n)
    ]


def shard_masters(cluster: RedisCluster, s: Settings) -> dict[int, str]:
    """Shard -> the address of the master that holds its `{s<k>}` slot now."""
    keys = Keys(s.namespace)
    return {k: cluster.master_of(keys.intake(k, "normal")).addr for k in range(s.shards)}


# ---- the data path ----------------------------------------------------------------------------
def test_a_burst_over_shards_on_three_masters_comes_back_whole_in_input_order(
    cluster: RedisCluster,
    cluster_settings: MakeSettings,
    cr: redis.Redis,
    cluster_worker: MakeWorker,
) -> None:
    """Given 4 shards whose slots sit on all three masters and a worker on each, a burst of 60
    requests placed round-robin comes back in input order, each result once, from every shard."""
    s = cluster_settings(placement="round-robin")
    masters = shard_masters(cluster, s)
    assert len({masters[1], masters[2], masters[3]}) == 3, masters
    for k in range(4):
        cluster_worker(s, shard=k, name=f"w{k}")
    reqs = requests(60, lambda i: f"one two {i}")
    burst = Producer(s).submit(reqs)
    burst.wait(timeout=60)
    got = burst.collect()
    assert [g.id for g in got] == [q["id"] for q in reqs]
    assert [g.text for g in got] == [f"{i} two one" for i in range(60)]
    assert all(g.error is None for g in got)
    by_shard = Counter(g.shard for g in got)
    print(f"  results per shard {dict(by_shard)}; shard masters {masters}")
    assert set(by_shard) == {0, 1, 2, 3}
    assert len({masters[k] for k in by_shard}) == 3
    out = account(cr, s, burst, 60, what="cluster burst")
    assert (out.lost, out.duplicated, out.done) == (0, 0, 60)
    streamed = list(Producer(s).submit(reqs[:8]).iterate(timeout=60))
    assert [g.id for g in streamed] == [q["id"] for q in reqs[:8]]
    for k in range(4):
        wait_settled(cr, s, k)


def test_a_chunk_sent_again_through_a_failover_on_a_cluster_runs_each_request_once(
    cluster_settings: MakeSettings,
    cr: redis.Redis,
    cluster_worker: MakeWorker,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Given a submit over 4 shards on three masters whose third chunk (64 requests) every master
    processed before the connection dropped (a failover's lost reply), when the producer sends the
    chunk again (its ride-through), then every request is enqueued once, the engines compute each
    once, and one INFO line says the 64 were skipped."""
    import logging

    from redis.asyncio.cluster import ClusterPipeline

    s = cluster_settings(placement="round-robin")
    workers = [cluster_worker(s, shard=k, name=f"w{k}") for k in range(4)]
    real = ClusterPipeline.execute
    chunks = []

    async def failover(self: Any, *a: Any, **kw: Any) -> Any:
        queue = self._execution_strategy._command_queue  # entries: lua/enqueue.lua (or XADDs)
        if any(c.args[0] == "XADD" or ":enq:" in str(c.args[3:4]) for c in queue):
            chunks.append(1)
            if len(chunks) == 3:
                await real(self, *a, **kw)
                raise redis.ConnectionError("Connection closed by server.")
        return await real(self, *a, **kw)

    monkeypatch.setattr(ClusterPipeline, "execute", failover)
    with caplog.at_level(logging.INFO, logger="prefixq.client.enqueue"):
        burst = Producer(s).submit(requests(200))
    monkeypatch.undo()
    assert len(chunks) == 5, "chunks of 4, 16, 64 (sent twice) and 116"
    wait_burst(cr, s, burst, 30)
    ours = [rid for w in workers for rid in w.engine.seen if rid.startswith(f"{burst}:")]
    ran = Counter(int(rid.split(":")[1]) for rid in ours)  # burst:index:entry
    assert sorted(ran) == list(range(200)) and set(ran.values()) == {1}, ran.most_common(3)
    skipped = [x.getMessage() for x in caplog.records if "enqueued already, skipped" in x.message]
    assert skipped == [
        f"burst {burst}: requests 21-84 sent again: 64 of them had been enqueued already, "
        "skipped (64 in this submit)"
    ]
    out = account(cr, s, burst, 200, what="a chunk sent again on a cluster")
    assert (out.lost, out.duplicated, out.done) == (0, 0, 200)


def test_cancel_on_a_cluster_skips_queued_and_keeps_finished(
    cluster_settings: MakeSettings, cr: redis.Redis, cluster_worker: MakeWorker
) -> None:
    """Given a burst of slow requests over shards 1 and 2 (two masters) half-way, a cancel ends
    it: finished results stay, the rest are cancelled, each request has one result, queues empty."""
    s = cluster_settings(shards=3, placement="round-robin", max_inflight=2)
    workers = [cluster_worker(s, shard=k, name=f"w{k}") for k in range(3)]
    burst = Producer(s).submit(slow(60, 0.2))
    wait_until(lambda: burst.status().done >= 6, 30, "6 results before the cancel")
    rep = burst.cancel()
    LEDGER.fault(f"cancel of a running burst on a cluster ({rep.cancelled} cancelled)")
    wait_burst(cr, s, burst, 20)
    codes = [g.error_code for g in burst.collect()]
    assert set(codes) <= {None, "cancelled"}
    assert codes.count(None) >= 6 and codes.count("cancelled") >= 30, Counter(codes)
    assert burst.status().status == "cancelled"
    ran = sum(1 for w in workers for rid in w.engine.seen if rid.startswith(f"{burst}:"))
    assert ran <= 60 - codes.count("cancelled") + 3 * 2  # at most each window was aborted
    for k in range(3):
        wait_until(lambda k=k: queue_empty(cr, s, k) == (0, 0), 10, f"shard {k} drained")
    out = account(cr, s, burst, 60, what="cancelled on a cluster")
    assert out.lost == 0 and out.duplicated == 0


def test_a_deadline_on_a_cluster_expires_what_was_not_admitted(
    cluster_settings: MakeSettings, cr: redis.Redis, cluster_worker: MakeWorker
) -> None:
    """A burst over 3 shards with a deadline 1 s away: some requests finish, the rest expire
    without running, the burst ends as expired within a few seconds of its deadline."""
    s = cluster_settings(shards=3, placement="round-robin", max_inflight=2)
    for k in range(3):
        cluster_worker(s, shard=k, name=f"w{k}")
    deadline = time.time() + 1.0
    burst = Producer(s).submit(slow(60, 0.2), deadline=deadline)
    wait_burst(cr, s, burst, 20)
    ended = time.time()
    codes = [g.error_code for g in burst.collect()]
    print(f"  {Counter(codes)}; ended {ended - deadline:.2f}s after the deadline")
    assert set(codes) <= {None, "expired"} and 0 < codes.count(None) < 60
    assert burst.status().status == "expired"
    assert ended - deadline < 5
    out = account(cr, s, burst, 60, what="expired on a cluster")
    assert out.lost == 0 and out.duplicated == 0


def test_kill_9_of_a_worker_on_a_cluster_its_entries_are_reclaimed_once(
    cluster_settings: MakeSettings,
    cr: redis.Redis,
    cluster_worker: MakeWorker,
    tmp_path: Path,
) -> None:
    """Given a worker process on shard 2 killed -9 with requests in flight, a second worker of
    the shard reclaims its entries past claim_idle_s, and every request has exactly one result."""
    s = cluster_settings(shards=3, claim_idle_s=1.0, max_inflight=4)
    r = cr
    victim = fault_worker(s, tmp_path / "victim.log", "--shard", "2", "--name", "victim")
    try:
        keys = Keys(s.namespace)
        wait_until(
            lambda: r.hget(keys.heartbeat(2, "victim"), "engine_up") == b"1", 30, "victim up"
        )
        burst = Producer(s).submit(slow(30, 0.3), placement=OnShard(2))
        wait_until(lambda: pending_on(r, s, "victim", 2) > 0, 30, "victim with work in flight")
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
    left = pending_on(r, s, "victim", 2)
    assert left > 0, "the victim died with nothing in flight"
    LEDGER.fault(f"kill -9 of a worker on a cluster with {left} entries pending")
    rescuer = cluster_worker(s, shard=2, name="rescuer")
    wait_burst(r, s, burst, 60)
    out = account(r, s, burst, 30, what="reclaimed on a cluster")
    assert (out.lost, out.duplicated, out.done) == (0, 0, 30)
    assert any(x.worker == "rescuer" for x in out.results.values())
    assert rescuer.running
    wait_settled(r, s, 2)


def test_reclaim_dead_letters_and_requeue_on_a_cluster(
    cluster_settings: MakeSettings, cr: redis.Redis, cluster_worker: MakeWorker
) -> None:
    """Given entries pending on a consumer that died, one delivered past max_attempts, then
    `prefixq reclaim` moves the rest back and dead-letters that one (failing its request), a
    worker serves the moved ones, `prefixq dead` lists the letter, `dead --requeue` runs it again
    and the burst ends with one successful result each."""
    s = cluster_settings(shards=1, max_attempts=3, claim_idle_s=1.0)  # the CLI's default too
    r = cr
    keys = Keys(s.namespace)
    burst = Producer(s).submit(requests(6))
    queues = queue_keys(r, s)
    for key in queues[: len(PRIORITIES)]:  # the intakes; a lane has its group from the producer
        r.xgroup_create(key, GROUP, id="0", mkstream=True)
    got = r.xreadgroup(GROUP, "ghost", dict.fromkeys(queues, ">"), count=10)
    where = {
        Entry.from_wire(wire.decode(f[FIELD])).index: (key, entry_id)
        for key, rows in got
        for entry_id, f in rows
    }
    assert sorted(where) == list(range(6)), where
    key, entry_id = where[4]
    for _ in range(2):  # delivered 3 times: at max_attempts
        r.xclaim(key, GROUP, "ghost", 0, [entry_id])
    LEDGER.fault("a consumer died on a cluster with 6 entries pending")

    p = cli(s, "reclaim", "--idle-s", "0", "--json")
    assert p.returncode == 0, p.stderr
    (rep,) = json.loads(p.stdout)
    assert (rep["moved"], rep["dead"]) == (5, 1), rep
    with cluster_worker(s, name="rw"):
        wait_burst(r, s, burst, 30)
        out = account(r, s, burst, 6, what="after reclaim on a cluster")
        assert (out.lost, out.duplicated, out.done, out.failed) == (0, 0, 5, 1)
        assert out.results[4].error is not None and "dead-lettered" in out.results[4].error
        p = cli(s, "dead", "--json")
        assert p.returncode == 0, p.stderr
        letters = json.loads(p.stdout)
        assert [(d["burst"], d["index"]) for d in letters] == [(burst, 4)]
        p = cli(s, "dead", "--requeue", "--json")
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["requeued"] == 1
        wait_until(lambda: burst.status().done == 6, 30, "the requeued request done")
        out = account(r, s, burst, 6, taken_back=1, what="after requeue on a cluster")
    assert (out.lost, out.duplicated, out.done, out.failed) == (0, 0, 6, 0)
    assert r.xlen(keys.dead(0)) == 0 and queue_empty(r, s) == (0, 0)


def test_a_high_priority_burst_overtakes_a_running_one_on_a_cluster(
    cluster_settings: MakeSettings, cr: redis.Redis, cluster_worker: MakeWorker
) -> None:
    """Given a 400-request normal burst running on shard 2 (its lane on that master), a
    20-request high-priority burst finishes while most of the normal one is still queued; both
    complete, and every lane is closed afterwards."""
    s = cluster_settings(shards=3, max_inflight=4)
    keys = Keys(s.namespace)
    cr.hset(keys.config, "shards", 3)
    cluster_worker(s, shard=2, name="w2")
    normal = Producer(s).submit(slow(400, 0.02, "n"), placement=OnShard(2))
    wait_until(lambda: cr.hlen(keys.results(normal)) >= 20, 30, "the normal burst running")
    high = Producer(s).submit(slow(20, 0.02, "h"), priority="high", placement=OnShard(2))
    wait_burst(cr, s, high, 30)
    left = 400 - cr.hlen(keys.results(normal))
    print(f"  the high burst done with {left} of the normal one left")
    assert left > 200
    burst_end.cancel(normal, s)
    wait_burst(cr, s, normal, 30)
    assert account(cr, s, normal, 400, what="normal, cancelled").lost == 0
    wait_until(lambda: cr.hlen(keys.lanes(2)) == 0, 30, "every lane closed")


# ---- the commands on top ----------------------------------------------------------------------
def test_serve_with_the_openai_client_runs_a_batch_on_a_cluster(
    cluster_settings: MakeSettings, cluster_worker: MakeWorker, tmp_path: Path
) -> None:
    """`prefixq serve` on a cluster URL: the official openai client uploads a file, creates a
    batch, and the batch completes with its output in input order."""
    s = cluster_settings(shards=2, placement="round-robin")
    for k in range(2):
        cluster_worker(s, shard=k, name=f"w{k}")
    lines = [completion_line(f"r{i}", f"one two three {i}") for i in range(6)]
    body = "".join(json.dumps(x) + "\n" for x in lines).encode()
    with Server(s, tmp_path / "files") as srv:
        c = OpenAI(base_url=srv.url, api_key="k", max_retries=0)
        f = c.files.create(file=("in.jsonl", body), purpose="batch")
        b = c.batches.create(
            input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 60
        while (b := c.batches.retrieve(b.id)).status not in ("completed", "failed"):
            assert time.monotonic() < deadline, f"batch {b.status} after 60 s: {srv.tail()}"
            time.sleep(0.2)
        assert b.status == "completed", srv.tail()
        out = [json.loads(x) for x in c.files.content(b.output_file_id or "").text.splitlines()]
    assert [x["custom_id"] for x in out] == [f"r{i}" for i in range(6)]
    assert out[0]["response"]["body"]["choices"][0]["text"] == "0 three two one"
    assert "Traceback" not in srv.tail()


def test_rq_run_burst_with_rq_on_a_plain_redis_and_the_data_on_the_cluster(
    cluster_settings: MakeSettings,
    cr: redis.Redis,
    cluster_worker: MakeWorker,
    redis_server: RedisServer,
) -> None:
    """RQ cannot use a cluster: with ``rq_redis_url`` naming a plain redis-server, a burst's
    on_complete callback is enqueued there by the worker, and a stock rq worker there runs
    `run_burst` (whose burst's data goes to the cluster) and the callback."""
    s = cluster_settings(shards=2, placement="round-robin", rq_redis_url=redis_server.url)
    plain = redis.Redis.from_url(redis_server.url)
    q = Queue(f"rq-{s.namespace}", connection=plain, serializer=JSONSerializer)
    job = q.enqueue(
        "prefixq.rq_jobs.run_burst",
        requests(5, lambda i: f"a b {i}"),
        job_timeout=120,
        redis_url=s.redis_url,
        rq_redis_url=redis_server.url,
        namespace=s.namespace,
        timeout=60,
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent / "src")])}
    with cluster_worker(s, shard=0, name="w0"), cluster_worker(s, shard=1, name="w1"):
        called = Producer(s).submit(
            requests(3), on_complete="rq_targets:mark_done", rq_queue=q.name
        )
        called.wait(timeout=60)
        wait_until(lambda: q.count >= 2, 30, "the on_complete job enqueued on the plain Redis")
        done = subprocess.run(
            [*RQ_WORKER, "--url", redis_server.url, q.name],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 0, done.stdout + done.stderr
    assert job.get_status(refresh=True) == JobStatus.FINISHED, done.stderr[-3000:]
    summary = job.return_value(refresh=True)
    assert summary is not None and (summary["total"], summary["done"]) == (5, 5)
    got = results.collect(summary["burst"], s, client=cr)
    assert [g.text for g in got] == [f"{i} b a" for i in range(5)]
    assert plain.get(calls_key(called)) == b"1", "the on_complete callback did not run once"
    assert plain.keys(f"{s.namespace}:*") == [], "prefixq data landed on the RQ Redis"
    assert cr.exists(Keys(s.namespace).burst(summary["burst"]))
    plain.close()


def test_check_on_a_cluster_reports_the_nodes_and_each_shards_master(
    cluster: RedisCluster, cluster_settings: MakeSettings, cluster_worker: MakeWorker
) -> None:
    """`prefixq check` on a cluster URL says cluster mode, lists the masters and replicas, and
    names for each shard the master that holds its slot; it exits 0 with a worker per shard."""
    s = cluster_settings(shards=4)
    for k in range(4):
        cluster_worker(s, shard=k, name=f"hc{k}")
    p = cli(s, "check")
    text = p.stdout + p.stderr
    print(text)
    assert p.returncode == 0, text
    assert "cluster" in text.lower()
    for n in cluster.nodes:
        assert n.addr in text, f"node {n.addr} not listed"
    masters = shard_masters(cluster, s)
    lines = text.splitlines()
    for k, addr in masters.items():
        assert any(f"shard {k}" in ln and addr in ln for ln in lines), (
            f"no line names shard {k} with its master {addr}"
        )


def test_an_evicting_policy_on_one_master_is_refused(
    cluster: RedisCluster, cluster_settings: MakeSettings
) -> None:
    """Given one master of three set to allkeys-lru, `prefixq check` exits 2 naming that
    node and the fix; set back to noeviction, the refusal is gone."""
    s = cluster_settings(shards=4)
    bad = cluster.master_of(Keys(s.namespace).intake(2, "normal"))
    c = bad.client()
    try:
        c.config_set("maxmemory-policy", "allkeys-lru")
        LEDGER.fault(f"one master of a cluster evicts ({bad.addr}: allkeys-lru)")
        p = cli(s, "check", "--shards", "4")
        print(f"  prefixq check: exit {p.returncode}: {p.stderr.strip()}")
        assert p.returncode == 2
        assert "allkeys-lru" in p.stderr and bad.addr in p.stderr
        assert "noeviction" in p.stderr
    finally:
        c.config_set("maxmemory-policy", "noeviction")
        c.close()
    p = cli(s, "check", "--shards", "4")
    assert "allkeys-lru" not in p.stderr


# ---- the real engine ----------------------------------------------------------------------
@pytest.mark.engine
def test_a_real_vllm_worker_serves_a_burst_on_a_cluster(
    cluster: RedisCluster,
    cluster_settings: MakeSettings,
    cr: redis.Redis,
    start_worker: Callable[..., Any],
) -> None:
    """One `prefixq worker` with the real vLLM CPU engine on shard 2 of a cluster deployment:
    a small greedy burst comes back in input order with real text and token counts."""
    s = cluster_settings(shards=3, claim_idle_s=5.0, heartbeat_s=1.0, grace_s=60.0)
    cr.hset(Keys(s.namespace).config, "shards", 3)
    w = start_worker(s, shard=2, name="real-s2")
    keys = Keys(s.namespace)
    wait_until(
        lambda: w.proc.poll() is not None or cr.hget(keys.heartbeat(2, w.name), "engine_up"),
        900,
        "the real worker up",
        0.5,
    )
    assert w.proc.poll() is None, w.tail()
    reqs = [
        {"id": f"p{i}", "prompt": p, "max_tokens": 8, "temperature": 0.0}
        for i, p in enumerate(["The capital of Italy is", "List three colours:", "2 + 2 ="])
    ]
    burst = Producer(s).submit(reqs, placement=OnShard(2))
    burst.wait(timeout=600)
    got = burst.collect()
    assert [g.id for g in got] == ["p0", "p1", "p2"]
    assert all(g.error is None and g.output_tokens > 0 and g.text for g in got), got
    assert {g.shard for g in got} == {2}
    assert "Traceback" not in w.tail()
