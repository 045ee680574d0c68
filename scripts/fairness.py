"""Issue 13, measured: priorities, equal shares between bursts, tenant weights, and what sharing
costs the default path, on the real worker loop and a private redis-server (AOF everysec), with
an engine of fixed service time (``sleep:S`` prompts; zero for the overhead runs, so the worker
loop is all there is to measure). docs/BENCHMARKS.md ("Many bursts at once") has the figures.

    python scripts/fairness.py all [--json out.json]
    python scripts/fairness.py overhead        # head latency, one burst vs 1,000 small ones
    python scripts/fairness.py sharing         # priority, equal bursts, tenants 3:1

Run it with another tree first on PYTHONPATH (``PYTHONPATH=/tmp/before/src``) for that tree's
figures: ``overhead`` and the ``equal`` scenario use none of the fair-share machinery. Workers
are separate processes (this script's ``worker`` command); the producer runs here.
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import redis

from prefixq.bench.null_engine import NullEngine
from prefixq.cli.redis_server import RedisServer
from prefixq.client import Producer
from prefixq.core import wire
from prefixq.core.keys import Keys
from prefixq.core.records import Result
from prefixq.core.settings import Settings
from prefixq.engine.protocol import EngineOutput, EngineRequest


# ---- the worker (a process of its own) ------------------------------------------------------
class SleepEngine(NullEngine):
    """``sleep:S`` prompts take S seconds; everything else answers at once."""

    async def generate(self, request: EngineRequest) -> EngineOutput:
        prompt = request.prompt or ""
        if prompt.startswith("sleep:"):
            await asyncio.sleep(float(prompt.split()[0][6:]))
        return await super().generate(request)


def worker_main(argv: list[str]) -> int:
    from prefixq.worker.worker import Worker

    p = argparse.ArgumentParser()
    p.add_argument("--settings", required=True, help="JSON of Settings fields")
    p.add_argument("--name", default="fw")
    args = p.parse_args(argv)
    s = Settings(**json.loads(args.settings))

    async def run() -> int:
        w = Worker(s, 0, SleepEngine(max_num_seqs=max(s.max_inflight // 2, 1)), name=args.name)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, w.stop)
        return await w.run()

    return asyncio.run(run())


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def redis_cpu_s(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


@contextmanager
def worker(s: Settings, name: str = "fw") -> Iterator[int]:
    """A worker process serving shard 0 until the block ends (its pid)."""
    fields = {f: getattr(s, f) for f in s.__dataclass_fields__ if f != "api_keys"}
    cmd = [sys.executable, __file__, "worker", "--settings", json.dumps(fields), "--name", name]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    r = redis.Redis.from_url(s.redis_url)
    hb = Keys(s.namespace).heartbeat(0, name)
    try:
        deadline = time.monotonic() + 60
        while r.hget(hb, "engine_up") != b"1":
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start (exit {proc.poll()})")
            time.sleep(0.05)
        yield proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        r.close()


# ---- helpers ---------------------------------------------------------------------------------
def reqs(n: int, secs: float = 0.0, tag: str = "q") -> list[dict[str, Any]]:
    prompt = f"sleep:{secs} " if secs else ""
    return [{"id": f"{tag}{i}", "prompt": f"{prompt}{tag} {i}", "max_tokens": 4} for i in range(n)]


def results(r: redis.Redis, s: Settings, burst: str) -> list[Result]:
    raw = r.hgetall(Keys(s.namespace).results(burst))
    return [Result.from_wire(wire.decode(v)) for v in raw.values()]


def wait(r: redis.Redis, s: Settings, burst: str, n: int, timeout: float = 600) -> list[Result]:
    key, deadline = Keys(s.namespace).results(burst), time.monotonic() + timeout
    while r.hlen(key) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"burst {burst}: {r.hlen(key)} of {n} results after {timeout}s")
        time.sleep(0.02)
    return results(r, s, burst)


def commands(r: redis.Redis) -> dict[str, int]:
    return {k[8:]: int(v["calls"]) for k, v in r.info("commandstats").items()}


def submit(s: Settings, requests: list[dict[str, Any]], **options: Any) -> str:
    return Producer(s).submit(requests, **options)


# ---- overhead ---------------------------------------------------------------------------------
def head_latency(srv: RedisServer, reps: int) -> dict[str, float]:
    """Submit -> first request in an engine, for a 64-request burst on an idle worker."""
    s = settings(srv, max_inflight=256)
    r = redis.Redis.from_url(srv.url)
    got = []
    with worker(s):
        for _ in range(reps):
            t0 = time.time()
            burst = submit(s, reqs(64))
            res = wait(r, s, burst, 64)
            got.append(min(x.timings.admitted for x in res) - t0)
    return {"head_latency_ms_median": round(statistics.median(got) * 1000, 2)}


def drain(srv: RedisServer, bursts: int, per_burst: int) -> dict[str, float]:
    """``bursts`` bursts of ``per_burst`` requests queued, then one worker drains them: its time
    per request (zero service time) and the Redis commands per request."""
    s = settings(srv, max_inflight=256)
    r = redis.Redis.from_url(srv.url)
    r.hset(Keys(s.namespace).config, "shards", 1)
    ids = [submit(s, reqs(per_burst, tag=f"b{b}-")) for b in range(bursts)]
    with worker(s) as pid:
        before, cpu0, rcpu0 = commands(r), cpu_s(pid), redis_cpu_s(r)
        res = [x for b in ids for x in wait(r, s, b, per_burst)]
        after, cpu1, rcpu1 = commands(r), cpu_s(pid), redis_cpu_s(r)
    n = bursts * per_burst
    span = max(x.timings.finished for x in res) - min(x.timings.admitted for x in res)
    calls = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    return {
        "requests": n,
        "us_per_request": round(span / n * 1e6, 1),
        "worker_cpu_us_per_request": round((cpu1 - cpu0) / n * 1e6, 1),
        "redis_cpu_us_per_request": round((rcpu1 - rcpu0) / n * 1e6, 1),
        "redis_commands_per_request": round(sum(calls.values()) / n, 2),
        "xreadgroup_per_request": round(calls.get("xreadgroup", 0) / n, 4),
    }


def overhead(srv: RedisServer, reps: int) -> dict[str, Any]:
    out: dict[str, Any] = head_latency(srv, 20)
    for name, (b, n) in {"one_burst": (1, 10_000), "small_bursts": (1000, 10)}.items():
        runs = [drain(srv, b, n) for _ in range(reps)]
        best = min(runs, key=lambda x: x["worker_cpu_us_per_request"])
        out[name] = best | {
            "us_per_request_runs": [x["us_per_request"] for x in runs],
            "worker_cpu_us_per_request_runs": [x["worker_cpu_us_per_request"] for x in runs],
        }
    for key in ("us_per_request", "worker_cpu_us_per_request"):
        out[f"ratio_small_to_one_{key}"] = round(
            out["small_bursts"][key] / out["one_burst"][key], 2
        )
    return out


# ---- sharing ---------------------------------------------------------------------------------
def priority(srv: RedisServer) -> dict[str, float]:
    """A 20-request high burst behind a running 2,000-request normal one, vs alone."""
    svc, s = 0.2, settings(srv, max_inflight=8)
    r = redis.Redis.from_url(srv.url)
    with worker(s):
        t0 = time.time()
        alone = (
            max(
                x.timings.finished
                for x in wait(r, s, submit(s, reqs(20, svc, "a"), priority="high"), 20)
            )
            - t0
        )
        normal = submit(s, reqs(2000, svc, "n"))
        while r.hlen(Keys(s.namespace).results(normal)) < 40:
            time.sleep(0.05)
        t1 = time.time()
        high = submit(s, reqs(20, svc, "h"), priority="high")
        behind = max(x.timings.finished for x in wait(r, s, high, 20)) - t1
        from prefixq.store import burst_end as bursts

        bursts.cancel(normal, s)
    return {
        "service_s": svc,
        "alone_s": round(alone, 3),
        "behind_normal_s": round(behind, 3),
        "bound_s": round(1.5 * alone + svc, 3),
    }


def equal(srv: RedisServer) -> dict[str, float]:
    """Bursts of 1,000 and 200 submitted 1 s apart: completions of each while both have work."""
    svc, s = 0.05, settings(srv, max_inflight=8)
    r = redis.Redis.from_url(srv.url)
    with worker(s):
        big = submit(s, reqs(1000, svc, "b"))
        time.sleep(1.0)
        t0 = time.time()
        small = submit(s, reqs(200, svc, "s"))
        got = wait(r, s, small, 200)
        start, end = min(x.timings.finished for x in got), max(x.timings.finished for x in got)
        n_big = sum(1 for x in results(r, s, big) if start <= x.timings.finished <= end)
        wait(r, s, big, 1000)
    return {
        "small_done_s": round(end - t0, 2),
        "window_s": round(end - start, 2),
        "big": n_big,
        "small": 200,
        "ratio": round(n_big / 200, 3),
    }


def tenants(srv: RedisServer) -> dict[str, float]:
    """Tenants weighted 3:1, 600 requests each queued: served until the heavier one is done."""
    svc, s = 0.05, settings(srv, max_inflight=8, tenant_weights="gold=3,iron=1")
    r = redis.Redis.from_url(srv.url)
    r.hset(Keys(s.namespace).config, "shards", 1)
    gold = submit(s, reqs(600, svc, "g"), tenant="gold")
    iron = submit(s, reqs(600, svc, "i"), tenant="iron")
    with worker(s):
        end = max(x.timings.finished for x in wait(r, s, gold, 600))
        n_iron = sum(1 for x in results(r, s, iron) if x.timings.finished <= end)
        wait(r, s, iron, 600)
    return {"gold": 600, "iron": n_iron, "ratio": round(600 / n_iron, 3)}


def sharing(srv: RedisServer) -> dict[str, Any]:
    return {"priority": priority(srv), "equal": equal(srv), "tenants": tenants(srv)}


# ---- main ------------------------------------------------------------------------------------
def settings(srv: RedisServer, **overrides: Any) -> Settings:
    return Settings(
        redis_url=srv.url, namespace=f"fair{secrets.token_hex(3)}", shards=1, **overrides
    )


def main() -> int:
    if sys.argv[1:2] == ["worker"]:
        return worker_main(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("all", "overhead", "sharing", "equal"))
    p.add_argument("--reps", type=int, default=3, help="drain runs per case (best kept)")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()
    runs: dict[str, Callable[[RedisServer], Any]] = {
        "overhead": lambda srv: overhead(srv, args.reps),
        "sharing": sharing,
        "equal": equal,
    }
    out: dict[str, Any] = {"python_path": os.environ.get("PYTHONPATH", "")}
    with RedisServer(appendonly=True) as srv:
        for name in ("overhead", "sharing") if args.what == "all" else (args.what,):
            out[name] = runs[name](srv)
            print(json.dumps({name: out[name]}, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
