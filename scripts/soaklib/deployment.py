"""What the soak runs against: Redis, and fake-engine worker processes per shard.

`Redis` is the seam for another deployment: the soak only calls what it declares. `SingleNode`
is one redis-server with its AOF at ``appendfsync everysec`` (prefixq.cli.redis_server), which
can be killed -9 and started again from its AOF. `ClusterNodes` is a Redis Cluster of 6
redis-server processes (tests/redis_cluster.py: 3 masters, 3 replicas, AOF everysec) with
``"failover"`` in its `capabilities`: its `failover()` kills -9 the master of a shard's slot,
waits until the replica took over, and starts the killed node again (it rejoins as the new
master's replica); faults.py then schedules its ``master_failover`` kind (see faults.FAULTS).

Workers are tests/fault_worker.py processes: the real `Worker` loop over tests/fake_engine.py,
with the signal handlers `prefixq worker` installs.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import redis

import prefixq
from prefixq.cli.redis_server import RedisServer
from prefixq.core.keys import GROUP, Keys
from prefixq.core.settings import Settings
from prefixq.core.sharing import PRIORITIES

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
#: the environment of every process the soak starts: the prefixq it imported itself
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(prefixq.__file__).parents[1]), os.environ.get("PYTHONPATH")])
    ),
    "PYTHONUNBUFFERED": "1",
}
#: the settings every worker is started with (as flags)
WORKER_FIELDS = (
    "redis_url",
    "namespace",
    "shards",
    "max_attempts",
    "claim_idle_s",
    "heartbeat_s",
    "heartbeat_ttl_s",
    "grace_s",
    "max_inflight",
    "tenant_weights",
    "min_replicas_acked",
    "orphan_after_s",
)


class Redis(Protocol):
    """A Redis deployment the soak can fault."""

    #: what it can do beyond serving: "kill" (kill -9 and start again), "maxmemory" (CONFIG SET
    #: maxmemory), "failover" (a replica takes over a master: Redis Cluster)
    capabilities: frozenset[str]

    @property
    def url(self) -> str: ...

    def start(self) -> None: ...

    def kill(self) -> None: ...

    def failover(self) -> str: ...

    def close(self) -> None: ...

    def aof_delayed_fsyncs(self) -> int: ...

    def client(self) -> redis.Redis:
        """A client of the soak's own (reads and the faults' writes)."""
        ...


class SingleNode:
    """One redis-server with AOF everysec on a free port, in a temp dir."""

    capabilities = frozenset({"kill", "maxmemory"})

    def __init__(self) -> None:
        self.server = RedisServer(appendonly=True)

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> None:
        self.server.start()
        c = redis.Redis.from_url(self.url, socket_timeout=5)
        try:  # until the AOF is loaded
            deadline = time.monotonic() + 60
            while True:
                try:
                    c.ping()
                    return
                except (redis.BusyLoadingError, redis.ConnectionError):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
        finally:
            c.close()

    def kill(self) -> None:
        self.server.kill()

    def failover(self) -> str:
        raise NotImplementedError("a single redis-server has no replica to fail over to")

    def close(self) -> None:
        self.server.close()

    def aof_delayed_fsyncs(self) -> int:
        """How often Redis postponed a write behind a slow fsync (docs/delivery.md: a process
        crash then can lose those writes), since it last started."""
        c = redis.Redis.from_url(self.url)
        try:
            return int(c.info("persistence").get("aof_delayed_fsync", 0))
        finally:
            c.close()

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=10)


class ClusterNodes:
    """A Redis Cluster of 6 redis-server processes (3 masters, 3 replicas) on free ports."""

    capabilities = frozenset({"failover"})

    def __init__(self, shards: int) -> None:
        sys.path.insert(0, str(ROOT / "tests"))  # the launcher the cluster tests use
        from redis_cluster import RedisCluster

        self.cluster = RedisCluster()
        self.shards = shards
        self._next = 0
        self._started = False

    @property
    def url(self) -> str:
        return self.cluster.url

    def start(self) -> None:
        """Start the cluster the first time; later, restart any dead node and wait until every
        master has its replica again."""
        if not self._started:
            self.cluster.start()
            self._started = True
        else:
            self.cluster.heal()

    def kill(self) -> None:
        raise NotImplementedError("the cluster deployment fails masters over instead")

    def failover(self) -> str:
        """kill -9 the master holding the next shard's slot (shards in turn), wait until its
        replica serves the slot, start the killed node again and wait until it replicates."""
        k = self._next % self.shards
        self._next += 1
        key = Keys("x").intake(k, PRIORITIES[0])
        c = self.cluster
        c.wait_whole(60)
        old = c.kill_master_of(key)
        t0 = time.monotonic()
        new = c.wait_failover(key, old, 60)
        took = time.monotonic() - t0
        c.restart(old)
        c.wait_whole(60)
        return (
            f"master {old.addr} of shard {k}'s slot killed -9; replica {new.addr} promoted in "
            f"{took:.1f}s; {old.addr} rejoined as its replica"
        )

    def close(self) -> None:
        self.cluster.close()

    def aof_delayed_fsyncs(self) -> int:
        n = 0
        for node in self.cluster.nodes:
            if node.alive:
                c = node.client(5.0)
                try:
                    n += int(c.info("persistence").get("aof_delayed_fsync", 0))
                finally:
                    c.close()
        return n

    def client(self) -> redis.Redis:
        from prefixq.store.connection import sync_client

        return sync_client(Settings(redis_url=self.url))


@dataclass
class Worker:
    """One worker process."""

    shard: int
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    started: float = field(default_factory=time.monotonic)
    #: "primary" (the shard's serving worker) or "extra" (a duplicate, a start-up stop)
    role: str = "primary"
    _warm: bool = False

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def warm(self) -> bool:
        """Whether this process logged that it serves (a heartbeat under its name may be a
        previous process's: a restart under the same name, a duplicate)."""
        if not self._warm:
            self._warm = "warm in" in self.log.read_text(errors="replace")
        return self._warm


#: what a joining worker logs once it has its shard (tests/fault_worker.py, `prefixq worker`)
_JOINED = re.compile(r"joins the deployment as shard (\d+)")


class Workers:
    """The worker processes of a run, by shard; every one is stopped by `close`."""

    def __init__(self, settings: Settings, folder: Path) -> None:
        self.settings, self.folder = settings, folder
        self.keys = Keys(settings.namespace)
        self.all: list[Worker] = []
        self._gen = 0

    def flags(self) -> list[str]:
        s = self.settings
        out: list[str] = []
        for f in WORKER_FIELDS:
            value = str(getattr(s, f))
            if value:
                out += ["--" + f.replace("_", "-"), value]
        return out

    def start(self, shard: int, name: str = "", *extra: str, role: str = "primary") -> Worker:
        """A worker of ``shard`` (-1: ``--join`` in ``extra`` picks it; `wait_serving` reads it
        from the log); a primary hands its queue over when it stops (``--hand-over``)."""
        self._gen += 1
        name = name or (f"s{shard}-w{self._gen}" if shard >= 0 else f"join-w{self._gen}")
        log = self.folder / f"{name}-{self._gen}.log"
        cmd = [PY, str(ROOT / "tests" / "fault_worker.py"), "worker"]
        if shard >= 0:
            cmd += ["--shard", str(shard)]
        if role == "primary":
            cmd.append("--hand-over")
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [*cmd, "--name", name, *extra, *self.flags()],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=ENV,
            )
        w = Worker(shard, name, proc, log, role=role)
        self.all.append(w)
        return w

    def primary(self, shard: int) -> Worker | None:
        """The shard's live primary worker, if any."""
        live = [w for w in self.all if w.shard == shard and w.role == "primary" and w.alive]
        return live[-1] if live else None

    def serving(self, w: Worker, r: redis.Redis) -> bool:
        """Whether ``w`` is alive, logged that it serves, and its heartbeat says so."""
        if not w.alive or not w.warm:
            return False
        with contextlib.suppress(redis.RedisError):
            return bool(r.hget(self.keys.heartbeat(w.shard, w.name), "engine_up") == b"1")
        return False

    def wait_serving(self, w: Worker, r: redis.Redis, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if w.shard < 0:  # a joining worker: its shard once its log names it
                m = _JOINED.search(w.log.read_text(errors="replace"))
                if m is not None:
                    w.shard = int(m.group(1))
            elif self.serving(w, r):
                return True
            if not w.alive:
                return False
            time.sleep(0.05)
        return False

    def stop(self, w: Worker, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if w.alive:
            w.proc.send_signal(sig)
        try:
            return w.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            return w.proc.wait()

    def close(self) -> None:
        for w in self.all:
            if w.alive:
                w.proc.send_signal(signal.SIGTERM)
        for w in self.all:
            try:
                w.proc.wait(30)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()

    def tracebacks(self) -> list[str]:
        """The log files in which a worker printed a traceback."""
        return [str(w.log) for w in self.all if "Traceback" in w.log.read_text(errors="replace")]


def queue_keys(r: redis.Redis, keys: Keys, shard: int) -> list[str]:
    """A shard's streams: its intakes, then its bursts' lanes."""
    lanes = sorted(b.decode() for b in r.hkeys(keys.lanes(shard)))
    return [*(keys.intake(shard, p) for p in PRIORITIES), *(keys.lane(shard, b) for b in lanes)]


def pending_on(r: redis.Redis, keys: Keys, shard: int, consumer: str) -> int:
    """Entries pending on ``consumer`` in the shard's streams."""
    n = 0
    for key in queue_keys(r, keys, shard):
        with contextlib.suppress(redis.ResponseError):  # NOGROUP
            n += len(r.xpending_range(key, GROUP, "-", "+", 10_000, consumername=consumer))
    return n


def backlog(r: redis.Redis, keys: Keys, shards: Sequence[int]) -> tuple[int, int]:
    """(entries in the shards' streams, entries pending) over ``shards``."""
    length = pending = 0
    for k in shards:
        for key in queue_keys(r, keys, k):
            if not r.exists(key):
                continue
            length += r.xlen(key)
            with contextlib.suppress(redis.ResponseError):
                pending += r.xpending(key, GROUP)["pending"]
    return length, pending
