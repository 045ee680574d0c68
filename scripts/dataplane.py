"""What the data plane costs per request, with a zero-cost engine (prefixq.bench.null_engine).

A private redis-server, S `Worker` processes over `NullEngine` (the real worker loop: read,
decode, schedule, record, ack), and the real `Producer` in this process. Per workload and shard
count, each of ``--repeats`` bursts reports, per request: the producer's process CPU time (of
its `asubmit`), each worker process's CPU time (/proc, from before the submit until the burst is
done), Redis's (INFO cpu deltas) and the drain rate (requests / seconds from the submit's start
to the burst's end), and each worker's GC pauses over the burst (the control stream's stats);
the median of the repeats is printed. CPU time, not wall time: the machine may be shared.

    python scripts/dataplane.py [--shards 1,3] [--workloads short,16kb,docs16kb,reuse64,reuse160]
        [--requests 20000] [--long-requests 5000] [--repeats 3] [--hold-ms 0] [--json FILE]

Workloads: ``short`` (``--requests`` prompts of ~40 characters), ``16kb`` (``--long-requests``
distinct 16 KB prompts), ``docs16kb`` (``--long-requests`` / 4 distinct 16 KB documents, each the
shared ``prefix`` of 4 short questions, stored once), ``reuseD`` (the benchmark's reuse burst: D
documents of 4,000 tokens x 4 questions). ``--hold-ms`` keeps each request inside the engine
that long (a real engine holds requests in flight; the GC figures depend on it).
``python scripts/dataplane.py worker --shard K [--hold-ms H] [settings flags]`` is one worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from prefixq.bench.null_engine import NullEngine
from prefixq.bench.workloads import Shape, Sizes, build
from prefixq.cli.main import _settings_parser, settings_from
from prefixq.cli.redis_server import RedisServer
from prefixq.client import Producer
from prefixq.core.settings import Settings
from prefixq.store.connection import async_client
from prefixq.worker import control

TICK = os.sysconf("SC_CLK_TCK")
WORDS = ("the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by")


def worker(argv: list[str]) -> int:
    from prefixq.cli.worker_signals import WorkerSignals
    from prefixq.integrations.rq_callbacks import RqCompletion
    from prefixq.worker.worker import Worker

    signals = WorkerSignals().install()
    p = argparse.ArgumentParser(parents=[_settings_parser()])
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--name", default="")
    p.add_argument("--hold-ms", type=float, default=0.0)
    p.add_argument("--profile", default="", help="write a cProfile of the run here")
    p.add_argument("--gc-trace", action="store_true", help="log what older collections visit")
    args = p.parse_args(argv)
    s = settings_from(args)
    if args.gc_trace:
        gc_trace()

    async def main() -> int:
        engine = NullEngine(hold_s=args.hold_ms / 1000)
        w = Worker(s, args.shard, engine, name=args.name, middleware=[RqCompletion(s)])
        signals.serve(w, asyncio.get_running_loop())
        return await w.run()

    if not args.profile:
        return asyncio.run(main())
    import cProfile

    prof = cProfile.Profile()
    try:
        return prof.runcall(asyncio.run, main())
    finally:
        prof.dump_stats(args.profile)


def gc_trace() -> None:
    """Print, for every collection of generation 1 or 2 that is not frozen away, its duration
    and the most common types among the objects of the generations it collects."""
    import collections
    import gc

    t0 = [0.0, 0.0]
    seen = [""]

    def cb(phase: str, info: dict[str, Any]) -> None:
        g = info["generation"]
        if phase == "start":
            objs = [o for k in range(g + 1) for o in gc.get_objects(k)]
            by = collections.Counter(type(o).__name__ for o in objs)
            size = collections.Counter()
            for o in objs:
                if isinstance(o, list | dict | tuple):
                    size[type(o).__name__] += len(o)
            seen[0] = f"{len(objs)} objects {by.most_common(10)} items {dict(size)}"
            t0[0], t0[1] = time.perf_counter(), time.thread_time()
        else:
            wall, cpu = time.perf_counter() - t0[0], time.thread_time() - t0[1]
            if wall > 0.001:
                print(f"gc gen {g}: {wall * 1e3:.2f} ms wall {cpu * 1e3:.2f} ms cpu {info}; "
                      f"{seen[0]}", flush=True)  # fmt: skip

    gc.callbacks.append(cb)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


async def redis_cpu_s(r: Any) -> float:
    info = await r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def requests_of(workload: str, args: argparse.Namespace, rep: int) -> list[dict[str, Any]]:
    """The burst of ``workload`` (fresh texts every repeat, so no prefix is reused across)."""
    rng = random.Random(f"{workload}-{rep}")
    if workload == "short":
        return [
            {"id": f"r{i}", "prompt": f"Question {rep}-{i}: what is {rng.randrange(10**6)}?",
             "max_tokens": 1}
            for i in range(args.requests)
        ]  # fmt: skip
    if workload == "16kb":
        out = []
        for i in range(args.long_requests):
            words = [f"{rep}-{i}", *rng.choices(WORDS, k=3300)]
            out.append({"id": f"r{i}", "prompt": " ".join(words)[:16384], "max_tokens": 1})
        return out
    if workload == "docs16kb":  # 16 KB documents (the shared prefix), 4 questions about each
        out = []
        for d in range(args.long_requests // 4):
            words = [f"{rep}-{d}", *rng.choices(WORDS, k=3300)]
            doc = " ".join(words)[:16384]
            out += [
                {"id": f"r{d}-{q}", "prefix": doc, "max_tokens": 1,
                 "prompt": f"\n\nQuestion {q}: what is {rng.randrange(10**6)}?\nAnswer:"}
                for q in range(4)
            ]  # fmt: skip
        return out
    if workload.startswith("reuse"):
        docs = int(workload[5:])
        shape = Shape(doc_tokens=4000, token_ids=True, vocab=128_256)  # as the GPU benchmark's
        wl = build("reuse", shape, Sizes(documents=docs, questions=4), seed=rep)
        return wl.requests
    raise SystemExit(f"unknown workload {workload!r}")


class Deployment:
    def __init__(
        self, shards: int, hold_ms: float, logdir: Path, profile: str, gc_trace: bool
    ) -> None:
        self.srv = RedisServer().start()
        self.s = Settings(redis_url=self.srv.url, namespace="dp", shards=shards)
        self.names = [f"dp-s{k}" for k in range(shards)]
        self.procs: list[subprocess.Popen[bytes]] = []
        for k in range(shards):
            cmd = [sys.executable, __file__, "worker", "--shard", str(k), "--name", self.names[k],
                   "--redis-url", self.srv.url, "--namespace", "dp", "--shards", str(shards),
                   "--hold-ms", str(hold_ms)]  # fmt: skip
            if gc_trace:
                cmd.append("--gc-trace")
            if profile:
                cmd += ["--profile", f"{profile}-s{k}.prof"]
            with open(logdir / f"worker-{shards}-{k}.log", "wb") as log:
                self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))

    async def up(self, r: Any) -> None:
        deadline = time.monotonic() + 60
        for k, name in enumerate(self.names):
            while await r.hget(self.s.keys.heartbeat(k, name), "engine_up") != b"1":
                if self.procs[k].poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"worker {k} did not come up")
                await asyncio.sleep(0.1)

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(30)
        self.srv.stop()


async def one(
    dep: Deployment, r: Any, producer: Producer, reqs: list[dict[str, Any]]
) -> dict[str, Any]:
    await control.send(r, dep.s.keys, "reset_stats", dep.names)
    pids = [p.pid for p in dep.procs]
    w0 = [cpu_s(p) for p in pids]
    await r.config_resetstat()
    r0 = await redis_cpu_s(r)
    t0 = time.perf_counter()
    c0 = time.process_time()
    burst = await producer.asubmit(reqs)
    c1 = time.process_time()
    st = await burst.await_(timeout=600)
    t1 = time.perf_counter()
    await asyncio.sleep(0.3)  # the last acks after the last result
    w1 = [cpu_s(p) for p in pids]
    r1 = await redis_cpu_s(r)
    commands = await r.info("commandstats")
    stats = await control.send(r, dep.s.keys, "stats", dep.names)
    n = len(reqs)
    # where Redis's time went: the commands (scripts' inner calls included) by µs per request
    by_usec = sorted(commands.items(), key=lambda kv: -float(kv[1]["usec"]))[:8]
    if st.done != n or st.failed:
        raise SystemExit(f"burst {burst}: {st.done} done, {st.failed} failed of {n}")
    return {
        "producer_us": (c1 - c0) / n * 1e6,
        "worker_us": [(b - a) / n * 1e6 for a, b in zip(w0, w1, strict=True)],
        "worker_total_us": (sum(w1) - sum(w0)) / n * 1e6,
        "redis_us": (r1 - r0) / n * 1e6,
        "drain_rps": n / (t1 - t0),
        "gc_max_pause_ms": [stats[x]["gc_max_pause_ms"] for x in dep.names],
        "gc_max_pause_cpu_ms": [stats[x].get("gc_max_pause_cpu_ms", -1.0) for x in dep.names],
        "gc_max_pause_ms_by_gen": [stats[x]["gc_max_pause_ms_by_gen"] for x in dep.names],
        "gc_pauses_by_gen": [stats[x]["gc_pauses_by_gen"] for x in dep.names],
        "gc_idle_max_ms": [stats[x]["gc_idle_max_ms"] for x in dep.names],
        "redis_commands_us": {
            k.removeprefix("cmdstat_"): round(float(v["usec"]) / n, 2) for k, v in by_usec
        },
    }


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    med = {
        k: round(statistics.median(x[k] for x in runs), 1)
        for k in ("producer_us", "worker_total_us", "redis_us", "drain_rps")
    }
    med["gc_max_pause_ms"] = max(max(x["gc_max_pause_ms"]) for x in runs)
    med["gc_max_pause_cpu_ms"] = max(max(x["gc_max_pause_cpu_ms"]) for x in runs)
    return med


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    logdir = Path(args.logdir)
    for shards in [int(x) for x in args.shards.split(",")]:
        dep = Deployment(shards, args.hold_ms, logdir, args.profile, args.gc_trace)
        r = async_client(dep.s)
        try:
            await dep.up(r)
            async with Producer(dep.s) as producer:
                warm = [{"id": f"w{i}", "prompt": f"warm {i}", "max_tokens": 1} for i in range(500)]
                await (await producer.asubmit(warm)).await_(timeout=120)
                for wl in args.workloads.split(","):
                    runs = []
                    for rep in range(args.repeats):
                        reqs = requests_of(wl, args, rep)
                        runs.append(await one(dep, r, producer, reqs))
                        print(f"{shards} shard(s) {wl} #{rep}: {json.dumps(runs[-1])}", flush=True)
                    med = median_of(runs)
                    out[f"{wl}/{shards}"] = {"median": med, "runs": runs}
                    print(f"== {shards} shard(s) {wl} (n={len(reqs)}): {med}", flush=True)
        finally:
            await r.aclose()
            dep.close()
    return out


def main() -> None:
    if sys.argv[1:2] == ["worker"]:
        sys.exit(worker(sys.argv[2:]))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shards", default="1,3")
    p.add_argument("--workloads", default="short,16kb")
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--long-requests", type=int, default=5_000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hold-ms", type=float, default=0.0)
    p.add_argument("--profile", default="", help="cProfile each worker into PREFIX-sK.prof")
    p.add_argument("--gc-trace", action="store_true", help="workers log their older collections")
    p.add_argument("--logdir", default="/tmp/prefixq-dataplane")
    p.add_argument("--json", default="")
    args = p.parse_args()
    Path(args.logdir).mkdir(parents=True, exist_ok=True)
    out = asyncio.run(measure(args))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
