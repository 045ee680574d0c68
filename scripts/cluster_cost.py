"""Issue 24, measured: what a Redis Cluster costs and gives, with a zero-cost engine (the `Engine`
protocol answering at once, so prefixq's own path is all there is to measure).

For each set-up — one redis-server, a 3-master Redis Cluster (tests/redis_cluster.py: 3 masters,
3 replicas, AOF everysec), and that cluster with ``min_replicas_acked=1`` — three worker processes
(shards 1, 2 and 3, whose `{s<k>}` slots sit on three different masters of the cluster) drain
bursts a producer here submits round-robin over them. Per set-up, the median over ``--reps``
bursts of ``--requests`` requests of:

- the producer -> worker -> result rate (submit start to the last result, requests per second);
- Redis CPU per request per node (``INFO cpu`` used_cpu_sys + used_cpu_user deltas, less each
  node's idle rate measured just before), and its sum over the nodes;
- Redis commands per request (``INFO commandstats``) and WAIT calls per request; from the two
  cluster runs, what WAIT adds per request and per WAIT call (one per group of results a worker
  records and acks together, plus one per master for each submit), and the wall time of one
  fence (SET + WAIT) on one master and on every master.

docs/BENCHMARKS.md ("Redis Cluster") has the figures; docs/operations.md the capacity table.

    python scripts/cluster_cost.py [--requests 20000] [--reps 3] [--json out.json]

Speed is measured, never asserted. Run it under the shared lock: ``flock /tmp/heavy.lock``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the cluster launcher and the shard placer of the tests

from prefixq.bench.null_engine import NullEngine  # noqa: E402
from prefixq.cli.redis_server import RedisServer  # noqa: E402
from prefixq.client import Producer, results  # noqa: E402
from prefixq.core.keys import Keys  # noqa: E402
from prefixq.core.settings import Settings  # noqa: E402
from redis_cluster import OnShard, RedisCluster  # noqa: E402

SHARDS = (1, 2, 3)
IDLE_S = 2.0


# ---- the worker (a process of its own) ------------------------------------------------------
def worker_main(argv: list[str]) -> int:
    from prefixq.worker.worker import Worker

    p = argparse.ArgumentParser()
    p.add_argument("--settings", required=True, help="JSON of Settings fields")
    p.add_argument("--shard", type=int, required=True)
    args = p.parse_args(argv)
    s = Settings(**json.loads(args.settings))

    async def run() -> int:
        engine = NullEngine(max_num_seqs=max(s.max_inflight // 2, 1))
        w = Worker(s, args.shard, engine, name=f"cost-s{args.shard}")
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, w.stop)
        return await w.run()

    return asyncio.run(run())


@contextmanager
def workers(s: Settings, client: Any) -> Iterator[list[int]]:
    """One worker process per shard of SHARDS until the block ends (their pids)."""
    fields = {f: getattr(s, f) for f in s.__dataclass_fields__ if f != "api_keys"}
    cmd = [sys.executable, __file__, "worker", "--settings", json.dumps(fields)]
    procs = [
        subprocess.Popen(
            [*cmd, "--shard", str(k)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for k in SHARDS
    ]
    keys = Keys(s.namespace)
    try:
        deadline = time.monotonic() + 60
        for k, proc in zip(SHARDS, procs, strict=True):
            while client.hget(keys.heartbeat(k, f"cost-s{k}"), "engine_up") != b"1":
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"worker of shard {k} did not start (exit {proc.poll()})")
                time.sleep(0.05)
        yield [p.pid for p in procs]
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


# ---- what Redis says ------------------------------------------------------------------------
def node_stats(ports: dict[str, int]) -> dict[str, dict[str, float]]:
    """Per node (name -> port): CPU seconds used, commands run, WAIT calls."""
    out = {}
    for name, port in ports.items():
        c = redis.Redis("127.0.0.1", port)
        try:
            cpu = c.info("cpu")
            cmds = c.info("commandstats")
        finally:
            c.close()
        out[name] = {
            "cpu": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
            "calls": float(sum(int(v["calls"]) for v in cmds.values())),
            "wait": float(int(cmds.get("cmdstat_wait", {}).get("calls", 0))),
        }
    return out


def delta(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]]) -> dict[str, Any]:
    return {n: {k: b[n][k] - a[n][k] for k in a[n]} for n in a}


def one_run(s: Settings, client: Any, ports: dict[str, int], n: int) -> dict[str, Any]:
    """Submit one burst of ``n`` requests over SHARDS and wait for every result."""
    reqs = [{"id": f"q{i}", "prompt": f"a {i}", "max_tokens": 1} for i in range(n)]
    idle0 = node_stats(ports)
    time.sleep(IDLE_S)
    idle = delta(idle0, node_stats(ports))
    s0 = node_stats(ports)
    t0 = time.perf_counter()
    burst = Producer(s).submit(reqs, placement=OnShard(*SHARDS))
    submitted = time.perf_counter() - t0
    results.wait(burst, s, timeout=600, client=client)
    took = time.perf_counter() - t0
    time.sleep(0.2)  # the last acks
    took_all = time.perf_counter() - t0
    used = delta(s0, node_stats(ports))
    cpu = {
        name: max(0.0, used[name]["cpu"] - idle[name]["cpu"] * took_all / IDLE_S) for name in ports
    }
    waits = sum(u["wait"] for u in used.values())
    return {
        "rate": n / took,
        "submit_s": submitted,
        "cpu_us_per_request": {name: cpu[name] / n * 1e6 for name in ports},
        "cpu_us_per_request_total": sum(cpu.values()) / n * 1e6,
        "commands_per_request": sum(u["calls"] for u in used.values()) / n,
        "wait_per_request": waits / n,
    }


# ---- set-ups --------------------------------------------------------------------------------
def settings(url: str, **kw: Any) -> Settings:
    base: dict[str, Any] = {
        "redis_url": url,
        "namespace": f"cost{secrets.token_hex(3)}",
        "shards": 4,
        "max_inflight": 256,
        "gc_freeze": False,
    }
    return Settings(**(base | kw))


def measure(url: str, ports: dict[str, int], reps: int, n: int, **kw: Any) -> dict[str, Any]:
    from prefixq.store.connection import sync_client

    s = settings(url, **kw)
    client = sync_client(s)
    runs: list[dict[str, Any]] = []
    try:
        client.hset(Keys(s.namespace).config, "shards", s.shards)
        with workers(s, client):
            one_run(s, client, ports, min(n, 2000))  # warm-up
            for _ in range(reps):
                runs.append(one_run(s, client, ports, n))
    finally:
        client.close()
    med = statistics.median
    fences = fence_latency(s, client) if s.min_replicas_acked else {}
    return {
        **fences,
        "redis_cpu_us_per_request_runs": [round(r["cpu_us_per_request_total"], 1) for r in runs],
        "requests": n,
        "reps": reps,
        "rate_per_s": round(med(r["rate"] for r in runs)),
        "rates": [round(r["rate"]) for r in runs],
        "submit_s": round(med(r["submit_s"] for r in runs), 3),
        "redis_cpu_us_per_request_total": round(
            med(r["cpu_us_per_request_total"] for r in runs), 1
        ),
        "redis_cpu_us_per_request": {
            name: round(med(r["cpu_us_per_request"][name] for r in runs), 1) for name in ports
        },
        "commands_per_request": round(med(r["commands_per_request"] for r in runs), 2),
        "wait_per_request": round(med(r["wait_per_request"] for r in runs), 4),
    }


def fence_latency(s: Settings, client: Any, n: int = 300) -> dict[str, float]:
    """Wall time of one fence (SET + WAIT on one connection) on the master of one key, as a
    worker pays it per group of results, and on every master, as a producer pays it per submit:
    medians over ``n``, milliseconds."""
    from prefixq.store.fence import fence

    key = Keys(s.namespace).results("probe")
    one, every = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        fence(client, s, [key])
        t1 = time.perf_counter()
        fence(client, s)
        every.append(time.perf_counter() - t1)
        one.append(t1 - t0)
    return {
        "fence_ms_one_master": round(statistics.median(one) * 1e3, 3),
        "fence_ms_every_master": round(statistics.median(every) * 1e3, 3),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        sys.exit(worker_main(sys.argv[2:]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default="")
    args = p.parse_args()
    out: dict[str, Any] = {}
    with RedisServer(appendonly=True) as srv:
        out["one node"] = measure(srv.url, {"node": srv.port}, args.reps, args.requests)
        print(json.dumps({"one node": out["one node"]}), flush=True)
    with RedisCluster() as c:
        probe = Keys("x")
        role = dict.fromkeys(c.nodes, "replica")
        for m in c.live_masters():
            role[m] = "master"
        owners = {c.master_of(probe.intake(k, "normal")).port: k for k in SHARDS}
        ports = {
            f"{role[n]} {n.port}"
            + (f" (shard {owners[n.port]})" if n.port in owners else ""): n.port
            for n in c.nodes
        }
        for name, kw in (
            ("cluster", {}),
            ("cluster, min_replicas_acked=1", {"min_replicas_acked": 1}),
        ):
            c.flushall()
            out[name] = measure(c.url, ports, args.reps, args.requests, **kw)
            print(json.dumps({name: out[name]}), flush=True)
    off, on = out["cluster"], out["cluster, min_replicas_acked=1"]
    extra = on["redis_cpu_us_per_request_total"] - off["redis_cpu_us_per_request_total"]
    waits = on["wait_per_request"]
    out["wait cost"] = {
        "redis_cpu_us_per_request": round(extra, 1),
        "requests_per_wait": round(1 / waits, 1) if waits else None,
        "redis_cpu_us_per_wait": round(extra / waits, 1) if waits else None,
        "rate_change": round(on["rate_per_s"] / off["rate_per_s"] - 1, 3),
    }
    out["machine"] = f"{os.cpu_count()} cores"
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
