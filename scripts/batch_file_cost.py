"""What enqueueing a 50,000-request OpenAI batch file costs (issue 22, item 5), with no engine.

Writes an OpenAI batch file (chat lines: a shared document message, then a question; D documents
x Q questions, shuffled), starts a private redis-server, and measures two ways in:

- ``submit``: ``prefixq submit FILE`` (the producer as a process of its own);
- ``serve``: ``prefixq serve``, the official ``openai`` client uploading the file
  (``files.create``) and creating a batch (``batches.create``), until the batch is queued.

For each: the peak RSS of the process (``/usr/bin/time -v``: the producer, or the server), its RSS
once idle before the work (the interpreter and imports), the time from the start (the submit
process started; the upload started) to the first entry in a stream and to the last (entry ids
are Redis's clock in milliseconds), and the total. Nothing reads the streams, so every entry is
still there to be timed::

    python scripts/batch_file_cost.py                       # 50,000 lines, both ways
    python scripts/batch_file_cost.py --lines 5000 --mode submit --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from prefixq.cli.redis_server import RedisServer, free_port
from prefixq.core.keys import Keys

NS = "batchcost"


def write_file(path: Path, lines: int, docs: int, doc_chars: int, seed: int = 0) -> int:
    """An OpenAI chat batch file of ``lines`` requests over ``docs`` documents; its size."""
    rng = random.Random(seed)
    words = [f"w{rng.randrange(10_000)}" for _ in range(5000)]
    texts = []
    for d in range(docs):
        body = " ".join(rng.choice(words) for _ in range(doc_chars // 6))
        texts.append(f"Document {d}.\n{body}"[:doc_chars])
    order = list(range(lines))
    rng.shuffle(order)
    with open(path, "w") as f:
        for i in order:
            d = i % docs
            line = {
                "custom_id": f"req-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "m",
                    "messages": [
                        {"role": "user", "content": texts[d]},
                        {"role": "user", "content": f"Question {i}: what does it say?"},
                    ],
                    "max_tokens": 16,
                },
            }
            f.write(json.dumps(line) + "\n")
    return path.stat().st_size


def stream_times(r: redis.Redis, keys: Keys) -> tuple[float, float, int]:
    """(first, last entry time in epoch s, entries) over every stream of the namespace."""
    first, last, n = float("inf"), 0.0, 0
    for key in r.scan_iter(match=f"{keys.ns}:*", count=1000, _type="stream"):
        head = r.xrange(key, count=1)
        tail = r.xrevrange(key, count=1)
        if not head:
            continue
        n += int(r.xlen(key))
        first = min(first, int(head[0][0].split(b"-")[0]) / 1000)
        last = max(last, int(tail[0][0].split(b"-")[0]) / 1000)
    return first, last, n


def _peak_kib(time_v: str) -> int:
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", time_v)
    return int(m.group(1)) if m else 0


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _env(url: str, ns: str, files: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXQ_")}
    return env | {
        "REDIS_URL": url,
        "PREFIXQ_NAMESPACE": ns,
        "PREFIXQ_SHARDS": "1",
        "PREFIXQ_FILES_DIR": str(files),
        "PREFIXQ_MAX_FILE_BYTES": str(1 << 30),
    }


def measure_submit(url: str, path: Path, files: Path, n: int) -> dict[str, Any]:
    ns = f"{NS}-submit"
    env = _env(url, ns, files)
    probe = subprocess.run(  # the same process doing nothing: interpreter and imports
        ["/usr/bin/time", "-v", sys.executable, "-m", "prefixq", "submit", "--help"],
        env=env,
        capture_output=True,
        text=True,
    )
    t0 = time.time()
    p = subprocess.run(
        ["/usr/bin/time", "-v", sys.executable, "-m", "prefixq", "submit", str(path)],
        env=env,
        capture_output=True,
        text=True,
    )
    t1 = time.time()
    if p.returncode:
        raise SystemExit(f"submit failed: {p.stderr[-3000:]}")
    r = redis.Redis.from_url(url)
    first, last, entries = stream_times(r, Keys(ns))
    assert entries == n, (entries, n)
    return {
        "peak_rss_mib": round(_peak_kib(p.stderr) / 1024, 1),
        "idle_rss_mib": round(_peak_kib(probe.stderr) / 1024, 1),
        "first_entry_s": round(first - t0, 3),
        "last_entry_s": round(last - t0, 3),
        "total_s": round(t1 - t0, 3),
        "entries": entries,
    }


def measure_serve(url: str, path: Path, files: Path, n: int) -> dict[str, Any]:
    ns = f"{NS}-serve"
    port = free_port()
    env = _env(url, ns, files)
    argv = [sys.executable, "-m", "prefixq", "serve", "--port", str(port)]
    with tempfile.TemporaryFile(mode="w+") as out:
        srv = subprocess.Popen(
            ["/usr/bin/time", "-v", *argv], env=env, stdout=out, stderr=subprocess.STDOUT, text=True
        )
        try:
            got = _batch(port, path, srv)
        finally:
            for pid in _children(srv.pid):  # the server under /usr/bin/time
                os.kill(pid, signal.SIGINT)
            srv.wait(30)
        out.seek(0)
        log = out.read()
    r = redis.Redis.from_url(url)
    first, last, entries = stream_times(r, Keys(ns))
    assert got["status"] == "in_progress" and entries == n, (got, entries, log[-2000:])
    t0 = got.pop("t0")
    return {
        "peak_rss_mib": round(_peak_kib(log) / 1024, 1),
        "idle_rss_mib": got.pop("idle_rss_mib"),
        "upload_s": round(got.pop("uploaded") - t0, 3),
        "first_entry_s": round(first - t0, 3),
        "last_entry_s": round(last - t0, 3),
        "queued_s": round(got.pop("queued") - t0, 3),
        "entries": entries,
    }


def _children(pid: int) -> list[int]:
    p = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
    return [int(x) for x in p.stdout.split()]


def _batch(port: int, path: Path, srv: subprocess.Popen[str]) -> dict[str, Any]:
    """Upload ``path`` and create a batch of it with the official client, until it is queued."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="local", max_retries=0)
    deadline = time.monotonic() + 60
    while True:
        try:
            client.files.list()
            break
        except Exception:
            if time.monotonic() > deadline or srv.poll() is not None:
                raise
            time.sleep(0.2)
    idle = sum(_rss_kib(pid) for pid in _children(srv.pid))
    t0 = time.time()
    with open(path, "rb") as f:
        up = client.files.create(file=f, purpose="batch")
    uploaded = time.time()
    batch = client.batches.create(
        input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    while (batch := client.batches.retrieve(batch.id)).status == "validating":
        time.sleep(0.05)
    return {
        "t0": t0,
        "uploaded": uploaded,
        "queued": time.time(),
        "status": batch.status,
        "idle_rss_mib": round(idle / 1024, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lines", type=int, default=50_000)
    ap.add_argument("--docs", type=int, default=1000)
    ap.add_argument("--doc-chars", type=int, default=2000)
    ap.add_argument("--mode", choices=("submit", "serve", "both"), default="both")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="batchcost-") as tmp, RedisServer() as srv:
        path = Path(tmp) / "batch.jsonl"
        size = write_file(path, a.lines, a.docs, a.doc_chars)
        report: dict[str, Any] = {
            "lines": a.lines,
            "documents": a.docs,
            "file_mib": round(size / (1 << 20), 1),
        }
        if a.mode in ("submit", "both"):
            report["submit"] = measure_submit(srv.url, path, Path(tmp) / "files", a.lines)
        if a.mode in ("serve", "both"):
            report["serve"] = measure_serve(srv.url, path, Path(tmp) / "files", a.lines)
    print(json.dumps(report, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
