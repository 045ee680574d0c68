"""The elastic fleet's two CPU cases (issue 31's targets; docs/BENCHMARKS.md), on real `prefixq
worker` processes with the embedded model and a private redis-server:

- ``lost``: 2 shards, 2 workers (one core each), a burst of 120 requests over 24 documents; at 25
  results worker 1 and its engine are killed -9 and not restarted. Reports whether the burst ends
  by itself with every result once, the time from the kill to the last result, and what that is
  made of: ``orphan_after_s``, and the time worker 0 needs for the moved requests at the rate it
  served before the kill (the target: kill -> last <= that + ``orphan_after_s`` + 10 s).
- ``join``: one shard, one worker (``--max-inflight 2``: a slow GPU), a burst of 240 requests over
  48 documents, and a second worker started with ``--join`` after 10 results; against the same
  burst on the one worker alone (a fresh namespace and worker, the same settings). Reports the
  joiner's share of the burst and both bursts' times (the targets: >= 25%, and sooner).

    python scripts/fleet_cpu.py [--cases lost,join] [--orphan-after-s 15] [--json FILE]

Times are wall-clock on whatever machine runs it: run it alone (2 cores: each engine on one).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from prefixq.cli.redis_server import RedisServer
from prefixq.client import Producer
from prefixq.core.settings import Settings
from prefixq.ops import stats

TTL_S = 3.0


def burst(docs: int, per_doc: int, max_tokens: int = 8) -> list[dict[str, Any]]:
    out = []
    for d in range(docs):
        sections = " ".join(f"Section {d}.{i} says item {i * d} holds." for i in range(40))
        for q in range(per_doc):
            out.append(
                {
                    "id": f"d{d}-q{q}",
                    "prefix": f"Report {d}. {sections}",
                    "prompt": f"Question {q}: what does section {d}.{q} say?",
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                    "ignore_eos": True,
                }
            )
    return out


class Fleet:
    """The worker processes of one case, all stopped (process groups killed) at the end."""

    def __init__(self, s: Settings, logs: Path, orphan_after_s: float) -> None:
        self.s, self.logs, self.orphan = s, logs, orphan_after_s
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, core: int, *extra: str) -> subprocess.Popen[bytes]:
        s = self.s
        cmd = [
            sys.executable, "-m", "prefixq", "worker", "--name", name, "--redis-url", s.redis_url,
            "--namespace", s.namespace, "--shards", str(s.shards), "--heartbeat-s", "0.5",
            "--heartbeat-ttl-s", str(TTL_S), "--orphan-after-s", str(self.orphan), *extra,
        ]  # fmt: skip
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(core), "PYTHONUNBUFFERED": "1"}
        with open(self.logs / f"{name}.log", "wb") as out:
            p = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.procs.append(p)
        return p

    def wait_up(self, r: redis.Redis, names: list[str], timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            up = 0
            for k in range(self.s.shards):
                for n in names:
                    up += r.hget(self.s.keys.heartbeat(k, n), "engine_up") == b"1"
            if up >= len(names):
                return
            time.sleep(0.5)
        raise RuntimeError(f"workers {names} not up after {timeout}s (logs in {self.logs})")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def results(r: redis.Redis, s: Settings, burst_id: str) -> int:
    return int(r.hlen(s.keys.results(burst_id)))


def wait_results(r: redis.Redis, s: Settings, b: str, n: int, timeout: float) -> float:
    """Wait until ``n`` results; the monotonic time it happened."""
    deadline = time.monotonic() + timeout
    while results(r, s, b) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{results(r, s, b)}/{n} results after {timeout}s")
        time.sleep(0.1)
    return time.monotonic()


def settings(url: str, shards: int) -> Settings:
    return Settings(
        redis_url=url, namespace=f"fleet{os.urandom(3).hex()}", shards=shards, heartbeat_s=0.5
    )


def case_lost(url: str, r: redis.Redis, logs: Path, orphan: float) -> dict[str, Any]:
    s = settings(url, 2)
    fleet = Fleet(s, logs, orphan)
    try:
        fleet.start("lost-a", 0, "--shard", "0")
        victim = fleet.start("lost-b", 1, "--shard", "1")
        fleet.wait_up(r, ["lost-a", "lost-b"])
        b = Producer(s).submit(burst(24, 5))
        t0 = time.monotonic()
        wait_results(r, s, b.id, 25, 600)
        before = time.monotonic() - t0
        on_zero_before = sum(1 for x in b.collect() if x.shard == 0)
        os.killpg(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        end = wait_results(r, s, b.id, 120, 900)
        st = b.wait(timeout=60)
        moved = sum(
            int(f[b"requests"]) for _, f in r.xrange(s.keys.moves) if f.get(b"why") == b"orphaned"
        )
        rate0 = on_zero_before / before if before else 0.0
        need = moved / rate0 if rate0 else float("nan")
        return {
            "requests": 120,
            "done": st.done,
            "failed": st.failed,
            "results": results(r, s, b.id),
            "orphan_after_s": orphan,
            "moved_requests": moved,
            "worker0_rate_before_kill": round(rate0, 3),
            "moved_work_at_that_rate_s": round(need, 1),
            "kill_to_last_result_s": round(end - killed, 1),
            "target_s": round(need + orphan + 10, 1),
            "met": end - killed <= need + orphan + 10 and st.done == 120,
        }
    finally:
        fleet.close()


def case_join(url: str, r: redis.Redis, logs: Path, orphan: float) -> dict[str, Any]:
    reqs = burst(48, 5)
    slow = ["--max-inflight", "2"]
    out: dict[str, Any] = {"requests": len(reqs)}
    for mode in ("alone", "join"):
        s = settings(url, 1)
        fleet = Fleet(s, logs, orphan)
        try:
            fleet.start(f"{mode}-a", 0, "--shard", "0", *slow)
            fleet.wait_up(r, [f"{mode}-a"])
            b = Producer(s).submit(reqs)
            t0 = time.monotonic()
            if mode == "join":
                wait_results(r, s, b.id, 10, 600)
                fleet.start(f"{mode}-b", 1, "--join", "--steal-min-tokens", "512")
            end = wait_results(r, s, b.id, len(reqs), 1800)
            st = b.wait(timeout=60)
            out[mode] = {
                "burst_s": round(end - t0, 1),
                "done": st.done,
                "by_worker": stats.burst_stats(r, s, b.id)["workers"],
            }
        finally:
            fleet.close()
    share = out["join"]["by_worker"].get("join-b", 0) / len(reqs)
    out["joiner_share"] = round(share, 3)
    out["met"] = share >= 0.25 and out["join"]["burst_s"] < out["alone"]["burst_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="lost,join")
    p.add_argument("--orphan-after-s", type=float, default=15.0)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="prefixq-fleet-"))
    report: dict[str, Any] = {"logs": str(logs)}
    with RedisServer() as srv:
        r = redis.Redis.from_url(srv.url)
        for case in a.cases.split(","):
            fn = {"lost": case_lost, "join": case_join}[case]
            report[case] = fn(srv.url, r, logs, a.orphan_after_s)
            print(case, json.dumps(report[case]), flush=True)
    if a.json:
        a.json.write_text(json.dumps(report, indent=2))
    return 0 if all(report[c]["met"] for c in a.cases.split(",")) else 1


if __name__ == "__main__":
    sys.exit(main())
