"""prefixq's chaos soak: many requests under a seeded schedule of faults; nothing lost, doubled
or given to another request.

    python scripts/soak.py                      # the short form (tests/test_soak.py runs it)
    python scripts/soak.py --requests 20000 --faults 60 --duration 420    # the long form
    python scripts/soak.py --seed 7             # a schedule again (every run prints its seed)
    python scripts/soak.py --self-check         # damages results before the accounting: exit 1
    python scripts/soak.py --cluster --shards 4  # on a 6-node Redis Cluster, with master failovers

It starts a redis-server with its AOF at ``appendfsync everysec`` and ``--shards`` shards of
fake-engine worker processes (tests/fault_worker.py: the real worker loop over
tests/fake_engine.py), submits ``--requests`` requests in bursts (scripts/soaklib/workload.py:
API and CLI submits, shared prefixes, chats, token ids, mixed priorities and tenants, deadlines)
over the first part of ``--duration`` seconds, and meanwhile injects faults drawn from a seeded
schedule (scripts/soaklib/faults.py and, for a worker lost for good, one that joins and one that
drains and leaves, scripts/soaklib/fleet_faults.py say each kind and how it is seen to land)
until at least
``--faults`` have landed. Then it restores the deployment, waits for every burst to end, and
reads every result back through the public API (scripts/soaklib/accounting.py): a request with
no result is lost, one with two is duplicated, a result whose id was not submitted for its index
is a phantom, a successful answer that is not its request's is misanswered. A failed submit's
report of how many of its requests were enqueued is checked against the requests workers then
recorded (misreported). It prints one summary line (and ``--json`` writes the details); it
exits 0 only if nothing was lost, duplicated, phantom, misanswered or misreported, no worker
logged a traceback, every stop kept its bound, and at least ``--faults`` faults landed.

``--cluster`` runs it on a Redis Cluster of 6 redis-server processes (3 masters, 3 replicas; the
launcher of tests/redis_cluster.py) with ``min_replicas_acked=1`` for every process, and adds
the ``master_failover`` fault (a master killed -9, its replica promoted, the node restarted as a
replica); faults that need one killable or memory-capped server are not drawn there. Its summary
line says ``failovers injected: N``.

``--self-check`` breaks a few results of one burst in Redis before the accounting
(accounting.damage): the run must then fail (tests/test_soak.py checks that it does).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from prefixq import Burst
from prefixq.core.errors import BurstNotFound, PrefixqError
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.store.deployment import resolve_shards
from soaklib import accounting, faults
from soaklib.deployment import ENV, PY, ROOT, ClusterNodes, Redis, SingleNode, Workers, backlog
from soaklib.fleet_faults import FLEET_FAULTS
from soaklib.run import Landed
from soaklib.workload import Plan, Planned

#: every kind of fault the soak knows
ALL_FAULTS = {**faults.FAULTS, **FLEET_FAULTS}
#: failed submits of one burst's requests tried again under a new id, at most
RETRIES = 2
_REPORTED = re.compile(r"(\d+) of its (\d+) requests")
_BOUNDS = re.compile(r"at least (\d+) and at most (\d+) of its (\d+) requests")


class Soak:
    """One run: the deployment, the plan, the faults, what was seen."""

    def __init__(self, args: argparse.Namespace, redis_: Redis, folder: Path) -> None:
        self.args, self.redis, self.folder = args, redis_, folder
        self.t0 = time.monotonic()
        self.rng = random.Random(args.seed)  # the fault schedule's
        self.feed_rng = random.Random(args.seed + 2)  # the submitter thread's
        self.settings = Settings(
            redis_url=redis_.url,
            namespace=f"soak{args.seed}",
            shards=args.shards,
            heartbeat_s=0.5,
            heartbeat_ttl_s=3.0,
            claim_idle_s=3.0,
            grace_s=3.0,
            # a lost worker's queue moves within seconds (fleet_faults.py), but not before the
            # `reclaim` fault's hand reclaim, once the heartbeat's TTL has passed, could take it
            # (at 3.0, the TTL, the move always came first: that fault never landed)
            orphan_after_s=6.0,
            max_attempts=6,
            max_inflight=4,  # with the workload's pace: work in flight most of the time
            tenant_weights="ta=3,tb=1",
            # a cluster's failovers lose nothing acknowledged only with it (docs/delivery.md)
            min_replicas_acked=1 if "failover" in redis_.capabilities else 0,
        )
        self.keys = Keys(self.settings.namespace)
        self.r = redis_.client()
        self.workers = Workers(self.settings, folder / "logs")
        span = 0.8 * args.duration
        self.plan = Plan(random.Random(args.seed + 1), f"s{args.seed}", args.requests, span)
        self.launched: list[Planned] = []
        self.extra = 0
        self._topping = False  # a top-up burst's submit is under way (`top_up`)
        self.landed: list[Landed] = []
        self.problems: list[str] = []
        self.notes: list[str] = []
        self._lock = threading.Lock()
        self._running: list[tuple[Planned, subprocess.Popen[bytes]]] = []
        #: observations made once the run has drained: (look, what it was)
        self._later: list[tuple[Callable[[], Landed | None], str]] = []

    # ---- what faults use ---------------------------------------------------------------------
    def say(self, what: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {what}", flush=True)

    def problem(self, what: str) -> None:
        self.problems.append(what)
        self.say(f"PROBLEM: {what}")

    def note(self, what: str) -> None:
        self.notes.append(what)
        self.say(f"note: {what}")

    def later(self, look: Callable[[], Landed | None], what: str) -> None:
        """Observe a fault's landing once the run has drained (``look`` returns it, or None)."""
        self._later.append((look, what))

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``prefixq ARGS`` against the soak's namespace."""
        flags = ["--redis-url", self.settings.redis_url, "--namespace", self.settings.namespace]
        return subprocess.run(
            [PY, "-m", "prefixq", *args, *flags],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=ROOT,
            env=ENV,
        )

    def created_bursts(self) -> list[str]:
        with self._lock:
            return [b.burst_id for b in self.launched]

    def extra_burst(self, size: int) -> Planned:
        """A burst outside the plan (a submit to kill)."""
        self.extra += 1
        return self.plan.burst(size, 0.0, no=900 + self.extra)

    def launch(self, b: Planned) -> subprocess.Popen[bytes]:
        """Start ``b``'s submit process (``prefixq submit`` or the Python API)."""
        path = b.write(self.folder / "in")
        s = self.settings
        if b.via == "cli":
            cmd = [PY, "-m", "prefixq", "submit", str(path), "--burst-id", b.burst_id]
            cmd += ["--priority", b.priority, "--tenant", b.tenant]
            cmd += ["--redis-url", s.redis_url, "--namespace", s.namespace]
        else:
            deadline = "-" if b.deadline_in is None else repr(time.time() + b.deadline_in)
            cmd = [PY, str(ROOT / "scripts" / "soaklib" / "submit.py"), str(path), b.burst_id]
            cmd += [b.priority, b.tenant, deadline, s.redis_url, s.namespace]
        err = open(self.folder / "in" / f"{b.burst_id}.err", "wb")  # noqa: SIM115
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT, env=ENV)
        err.close()
        with self._lock:
            self.launched.append(b)
        return proc

    def settle_submit(self, b: Planned, proc: subprocess.Popen[bytes]) -> Planned | None:
        """Note how ``b``'s submit ended; after a failure, end its burst if it was created and
        its submit could not (``prefixq cancel``), and return the resubmission to launch."""
        b.rc = proc.wait()
        b.error = (self.folder / "in" / f"{b.burst_id}.err").read_text(errors="replace").strip()
        if b.rc == 0 or b.killed:
            return None
        self.say(f"submit of {b.burst_id} failed (exit {b.rc}): {b.error[-200:]}")
        if "could not be cancelled" in b.error or "run `prefixq cancel" in b.error:
            self._cancel_when_up(b.burst_id)
        return self.plan.resubmission(b) if b.attempt < RETRIES else None

    def _cancel_when_up(self, burst: str) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            p = self.cli("cancel", burst, "--json")
            if p.returncode == 0 or "no burst" in p.stderr:
                return
            time.sleep(1.0)
        self.problem(f"could not cancel the half-submitted burst {burst}: {p.stderr[-300:]}")

    # ---- the run -----------------------------------------------------------------------------
    def submitter(self) -> None:
        """Launch the plan's bursts at their times; settle each submit; launch resubmissions."""
        queue = sorted(self.plan.bursts, key=lambda b: b.at)
        later: list[tuple[float, Planned]] = []
        while queue or later or self._running:
            now = time.monotonic() - self.t0
            while queue and queue[0].at <= now:
                b = queue.pop(0)
                self._running.append((b, self.launch(b)))
            for t, b in [x for x in later if x[0] <= now]:
                later.remove((t, b))
                self._running.append((b, self.launch(b)))
            for b, proc in [x for x in self._running if x[1].poll() is not None]:
                self._running.remove((b, proc))
                again = self.settle_submit(b, proc)
                if again is not None:
                    later.append((now + self.feed_rng.uniform(1.0, 3.0), again))
            time.sleep(0.05)

    def run(self) -> dict[str, Any]:
        s = self.settings
        self.say(
            f"seed {self.args.seed}: {self.args.requests} requests in "
            f"{len(self.plan.bursts)} bursts over {s.shards} shards, >= {self.args.faults} "
            f"faults, {self.args.duration:.0f}s schedule (again: --seed {self.args.seed})"
        )
        for k in range(s.shards):
            w = self.workers.start(k)
            if not self.workers.wait_serving(w, self.r, 60):
                raise RuntimeError(f"worker {w.name} did not start:\n{w.log.read_text()[-2000:]}")
        feeder = threading.Thread(target=self.submitter, name="submitter", daemon=True)
        feeder.start()
        self.inject()
        feeder.join()
        self.say("schedule over: restoring the deployment, waiting for every burst to end")
        self.restore()
        self.finish()
        for look, what in self._later:
            got = look()
            if got is None:
                self.note(f"{what}: never seen to land")
            else:
                self.landed.append(got)
                self.say(f"fault {got.kind}: {got.how}")
        damaged = self.damage() if self.args.self_check else []
        tally = self.account()
        self.workers.close()
        return self.summary(tally, damaged)

    def inject(self) -> None:
        """Fault attempts at seeded times over 90% of the schedule (twice ``--faults`` of them:
        some find nothing to hit): every kind the deployment supports first, in a seeded order
        (a kind that did not land is drawn again), then kinds drawn by weight; it stops once a
        fifth more than ``--faults`` have landed, every kind among them. If fewer than
        ``--faults`` have landed, or a kind has not, when the schedule ends, more follow, for at
        most twice as long again (a loaded machine runs the bursts slower, and a fault needs work in
        flight to land: 19 of 20 landed in as long again, once, on a full test run)."""
        a = self.args
        kinds = {k: f() for k, f in ALL_FAULTS.items()}
        kinds = {k: f for k, f in kinds.items() if f.needs <= self.redis.capabilities}
        wanted = [k for k in a.only.split(",") if k] if a.only else []
        if wanted:
            kinds = {k: f for k, f in kinds.items() if k in wanted}
        unseen = sorted(kinds)
        self.rng.shuffle(unseen)
        times = sorted(self.rng.uniform(2.0, 0.9 * a.duration) for _ in range(2 * a.faults))
        end = 3.0 * a.duration
        missed = False  # the last attempt was of a kind yet to land, and it found nothing
        while True:
            now = time.monotonic() - self.t0
            enough = len(self.landed) >= a.faults and not unseen
            if enough and (len(self.landed) >= 1.2 * a.faults or not times):
                return
            if not times:
                if now > end:
                    return
                self.top_up()
                times.append(now + self.rng.uniform(0.5, 2.0))
            at = times.pop(0)
            time.sleep(max(0.0, at - (time.monotonic() - self.t0)))
            # a kind yet to land goes first, but not twice in a row when it found nothing to hit:
            # one that could not land for a long while (reclaim, on an idle deployment) was drawn
            # at every attempt, and no other fault landed meanwhile (a run ended at 19 of 20)
            if unseen and not missed:
                fault = kinds[unseen.pop(0)]
            else:
                fault = faults.draw(self.rng, kinds, self.redis.capabilities)
            try:
                got = fault.run(self)
            except (
                redis.RedisError,
                OSError,
                PrefixqError,
                ValueError,
                subprocess.SubprocessError,
            ) as e:
                self.note(f"{fault.kind} failed to inject: {type(e).__name__}: {e}")
                got = []
            for x in got:
                self.landed.append(x)
                self.say(f"fault {x.kind}: {x.how}")
            missed = False
            if fault.kind not in {x.kind for x in got}:
                self.say(f"({fault.kind}: nothing to hit, not counted)")
                if fault.kind not in unseen and fault.kind not in self.kinds_landed():
                    unseen.append(fault.kind)  # drawn again later
                    missed = True

    def top_up(self) -> None:
        """With faults still owed after the planned ones, and no burst left unfinished, submit
        one more (most faults need work in flight to land: with the plan drained they found
        nothing to hit, draw after draw, and the run ended one fault short)."""
        if faults.unfinished(self) or self._topping:
            return
        b = self.extra_burst(self.rng.randint(300, 800))
        self.say(f"faults still owed and nothing in flight: one more burst, {b.burst_id}")
        self._topping = True

        def settle(b: Planned | None) -> None:
            while b is not None:
                b = self.settle_submit(b, self.launch(b))
            self._topping = False

        threading.Thread(target=settle, args=(b,), name="top-up", daemon=True).start()

    def kinds_landed(self) -> set[str]:
        return {x.kind for x in self.landed}

    def restore(self) -> None:
        """Redis up (every node, each master replicated), no memory limit, a live primary
        worker on every shard."""
        caps = self.redis.capabilities
        if "failover" in caps:
            self.redis.start()
        else:
            try:
                self.r.ping()
            except redis.ConnectionError:
                self.redis.start()
        if "maxmemory" in caps:
            self.r.config_set("maxmemory", 0)
        for k in range(resolve_shards(self.r, self.settings)):  # joins may have grown it
            w = self.workers.primary(k) or self.workers.start(k)
            if not self.workers.wait_serving(w, self.r, 60):
                self.problem(f"worker {w.name} did not serve after the schedule")

    def finish(self) -> None:
        """Until every created burst has a result per request (reclaiming by hand now and then,
        as an operator would), or ``--drain-s`` pass without a new result (or four times that in
        all): a long form's backlog at the schedule's end can take longer than ``--drain-s`` to
        serve while results keep coming (4,111 entries, all being served, failed a run at 180 s)."""
        start = last_new = last_reclaim = time.monotonic()
        seen = -1
        while True:
            open_, got = faults.progress(self)
            if not open_:
                break
            now = time.monotonic()
            if got != seen:
                seen, last_new = got, now
            if now - last_new > self.args.drain_s or now - start > 4 * self.args.drain_s:
                self.problem(
                    f"{len(open_)} bursts not finished: no new result for {now - last_new:.0f}s "
                    f"({now - start:.0f}s after the schedule)"
                )
                break
            if time.monotonic() - last_reclaim > 15:
                self.cli("reclaim", "--idle-s", "5")
                last_reclaim = time.monotonic()
            time.sleep(0.5)
        deadline = time.monotonic() + 30
        shards = range(resolve_shards(self.r, self.settings))
        while (left := backlog(self.r, self.keys, shards)) != (0, 0):
            if time.monotonic() > deadline:
                self.note(f"after the bursts ended, (stream entries, pending) = {left}")
                break
            time.sleep(0.2)

    def damage(self) -> list[str]:
        with self._lock:
            done = [b for b in self.launched if b.rc == 0 and len(b.requests) >= 20]
        b = max(done, key=lambda x: len(x.requests))
        did = accounting.damage(self.r, self.settings, b.burst_id, self.rng)
        for what in did:
            self.say(f"self-check: {b.burst_id}: {what}")
        return did

    def account(self) -> accounting.Tally:
        tally = accounting.Tally()
        with self._lock:
            bursts = list(self.launched)
        for b in bursts:
            created = b.rc == 0 or bool(self.r.exists(self.keys.burst(b.burst_id)))
            accounting.account(tally, self.settings, b.burst_id, b.ids, b.markers, created=created)
            if b.rc not in (0, None) and not b.killed and created:
                self._check_report(tally, b)
        return tally

    def _check_report(self, tally: accounting.Tally, b: Planned) -> None:
        """A failed submit said how many of its requests were enqueued: at least the requests
        workers recorded (each came from an entry) must be within it."""
        bounds = _BOUNDS.search(b.error)
        m = _REPORTED.search(b.error)
        if bounds:
            high = int(bounds.group(2))
        elif m:
            high = int(m.group(1))
        else:
            return
        try:
            with Burst(b.burst_id, self.settings) as handle:
                got = handle.collect()
        except BurstNotFound:
            return
        by_workers = sum(1 for x in got if x.worker and not x.worker.startswith("prefixq-"))
        if by_workers > high:
            tally.defect(
                "misreported",
                b.burst_id,
                -1,
                f"the failed submit said {high} enqueued; workers recorded {by_workers}",
            )

    def summary(self, tally: accounting.Tally, damaged: list[str]) -> dict[str, Any]:
        kinds = Counter(x.kind for x in self.landed)
        tracebacks = self.workers.tracebacks() + [
            str(f)
            for f in sorted((self.folder / "in").glob("*.err"))
            if "Traceback" in f.read_text()
        ]
        wall = time.monotonic() - self.t0
        d = tally.defects
        now = resolve_shards(self.r, self.settings)  # joins may have grown the deployment
        shards = (
            f"{self.settings.shards}"
            if now == self.settings.shards
            else f"{self.settings.shards} -> {now}"
        )
        ok = (
            tally.clean
            and not d["misreported"]
            and not tracebacks
            and not self.problems
            and len(self.landed) >= self.args.faults
        )
        line = (
            f"soak seed={self.args.seed}: {tally.requests} requests in {tally.bursts} bursts over "
            f"{shards} shards; faults landed {len(self.landed)} "
            f"({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}); "
            f"lost {d['lost']}, duplicated {d['duplicated']}, phantom {d['phantom']}, "
            f"misanswered {d['misanswered']}, misreported {d['misreported']}; "
            f"results {dict(sorted(tally.codes.items()))}; tracebacks {len(tracebacks)}, "
            f"problems {len(self.problems)}; "
            + (
                f"failovers injected: {kinds.get('master_failover', 0)}; "
                if "failover" in self.redis.capabilities
                else ""
            )
            + f"wall {wall:.0f}s: {'PASS' if ok else 'FAIL'}"
        )
        return {
            "ok": ok,
            "line": line,
            "seed": self.args.seed,
            "requests": tally.requests,
            "bursts": tally.bursts,
            "shards": now,
            "faults": len(self.landed),
            "faults_by_kind": dict(kinds),
            "failovers": kinds.get("master_failover", 0),
            "landed": [[x.kind, x.how] for x in self.landed],
            "lost": d["lost"],
            "duplicated": d["duplicated"],
            "phantom": d["phantom"],
            "misanswered": d["misanswered"],
            "misreported": d["misreported"],
            "results_by_code": dict(tally.codes),
            "examples": tally.examples,
            "tracebacks": tracebacks,
            "problems": self.problems,
            "notes": self.notes,
            "self_check": damaged,
            "aof_delayed_fsync": self.redis.aof_delayed_fsyncs(),
            "wall_s": round(wall, 1),
        }


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=3000, help="requests in all (default 3000)")
    p.add_argument("--shards", type=int, default=3, help="shards, one worker each (default 3)")
    p.add_argument("--faults", type=int, default=24, help="faults that must land (default 24)")
    p.add_argument("--duration", type=float, default=80.0, help="schedule, seconds (default 80)")
    p.add_argument(
        "--drain-s",
        type=float,
        default=180.0,
        help="after the schedule, wait for bursts while a new result comes this often (180 s; "
        "4 times that in all)",
    )
    p.add_argument("--seed", type=int, default=None, help="the schedule's seed (default: new)")
    p.add_argument("--only", default="", help="fault kinds to draw, comma-separated (default all)")
    p.add_argument("--self-check", action="store_true", help="damage results: the run must fail")
    p.add_argument("--json", default="", help="write the summary's details here")
    p.add_argument("--keep", default="", help="keep logs and inputs in this folder")
    p.add_argument(
        "--cluster",
        action="store_true",
        help="run on a Redis Cluster of 6 nodes and inject master failovers",
    )
    args = p.parse_args(argv)
    if args.seed is None:
        args.seed = secrets.randbelow(10**6)
    unknown = set(filter(None, args.only.split(","))) - set(ALL_FAULTS)
    if unknown:
        p.error(f"unknown fault kinds {sorted(unknown)} (known: {', '.join(ALL_FAULTS)})")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    folder = Path(args.keep or tempfile.mkdtemp(prefix="prefixq-soak-"))
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    (folder / "in").mkdir(exist_ok=True)
    node: Redis = ClusterNodes(args.shards) if args.cluster else SingleNode()
    node.start()
    if args.cluster:  # every submit (CLI and API processes) confirms on a replica too
        ENV["PREFIXQ_MIN_REPLICAS_ACKED"] = "1"
    soak = Soak(args, node, folder)
    try:
        out = soak.run()
    finally:
        soak.workers.close()
        soak.r.close()
        node.close()
    for what in out["problems"]:
        print(f"problem: {what}")
    for burst, index, what in out["examples"][:20]:
        print(f"defect: {burst}[{index}] {what}")
    for log in out["tracebacks"]:
        print(f"traceback in {log}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    print(out["line"], flush=True)
    if not args.keep and out["ok"]:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    else:
        print(f"logs and inputs: {folder}")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # clean-up runs on a SIGTERM too
    sys.exit(main(sys.argv[1:]))
