"""The worker's idle-time collections on a real vLLM CPU worker (worker/gc_policy.py).

A private redis-server, one ``prefixq worker`` on the embedded model, and ``--bursts`` bursts of
``--requests`` short questions over 8 documents, each followed by ``--idle-s`` seconds with
nothing in flight (long enough for the whole-heap step, which waits for 3 s of idleness). It
prints the worker's idle collections as its debug log records them (which step, objects freed,
milliseconds: the whole heap is one call that a burst arriving meanwhile waits for) and the
policy's figures from the control stream's ``stats``.

    python scripts/idle_gc.py [--bursts 5] [--requests 500] [--idle-s 6]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aredis

from prefixq import Producer, Settings
from prefixq.cli.redis_server import RedisServer
from prefixq.worker import control

_IDLE = re.compile(r"idle: (.*)$")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bursts", type=int, default=5)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--idle-s", type=float, default=6.0)
    a = ap.parse_args()
    with RedisServer() as srv, tempfile.TemporaryDirectory(prefix="idle-gc-") as tmp:
        log = Path(tmp) / "worker.log"
        cmd = [sys.executable, "-m", "prefixq", "worker", "--shard", "0", "--shards", "1"]
        cmd += ["--redis-url", srv.url, "--name", "gc", "--log-level", "DEBUG"]
        cmd += ["--engine-arg", "max_model_len=1024"]
        with open(log, "wb") as out:
            worker = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            t0 = time.monotonic()
            while "serving" not in log.read_text(errors="replace"):
                if worker.poll() is not None:
                    print(log.read_text(errors="replace")[-3000:], file=sys.stderr)
                    return 1
                time.sleep(1)
            print(f"worker up after {time.monotonic() - t0:.0f}s", flush=True)
            stats = asyncio.run(_bursts(a, Settings(redis_url=srv.url, shards=1)))
        finally:
            worker.terminate()
            worker.wait(120)
        for line in log.read_text(errors="replace").splitlines():
            m = _IDLE.search(line)
            if m and "gc_policy" in line:
                print("  " + m.group(1))
    for k in sorted(k for k in stats if k.startswith(("gc_idle", "gc_whole", "gc_heap"))):
        print(f"{k} = {stats[k]}")
    return 0


async def _bursts(a: argparse.Namespace, s: Settings) -> dict[str, Any]:
    """Run the bursts, each followed by ``--idle-s`` idle; the worker's stats afterwards."""
    t0 = time.monotonic()
    docs = [f"Document {d}. " + " ".join(f"w{d}_{i}" for i in range(150)) for d in range(8)]
    for b in range(a.bursts):
        reqs = [
            {"id": f"b{b}q{i}", "prefix": docs[i % 8], "prompt": f"\nQ{i}: why?", "max_tokens": 4}
            for i in range(a.requests)
        ]
        burst = await Producer(s).asubmit(reqs)
        await burst.await_(timeout=1800)
        await asyncio.sleep(a.idle_s)
        print(f"burst {b + 1}/{a.bursts} done at {time.monotonic() - t0:.0f}s", flush=True)
    r = aredis.Redis.from_url(s.redis_url)
    try:
        return (await control.send(r, s.keys, "stats", ["gc"], wait_s=30))["gc"]
    finally:
        await r.aclose()


if __name__ == "__main__":
    sys.exit(main())
