"""The soak's faults, one class per kind, each counted only when it is seen to land.

A fault's `run` acts on the running soak (`SoakRun`, soaklib/run.py) and returns what landed,
each with how it was observed (`Landed`); a fault that finds nothing to hit (no request in
flight, no burst left to cancel) or whose effect is not seen returns nothing and is not counted.
How each kind is observed:

- ``worker_kill9``: the worker had entries pending on its consumer name right before SIGKILL, and
  its exit status says it was killed; it is started again under the same name (it replays its
  own entries) or a new one (its entries are reclaimed after ``claim_idle_s``);
- ``worker_sigterm``: entries pending on it before the signal; exit 0 within
  `worker.stop_bound_s` (an exit that is not 0, or late, is a problem of the run; primaries run
  with ``--hand-over``, whose move of the queue the bound allows for);
- ``sigterm_redis_down``: the same, sent while redis-server is down (the bounded stop: the
  hand-over is skipped, so the plain bound holds);
- ``sigterm_at_start``: a worker whose start is held (``--hold-start``) gets SIGTERM before it
  serves: exit 0 before the start-up watchdog, and its log says it stopped during start-up;
- ``duplicate_worker``: a second worker of a shard, under the primary's consumer name or another,
  logs that it serves while the primary is alive; it is stopped (SIGTERM) a few seconds later;
- ``redis_kill9``: redis-server killed -9 while a burst had results missing, then started again
  from its AOF; seen answering again (the AOF loaded);
- ``maxmemory``: ``maxmemory`` set below the used memory; a write of the soak's own refused with
  OOM; a worker killed -9 inside that window counts as a ``worker_kill9`` too;
- ``maxmemory_mid_submit``: the same, opened just after a burst's record was created by its
  submit: the submit fails and says how many of its requests Redis holds (the accounting checks
  that no more than that were then recorded by workers); its burst is cancelled;
- ``reclaim``: after a kill -9 and the dead worker's heartbeat expiring, ``prefixq reclaim``'s
  report says it moved or dead-lettered entries;
- ``cancel``: ``prefixq cancel``'s report says it cancelled requests of a running burst;
- ``garbage``: an entry XADDed into an intake or a live lane (random bytes, a 64 MiB zlib bomb,
  forged entries: an index outside its burst, a burst that does not exist, a stale enqueue time,
  another entry version, missing fields, a doorbell of no lane) is seen gone from its stream
  (a worker handled and acked it), with a dead letter for those that do not decode; one still
  queued after 10 s (behind a backlog) is looked at again once the run has drained;
- ``producer_kill``: a submit process killed -9 after its burst's record appeared and before its
  last step (the record has no ``per_shard`` yet); the burst is then cancelled with
  ``prefixq cancel``, as docs/delivery.md tells an operator to;
- ``master_failover`` (Redis Cluster, the hook for it): the deployment's `failover()` says which
  master it replaced; scheduled only on a deployment with the ``"failover"`` capability.

An entry forged exactly as a producer writes it (the right burst, index and enqueue time) is
indistinguishable from the producer's and is not among them: write access to the streams is the
boundary (docs/delivery.md, ACL users).

To add a kind: a `Fault` subclass with its ``kind``, its ``needs`` (deployment capabilities) and
``weight``, and an entry in `FAULTS`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import time
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import redis

from prefixq.cli.worker_signals import EXIT_S
from prefixq.core import wire
from prefixq.core.keys import FIELD, LANE
from prefixq.core.sharing import PRIORITIES
from prefixq.store.census import count_enqueued
from prefixq.store.connection import async_client
from prefixq.worker.worker import stop_bound_s
from soaklib.deployment import Worker, pending_on
from soaklib.run import Landed, SoakRun

if TYPE_CHECKING:
    from soaklib.workload import Planned

#: the 64 MiB of zeros a zlib bomb inflates to (made once: compressing takes a moment)
_BOMB: bytes = b""


class Fault:
    """One kind of fault."""

    kind: ClassVar[str]
    #: deployment capabilities it needs (deployment.Redis.capabilities)
    needs: ClassVar[frozenset[str]] = frozenset()
    #: how often it is drawn, relative to the others
    weight: ClassVar[float] = 1.0

    def run(self, soak: SoakRun) -> list[Landed]:
        raise NotImplementedError


def busy_primary(
    soak: SoakRun, timeout: float = 6.0, *, alone: bool = False
) -> tuple[Worker, int] | None:
    """A live primary worker with entries pending on it (waits up to ``timeout`` for one);
    ``alone``: only one that no other live worker of its shard (serving or still starting) backs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        shards = list(range(soak.settings.shards))
        soak.rng.shuffle(shards)
        for k in shards:
            w = soak.workers.primary(k)
            if w is None or not soak.workers.serving(w, soak.r):
                continue
            if alone and any(x.shard == k and x.alive and x is not w for x in soak.workers.all):
                continue
            try:
                n = pending_on(soak.r, soak.keys, k, w.name)
            except redis.RedisError:
                return None
            if n:
                return w, n
        time.sleep(0.1)
    return None


def kill9(soak: SoakRun, w: Worker, n: int, where: str = "") -> Landed | None:
    w.proc.send_signal(signal.SIGKILL)
    rc = w.proc.wait(30)
    if rc != -signal.SIGKILL:
        return None
    return Landed("worker_kill9", f"{w.name} (shard {w.shard}) with {n} entries pending{where}")


def restart(soak: SoakRun, w: Worker, *, same_name: bool | None = None) -> None:
    """A primary for ``w``'s shard again: under ``w``'s name (it replays its own pending
    entries) or a new one (they are reclaimed after claim_idle_s); either, at random."""
    same = soak.rng.random() < 0.5 if same_name is None else same_name
    soak.workers.start(w.shard, w.name if same else "")


class WorkerKill9(Fault):
    kind = "worker_kill9"
    weight = 3.0

    def run(self, soak: SoakRun) -> list[Landed]:
        got = busy_primary(soak)
        if got is None:
            return []
        w, n = got
        landed = kill9(soak, w, n)
        time.sleep(soak.rng.uniform(0.0, 1.0))
        restart(soak, w)
        return [landed] if landed else []


class WorkerSigterm(Fault):
    kind = "worker_sigterm"
    weight = 2.0

    def run(self, soak: SoakRun) -> list[Landed]:
        got = busy_primary(soak)
        if got is None:
            return []
        w, n = got
        landed = sigterm(soak, w, n, self.kind, "")
        restart(soak, w, same_name=True)
        return [landed] if landed else []


def sigterm(
    soak: SoakRun, w: Worker, n: int, kind: str, where: str, *, redis_down: bool = False
) -> Landed | None:
    """SIGTERM ``w``; a landed fault if it exits 0 within its bound, else a problem. A primary
    hands its queue over (``--hand-over``: up to HAND_OVER_S more), unless Redis is down: then
    it skips the hand-over and keeps the plain bound."""
    bound = stop_bound_s(soak.settings, hand_over=w.role == "primary" and not redis_down)
    t0 = time.monotonic()
    w.proc.send_signal(signal.SIGTERM)
    try:
        rc = w.proc.wait(bound + 30)
    except subprocess.TimeoutExpired:
        w.proc.kill()
        rc = w.proc.wait()
    took = time.monotonic() - t0
    if rc != 0 or took > bound + 2.0:
        soak.problem(f"SIGTERM{where} to {w.name}: exit {rc} after {took:.1f}s (bound {bound}s)")
        return None
    return Landed(kind, f"{w.name} with {n} entries pending{where}: exit 0 in {took:.1f}s")


class SigtermAtStart(Fault):
    kind = "sigterm_at_start"
    weight = 1.0

    def run(self, soak: SoakRun) -> list[Landed]:
        k = soak.rng.randrange(soak.settings.shards)
        hold = f"{soak.rng.uniform(5.0, 30.0):.1f}"
        w = soak.workers.start(k, "", "--hold-start", hold, role="extra")
        deadline = time.monotonic() + 30
        while "starting (pid" not in w.log.read_text(errors="replace"):
            if time.monotonic() > deadline or not w.alive:
                soak.problem(f"{w.name} never logged its start")
                return []
            time.sleep(0.02)
        time.sleep(soak.rng.uniform(0.0, 0.5))
        t0 = time.monotonic()
        w.proc.send_signal(signal.SIGTERM)
        rc = soak.workers.stop(w, timeout=EXIT_S + 10)
        took = time.monotonic() - t0
        text = w.log.read_text(errors="replace")
        if rc != 0 or took >= EXIT_S or "SIGTERM during start-up: exiting" not in text:
            soak.problem(f"SIGTERM during the start of {w.name}: exit {rc} after {took:.1f}s")
            return []
        return [Landed(self.kind, f"{w.name} held {hold}s at start: exit 0 in {took:.2f}s")]


class DuplicateWorker(Fault):
    kind = "duplicate_worker"
    weight = 2.0

    def run(self, soak: SoakRun) -> list[Landed]:
        k = soak.rng.randrange(soak.settings.shards)
        primary = soak.workers.primary(k)
        if primary is None:
            return []
        if soak.rng.random() < 0.5 and primary.warm:
            return self._same_name(soak, k, primary)
        same = False
        dup = soak.workers.start(k, "", role="extra")
        deadline = time.monotonic() + 30
        while not dup.warm:
            if time.monotonic() > deadline or not dup.alive:
                soak.problem(f"duplicate worker {dup.name} never served")
                return []
            time.sleep(0.05)
        both = primary.alive
        time.sleep(soak.rng.uniform(2.0, 6.0))
        rc = soak.workers.stop(dup, timeout=stop_bound_s(soak.settings) + 30)
        if rc != 0:
            soak.problem(f"duplicate worker {dup.name}: exit {rc} after SIGTERM")
        if not both:
            return []
        how = "under the primary's name" if same else f"as {dup.name} beside {primary.name}"
        return [Landed(self.kind, f"a second worker served shard {k} {how}")]

    @staticmethod
    def _same_name(soak: SoakRun, k: int, primary: Any) -> list[Landed]:
        """A second process under a serving primary's name is refused (exit 2, naming the
        name in use: worker/startup.py), and the primary serves on."""
        dup = soak.workers.start(k, primary.name, role="extra")
        try:
            rc = dup.proc.wait(30)
        except subprocess.TimeoutExpired:
            soak.workers.stop(dup, timeout=stop_bound_s(soak.settings) + 30)
            soak.problem(f"a second worker under {primary.name}'s name was not refused")
            return []
        text = dup.log.read_text(errors="replace")
        if rc != 2 or f"worker name {primary.name!r} is in use on shard {k}" not in text:
            soak.problem(f"a second worker under {primary.name}'s name: exit {rc}, {text[-300:]}")
            return []
        return [Landed("duplicate_worker", f"a second worker under {primary.name}'s name refused")]


def unfinished(soak: SoakRun) -> list[str]:
    """Bursts submitted (record created) with results still missing."""
    return progress(soak)[0]


def progress(soak: SoakRun) -> tuple[list[str], int]:
    """`unfinished`'s bursts, and how many results they have so far (the bursts read before
    Redis went away, if it did)."""
    out: list[str] = []
    results = 0
    for b in soak.created_bursts():
        try:
            total, done, failed = soak.r.hmget(soak.keys.burst(b), "total", "done", "failed")
        except redis.RedisError:
            break
        got = int(done or 0) + int(failed or 0)
        if total is not None and got < int(total):
            out.append(b)
            results += got
    return out, results


class RedisKill9(Fault):
    kind = "redis_kill9"
    needs = frozenset({"kill"})
    weight = 2.0
    #: SIGTERM a worker with entries pending while Redis is down (`SigtermRedisDown`)
    stop_one = False

    def run(self, soak: SoakRun) -> list[Landed]:
        missing = unfinished(soak)
        got = busy_primary(soak, timeout=2.0) if self.stop_one else None
        if not missing or (self.stop_one and got is None):
            return []
        soak.redis.kill()
        down = soak.rng.uniform(0.5, 4.0)
        landed = [Landed("redis_kill9", f"while {len(missing)} bursts had results missing")]
        t0 = time.monotonic()
        if got is not None:  # the bounded stop: grace_s + FLUSH_S whatever Redis does
            w, n = got
            stopped = sigterm(
                soak, w, n, "sigterm_redis_down", " while Redis is down", redis_down=True
            )
            if stopped:
                landed.append(stopped)
            restart(soak, w, same_name=True)
        time.sleep(max(0.0, down - (time.monotonic() - t0)))
        soak.redis.start()
        landed[0].how += f"; started again after {time.monotonic() - t0:.1f}s, AOF loaded"
        return landed


class SigtermRedisDown(RedisKill9):
    kind = "sigterm_redis_down"
    weight = 1.0
    stop_one = True


class MaxMemory(Fault):
    kind = "maxmemory"
    needs = frozenset({"maxmemory"})
    weight = 1.5

    def run(self, soak: SoakRun) -> list[Landed]:
        r = soak.r
        used = int(r.info("memory")["used_memory"])
        r.config_set("maxmemory", max(1, int(used * 0.9)))
        landed: list[Landed] = []
        killed: Worker | None = None
        try:
            try:
                r.set(f"{soak.settings.namespace}:probe", "x")
            except redis.exceptions.OutOfMemoryError:
                landed.append(Landed(self.kind, f"maxmemory {int(used * 0.9)} < used {used}"))
            if not landed:
                return []
            window = soak.rng.uniform(2.0, 5.0)
            t0 = time.monotonic()
            got = busy_primary(soak, timeout=1.0)
            if got is not None and soak.rng.random() < 0.8:
                time.sleep(soak.rng.uniform(0.0, 1.0))
                kill = kill9(soak, got[0], got[1], " inside the out-of-memory window")
                if kill is not None:
                    landed.append(kill)
                    killed = got[0]
            time.sleep(max(0.0, window - (time.monotonic() - t0)))
            landed[0].how += f" for {time.monotonic() - t0:.1f}s"
        finally:
            r.config_set("maxmemory", 0)
        if killed is not None:
            restart(soak, killed)
        return landed


def launch_until_created(soak: SoakRun, b: Planned) -> subprocess.Popen[bytes] | None:
    """Start ``b``'s submit and return once its burst record exists (the moment a fault mid-submit
    aims at); None, with the submit settled, if it ended or took 30 s without creating one."""
    proc = soak.launch(b)
    meta = soak.keys.burst(b.burst_id)
    deadline = time.monotonic() + 30
    while not soak.r.exists(meta):
        if proc.poll() is not None or time.monotonic() > deadline:
            soak.settle_submit(b, proc)
            return None
        time.sleep(0.002)
    return proc


class MaxMemoryMidSubmit(Fault):
    """Redis runs out of memory while a burst is being submitted, after its record was created:
    the submit fails, says how many of its requests Redis holds (checked at the accounting
    against what workers then record: ``misreported``), and its burst is cancelled."""

    kind = "maxmemory_mid_submit"
    needs = frozenset({"maxmemory"})
    weight = 1.0

    def run(self, soak: SoakRun) -> list[Landed]:
        b = soak.extra_burst(soak.rng.randint(800, 2000))
        proc = launch_until_created(soak, b)
        if proc is None:
            return []
        time.sleep(soak.rng.uniform(0.0, 0.1))
        used = int(soak.r.info("memory")["used_memory"])
        soak.r.config_set("maxmemory", max(1, int(used * 0.9)))
        try:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        finally:
            soak.r.config_set("maxmemory", 0)
        soak.settle_submit(b, proc)
        said = _REPORT.search(b.error)
        if b.rc != 1 or said is None:
            return []
        return [Landed(self.kind, f"submit of {b.burst_id} failed mid-way: {said.group(0)}")]


#: what a failed submit says of its burst
_REPORT = re.compile(r"(at least \d+ and at most )?\d+ of its \d+ requests")


class Reclaim(Fault):
    kind = "reclaim"
    weight = 1.5

    def run(self, soak: SoakRun) -> list[Landed]:
        # alone on its shard: a second worker there would claim the entries before the hand
        # reclaim did (twice "nothing to hit" in one run, beside a duplicate worker)
        got = busy_primary(soak, alone=True)
        if got is None:
            return []
        w, n = got
        landed: list[Landed] = []
        kill = kill9(soak, w, n, ", then reclaimed by hand")
        if kill is None:
            return []
        landed.append(kill)
        # its heartbeat expired, its entries idle (and the shard not yet orphaned: soak.py)
        time.sleep(soak.settings.heartbeat_ttl_s + 0.5)
        p = soak.cli("reclaim", "--shard", str(w.shard), "--idle-s", "1", "--json")
        soak.workers.start(w.shard)  # a new name: the old one's entries are not its own
        if p.returncode != 0:
            soak.problem(f"prefixq reclaim exited {p.returncode}: {p.stderr[-300:]}")
            return landed
        rep = json.loads(p.stdout)[0]
        if rep["moved"] + rep["dead"]:
            landed.append(
                Landed(self.kind, f"shard {w.shard}: moved {rep['moved']}, dead {rep['dead']}")
            )
        return landed


class Cancel(Fault):
    kind = "cancel"
    weight = 1.5

    def run(self, soak: SoakRun) -> list[Landed]:
        missing = unfinished(soak)
        if not missing:
            return []
        burst = soak.rng.choice(missing)
        p = soak.cli("cancel", burst, "--json")
        if p.returncode != 0:
            soak.problem(f"prefixq cancel {burst} exited {p.returncode}: {p.stderr[-300:]}")
            return []
        rep = json.loads(p.stdout)
        if not rep["cancelled"]:
            return []
        return [Landed(self.kind, f"{burst}: {rep['cancelled']} of {rep['total']} cancelled")]


def _bomb() -> bytes:
    global _BOMB
    if not _BOMB:
        _BOMB = bytes([wire.CODEC_TAGS["zlib"]]) + zlib.compress(bytes(64 << 20), 9)
    return _BOMB


class Garbage(Fault):
    kind = "garbage"
    weight = 3.0
    #: the variants, the bomb first (every run has one)
    VARIANTS = (
        "zlib-bomb-64MiB",
        "random-bytes",
        "index-outside-its-burst",
        "unknown-burst",
        "stale-enqueue-time",
        "other-version",
        "missing-fields",
        "doorbell-of-no-lane",
    )

    def __init__(self) -> None:
        self.sent = 0

    def run(self, soak: SoakRun) -> list[Landed]:
        variant = self.VARIANTS[0] if not self.sent else soak.rng.choice(self.VARIANTS[1:])
        self.sent += 1
        k = soak.rng.randrange(soak.settings.shards)
        key, data, extra = self._entry(soak, variant, k)
        if key is None:
            return []
        fields: dict[bytes, bytes] = {FIELD: data, **extra}
        entry_id = soak.r.xadd(key, fields)
        what = f"{variant} ({len(data)} B) into {_where(key)} of shard {k}"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            got = _handled(soak, key, entry_id, k, what)
            if got is not None:
                return [got]
            time.sleep(0.1)
        # behind a backlog (an intake is read in order, a lane when its turn comes): looked at
        # again once the run has drained
        soak.later(lambda: _handled(soak, key, entry_id, k, what + ", after the drain"), what)
        return []

    def _entry(
        self, soak: SoakRun, variant: str, k: int
    ) -> tuple[str | None, bytes, dict[bytes, bytes]]:
        rng, keys = soak.rng, soak.keys
        intake = keys.intake(k, rng.choice(PRIORITIES))
        if variant == "zlib-bomb-64MiB":
            return intake, _bomb(), {}
        if variant == "random-bytes":
            return intake, os.urandom(rng.randint(1, 4096)), {}
        if variant == "doorbell-of-no-lane":
            return intake, _forged(soak, "unknown-burst", k), {LANE: b"1"}
        key = intake
        if rng.random() < 0.5:  # a live lane of the shard, when there is one
            lanes = [b.decode() for b in soak.r.hkeys(keys.lanes(k))]
            live = [b for b in lanes if soak.r.exists(keys.lane(k, b))]
            if live:
                key = keys.lane(k, rng.choice(live))
        return key, _forged(soak, variant, k), {}


def _where(key: str) -> str:
    return "a lane" if ":lane:" in key else "intake " + key.rsplit(":", 1)[-1]


def _handled(soak: SoakRun, key: str, entry_id: bytes, k: int, what: str) -> Landed | None:
    """A garbage entry's landing: gone from its stream (handled and acked), with a dead letter
    when it did not decode."""
    try:
        if soak.r.xrange(key, entry_id, entry_id):
            return None
        dead = [
            f
            for _, f in soak.r.xrevrange(soak.keys.dead(k), count=500)
            if f.get(b"entry") == entry_id
        ]
    except redis.RedisError:
        return None
    return Landed("garbage", f"{what}: acked" + (", dead-lettered" if dead else ""))


def _forged(soak: SoakRun, variant: str, k: int) -> bytes:
    """A forged entry of ``variant``: well formed but for one thing."""
    bursts = soak.created_bursts()
    burst = soak.rng.choice(bursts) if bursts else "no-such-burst"
    total = int(soak.r.hget(soak.keys.burst(burst), "total") or 1)
    created = float(soak.r.hget(soak.keys.burst(burst), "created") or time.time())
    d: dict[str, Any] = {
        "v": 1,
        "b": burst,
        "i": soak.rng.randrange(total),
        "id": f"forged-{soak.rng.randrange(10**6)}",
        "p": "forged prompt",
        "e": created,
        "k": k,
        "w": 1,
        "pc": 0,
    }
    if variant == "index-outside-its-burst":
        d["i"] = total + soak.rng.randrange(1000)
    elif variant == "unknown-burst":
        d["b"] = f"no-such-burst-{soak.rng.randrange(10**6)}"
    elif variant == "stale-enqueue-time":
        d["e"] = created - 3600.0
    elif variant == "other-version":
        d["v"] = 99
    elif variant == "missing-fields":
        del d["id"], d["p"]
    return wire.encode(d, soak.rng.choice(("zlib", "none")))


class ProducerKill(Fault):
    kind = "producer_kill"
    weight = 2.0

    def run(self, soak: SoakRun) -> list[Landed]:
        b = soak.extra_burst(soak.rng.randint(300, 900))
        proc = launch_until_created(soak, b)
        if proc is None:
            return []
        meta = soak.keys.burst(b.burst_id)
        time.sleep(soak.rng.uniform(0.0, 0.25))
        proc.send_signal(signal.SIGKILL)
        rc = proc.wait(30)
        b.killed = rc == -signal.SIGKILL
        if not b.killed or soak.r.hexists(meta, "per_shard"):
            soak.settle_submit(b, proc)
            return []
        s = soak.settings
        pri = b.priority
        n = asyncio.run(_census(s, b.burst_id, pri))
        p = soak.cli("cancel", b.burst_id, "--json")
        if p.returncode != 0:
            soak.problem(f"prefixq cancel {b.burst_id} exited {p.returncode}: {p.stderr[-300:]}")
        return [
            Landed(
                self.kind,
                f"{b.via} submit of {b.burst_id} killed with {n} of "
                f"{len(b.requests)} requests in Redis; cancelled",
            )
        ]


async def _census(s: Any, burst: str, priority: str) -> int:
    c = async_client(s)
    try:
        return await count_enqueued(c, s, burst, shards=s.shards, priority=priority)
    finally:
        await c.aclose()


class MasterFailover(Fault):
    """Redis Cluster: a replica takes over a master mid-burst (the hook for the cluster work:
    a deployment with the "failover" capability implements `failover()`)."""

    kind = "master_failover"
    needs = frozenset({"failover"})
    weight = 2.0

    def run(self, soak: SoakRun) -> list[Landed]:
        if unfinished(soak):
            return [Landed(self.kind, soak.redis.failover())]
        # the plan's bursts are all done: one of its own, so that the failover lands mid-burst
        # (drawn late, it found nothing to hit again and again: a soak without a failover)
        b = soak.extra_burst(soak.rng.randint(300, 900))
        proc = launch_until_created(soak, b)
        if proc is None:
            return []
        how = soak.redis.failover()
        soak.settle_submit(b, proc)
        return [Landed(self.kind, f"{how} (mid-burst {b.burst_id}, submitted for it)")]


FAULTS: dict[str, Callable[[], Fault]] = {
    f.kind: f
    for f in (
        WorkerKill9,
        WorkerSigterm,
        SigtermAtStart,
        DuplicateWorker,
        RedisKill9,
        SigtermRedisDown,
        MaxMemory,
        MaxMemoryMidSubmit,
        Reclaim,
        Cancel,
        Garbage,
        ProducerKill,
        MasterFailover,
    )
}


def draw(rng: random.Random, faults: dict[str, Fault], capabilities: frozenset[str]) -> Fault:
    """A fault of a kind the deployment supports, by weight."""
    usable = [f for f in faults.values() if f.needs <= capabilities]
    return rng.choices(usable, weights=[f.weight for f in usable])[0]
