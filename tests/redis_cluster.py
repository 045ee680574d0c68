"""A real Redis Cluster for the tests: 6 `redis-server` processes (3 masters, 3 replicas).

`RedisCluster` starts them on free ports (AOF on, fsync everysec, ``cluster-node-timeout``
1000 ms, each node's ``nodes.conf`` in its own temp dir), joins them with
``redis-cli --cluster create ... --cluster-replicas 1``, waits until every node says
``cluster_state:ok`` and every master has its replica online, and stops them by PID.
The session fixture `redis_cluster` (registered in tests/conftest.py) yields one; helpers on it:

- ``.url``: a multi-seed URL naming all 6 nodes (``redis://127.0.0.1:p1,127.0.0.1:p2,.../0``);
- ``.client()``: a redis-py `redis.cluster.RedisCluster` on it (the caller closes it);
- ``.master_of(key)``: the node that serves the slot of ``key`` now;
- ``.kill_master_of(key)``: kill -9 that node (returns it); ``.wait_failover(key, old)``: until a
  replica serves the slot and every live node says ``cluster_state:ok``;
- ``.restart(node)``: start a killed node again on its port and dir (it rejoins as a replica);
  ``.heal()``: restart every dead node and wait until the cluster is whole again;
- ``.replica_of(master)``, ``.lag(master)`` (replication bytes not yet confirmed),
  ``.pause(node)`` / ``.resume(node)`` (SIGSTOP / SIGCONT), ``.isolate(replica, master)`` (paused
  and its replication link closed: what the master writes next never reaches it),
  ``.replica_keys(replica, key)`` (a hash's fields as a paused replica holds them);
- ``.flushall()``: FLUSHALL on every master.

On it: `cluster_settings` (``make(**overrides)``: `Settings` on the cluster's URL, a fresh
namespace, 4 shards: shards 1, 2, 3 sit on three different masters), `cr` (prefixq's own sync
client for that URL: a cluster client once store/connection.py detects the cluster) and
`cluster_worker` (the `fake_worker` fixture's twin for a cluster URL: `ClusterFakeWorker`).
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.cluster import RedisCluster as ClusterClient

from helpers import FakeWorker
from prefixq.affinity.placement import Placed
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.store.connection import sync_client

HOST = "127.0.0.1"
#: ``redis-cli --cluster create`` flags: one replica per master, no question asked
_REPLICAS = ("--cluster-replicas", "1", "--cluster-yes")
#: a node's cluster bus listens on its port + 10000, so ports stay at most 55535
BUS_OFFSET = 10000
#: a short failure-detection timeout: a killed master is replaced within a few seconds
NODE_TIMEOUT_MS = 1000


@dataclass(eq=False)
class Node:
    """One `redis-server` of the cluster: its port, its dir (AOF and nodes.conf), its process."""

    port: int
    dir: Path
    proc: subprocess.Popen[bytes] | None = None
    kills: int = field(default=0)

    @property
    def addr(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self, timeout: float = 1.0) -> redis.Redis:
        return redis.Redis(HOST, self.port, socket_timeout=timeout, socket_connect_timeout=timeout)

    def log(self, n: int = 2000) -> str:
        path = self.dir / "redis.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def __repr__(self) -> str:
        return f"Node({self.addr}, {'up' if self.alive else 'down'})"


class RedisCluster:
    """``with RedisCluster() as c: c.url``: 3 masters + 3 replicas, started and torn down."""

    def __init__(self, masters: int = 3, binary: str = "redis-server") -> None:
        self.binary = shutil.which(binary) or ""
        self.cli = shutil.which("redis-cli") or ""
        if not self.binary or not self.cli:
            raise RuntimeError("redis-server and redis-cli must be on PATH for a Redis Cluster")
        self.masters = masters
        self.root = Path(tempfile.mkdtemp(prefix="prefixq-cluster-"))
        self.nodes: list[Node] = []
        self.paused: set[int] = set()  # ports of nodes stopped with SIGSTOP
        for i in range(masters * 2):
            d = self.root / f"n{i}"
            d.mkdir()
            self.nodes.append(Node(cluster_port(), d))

    # ---- life cycle -----------------------------------------------------------------------
    @property
    def url(self) -> str:
        """Every node as a seed: any one of them up is enough to find the cluster."""
        return "redis://" + ",".join(n.addr for n in self.nodes) + "/0"

    def _spawn(self, node: Node) -> None:
        args = [
            self.binary,
            "--port",
            str(node.port),
            "--bind",
            HOST,
            "--dir",
            str(node.dir),
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            str(node.dir / "nodes.conf"),
            "--cluster-node-timeout",
            str(NODE_TIMEOUT_MS),
            # a replica may always take over (the test decides what it lost, not Redis)
            "--cluster-replica-validity-factor",
            "0",
            # a replica's full sync starts at once (the default waits 5 s for more replicas)
            "--repl-diskless-sync-delay",
            "0",
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--save",
            "",
            "--daemonize",
            "no",
            "--loglevel",
            "notice",
            "--logfile",
            str(node.dir / "redis.log"),
        ]
        node.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _wait_listening(self, node: Node, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert node.proc is not None
            if node.proc.poll() is not None:
                raise RuntimeError(f"redis-server {node.addr} exited at start: {node.log()}")
            c = node.client(0.2)
            try:
                if c.ping():
                    return
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                pass
            finally:
                c.close()
            if time.monotonic() >= deadline:
                raise RuntimeError(f"redis-server {node.addr} not answering after {timeout}s")
            time.sleep(0.02)

    def start(self, timeout: float = 30.0) -> RedisCluster:
        for n in self.nodes:
            self._spawn(n)
        for n in self.nodes:
            self._wait_listening(n)
        out = subprocess.run(
            [self.cli, "--cluster", "create", *(n.addr for n in self.nodes), *_REPLICAS],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout}{out.stderr}")
        self.wait_whole(timeout)
        return self

    def stop(self) -> None:
        """Stop every node by its PID (SIGTERM, then SIGKILL after 5 s)."""
        for n in self.nodes:
            if n.port in self.paused:
                self.resume(n)
        for n in self.nodes:
            if n.alive and n.proc is not None:
                n.proc.terminate()
        for n in self.nodes:
            if n.proc is not None:
                try:
                    n.proc.wait(5)
                except subprocess.TimeoutExpired:
                    n.proc.kill()
                    n.proc.wait()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> RedisCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- what the cluster looks like now ----------------------------------------------------
    def _ask(self, node: Node, *cmd: str) -> object:
        c = node.client()
        try:
            return c.execute_command(*cmd)
        finally:
            c.close()

    def _state_ok(self, node: Node) -> bool:
        try:
            info = self._ask(node, "CLUSTER", "INFO")
        except redis.RedisError:
            return False
        text = info.decode() if isinstance(info, bytes) else str(info)
        return "cluster_state:ok" in text

    def _replication(self, node: Node) -> dict[str, object]:
        c = node.client()
        try:
            return dict(c.info("replication"))
        finally:
            c.close()

    def roles(self) -> dict[Node, str]:
        """Each live node's role now: ``master`` or ``slave``."""
        out: dict[Node, str] = {}
        for n in self.nodes:
            if n.alive:
                with contextlib.suppress(redis.RedisError):
                    out[n] = str(self._replication(n)["role"])
        return out

    def live_masters(self) -> list[Node]:
        return [n for n, role in self.roles().items() if role == "master"]

    def _whole(self) -> str:
        """'' when every node is up, says cluster_state:ok, there are ``masters`` masters and
        each has a replica online; else what is not so."""
        down = [n for n in self.nodes if not n.alive]
        if down:
            return f"nodes down: {down}"
        bad = [n for n in self.nodes if not self._state_ok(n)]
        if bad:
            return f"cluster_state not ok on {bad}"
        masters = self.live_masters()
        if len(masters) != self.masters:
            return f"{len(masters)} masters, not {self.masters}: {masters}"
        for m in masters:
            try:
                rep = self._replication(m)
            except redis.RedisError as e:
                return f"{m}: {e}"
            online = [v for k, v in rep.items() if k.startswith("slave") and "online" in str(v)]
            if not online:
                return f"master {m} has no replica online ({rep.get('connected_slaves')})"
        return ""

    def wait_whole(self, timeout: float = 30.0) -> None:
        """Until every node is up and ok and each master has its replica online."""
        deadline = time.monotonic() + timeout
        while (why := self._whole()) != "":
            if time.monotonic() >= deadline:
                raise AssertionError(f"Redis Cluster not whole after {timeout}s: {why}")
            time.sleep(0.05)

    def client(self) -> ClusterClient:
        """A redis-py cluster client on every node as a startup node."""
        return ClusterClient(
            startup_nodes=[redis.cluster.ClusterNode(HOST, n.port) for n in self.nodes if n.alive]
        )

    def slot(self, key: str) -> int:
        return int(redis.crc.key_slot(key.encode()))

    def master_of(self, key: str) -> Node:
        """The live master whose slots include the slot of ``key``, as that master says."""
        slot = self.slot(key)
        for m in self.live_masters():
            try:
                ranges = self._ask(m, "CLUSTER", "SHARDS")
            except redis.RedisError:
                continue
            if self._owns(m, ranges, slot):
                return m
        raise AssertionError(f"no live master serves slot {slot} of {key!r}")

    def _owns(self, node: Node, shards: object, slot: int) -> bool:
        """From ``CLUSTER SHARDS`` as ``node`` sees it: is ``node`` the master of ``slot``?"""
        assert isinstance(shards, list)
        for shard in shards:
            fields = _pairs(shard)
            slots = fields.get("slots") or []
            assert isinstance(slots, list)
            owned = any(int(slots[i]) <= slot <= int(slots[i + 1]) for i in range(0, len(slots), 2))
            if not owned:
                continue
            for nd in fields.get("nodes") or []:
                info = _pairs(nd)
                if int(info.get("port") or 0) == node.port and _s(info.get("role")) == "master":
                    return True
        return False

    def masters_of(self, keys: list[str]) -> dict[str, Node]:
        return {k: self.master_of(k) for k in keys}

    # ---- faults ---------------------------------------------------------------------------
    def kill(self, node: Node) -> Node:
        """kill -9 ``node`` (what a crashed host looks like to the cluster)."""
        assert node.proc is not None and node.alive, f"{node} is not running"
        node.proc.kill()
        node.proc.wait()
        node.kills += 1
        return node

    def kill_master_of(self, key: str) -> Node:
        """kill -9 the master that serves the slot of ``key``; that node."""
        return self.kill(self.master_of(key))

    def wait_failover(self, key: str, old: Node, timeout: float = 30.0) -> Node:
        """Until a node other than ``old`` (killed) serves ``key``'s slot as master and every
        live node says cluster_state:ok; the new master."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(AssertionError):
                m = self.master_of(key)
                if m is not old and all(self._state_ok(n) for n in self.nodes if n.alive):
                    return m
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"no replica took over the slot of {key!r} within {timeout}s "
                    f"(roles {self.roles()})"
                )
            time.sleep(0.05)

    def replica_of(self, master: Node) -> Node:
        """The node replicating ``master`` (its first replica, as ``INFO replication`` says)."""
        rep = self._replication(master)
        for k, v in rep.items():
            if k.startswith("slave") and isinstance(v, dict):
                port = int(v["port"])
                return next(n for n in self.nodes if n.port == port)
        raise AssertionError(f"master {master} has no replica ({rep})")

    def lag(self, master: Node) -> int:
        """Bytes of ``master``'s replication stream its replica has not confirmed: what a
        failover now would lose."""
        rep = self._replication(master)
        offsets = [int(v["offset"]) for k, v in rep.items() if k.startswith("slave")]
        assert offsets, f"master {master} has no replica ({rep})"
        return int(rep["master_repl_offset"]) - max(offsets)

    def replica_keys(self, replica: Node, key: str) -> set[bytes]:
        """The fields of hash ``key`` as a paused replica holds them (read after it is resumed,
        on a connection of its own, before anything else reaches it: a replica whose master is
        dead holds what a promotion keeps)."""
        assert replica.proc is not None
        replica.proc.send_signal(signal.SIGCONT)
        c = replica.client(5.0)
        try:
            c.execute_command("READONLY")
            return set(c.hkeys(key))
        finally:
            c.close()
            if replica.port in self.paused:
                replica.proc.send_signal(signal.SIGSTOP)

    def isolate(self, replica: Node, master: Node) -> int:
        """Cut ``replica`` off its ``master``: SIGSTOP it, then close its replication link on the
        master (CLIENT KILL TYPE replica), so that nothing the master writes from now on reaches
        it, not even through socket buffers. The master's replication offset at the cut."""
        self.pause(replica)
        c = master.client()
        try:
            c.execute_command("CLIENT", "KILL", "TYPE", "replica")
            return int(c.info("replication")["master_repl_offset"])
        finally:
            c.close()

    def offset(self, master: Node) -> int:
        """``master``'s replication offset (bytes of writes it has streamed since it began)."""
        return int(self._replication(master)["master_repl_offset"])

    def pause(self, node: Node) -> Node:
        """SIGSTOP ``node``: a replica that falls behind (its master goes on accepting writes)."""
        assert node.proc is not None and node.alive
        node.proc.send_signal(signal.SIGSTOP)
        self.paused.add(node.port)
        return node

    def resume(self, node: Node) -> Node:
        """SIGCONT a paused node."""
        assert node.proc is not None
        node.proc.send_signal(signal.SIGCONT)
        self.paused.discard(node.port)
        return node

    def restart(self, node: Node, timeout: float = 30.0) -> Node:
        """Start a killed node again on its port and dir; it rejoins (as a replica when its
        slots went to another node meanwhile)."""
        assert not node.alive, f"{node} is still running"
        self._spawn(node)
        self._wait_listening(node, timeout)
        return node

    def heal(self, timeout: float = 30.0) -> None:
        """Resume paused nodes, restart dead ones; wait until the cluster is whole (each master
        replicated)."""
        for n in self.nodes:
            if n.port in self.paused:
                self.resume(n)
        for n in self.nodes:
            if not n.alive:
                self.restart(n)
        self.wait_whole(timeout)

    def flushall(self) -> None:
        """FLUSHALL on every master (replicas follow)."""
        for m in self.live_masters():
            self._ask(m, "FLUSHALL")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
        return True


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too, both below 65536."""
    for _ in range(200):
        port = random.randrange(20000, 65536 - BUS_OFFSET)
        if _port_free(port) and _port_free(port + BUS_OFFSET):
            return port
    raise RuntimeError("no free port pair (port, port + 10000) for a cluster node")


def _s(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _pairs(flat: object) -> dict[str, object]:
    """A RESP2 flat [name, value, ...] list (or a dict) as a dict with str keys."""
    if isinstance(flat, dict):
        return {_s(k): v for k, v in flat.items()}
    assert isinstance(flat, list)
    return {_s(flat[i]): flat[i + 1] for i in range(0, len(flat), 2)}


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """The session's Redis Cluster (3 masters, 3 replicas). A test that kills nodes leaves the
    repair to the next user: `cluster` (below) heals and flushes before each test."""
    if not shutil.which("redis-server") or not shutil.which("redis-cli"):
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("redis-server / redis-cli are not installed (CI must have them)")
        pytest.skip("redis-server / redis-cli not on PATH")
    with RedisCluster() as c:
        yield c


@pytest.fixture
def cluster(redis_cluster: RedisCluster) -> RedisCluster:
    """The session cluster, whole again (dead nodes restarted, replicas online) and empty."""
    redis_cluster.heal()
    redis_cluster.flushall()
    return redis_cluster


# ---- prefixq on the cluster -----------------------------------------------------------------
class OnShard:
    """A `Placer` that sends the requests to the shards given, in turn (to put a burst on the
    masters a test picked)."""

    def __init__(self, *shards: int) -> None:
        self.shards = shards
        self.next = 0

    async def place(self, r: Any, items: list[Any], shards: int) -> list[Placed]:
        assert max(self.shards) < shards, f"shards {self.shards} of a {shards}-shard deployment"
        out = []
        for it in items:
            out.append(Placed(self.shards[self.next % len(self.shards)], it.tokens))
            self.next += 1
        return out


class ClusterFakeWorker(FakeWorker):
    """`FakeWorker` whose "serving" probe reads the heartbeat through prefixq's own client (the
    base class opens a plain client on the URL, which a multi-seed cluster URL is not)."""

    def _serving(self) -> bool:
        if self.worker is None or not self.worker.engine_up:
            return False
        c = sync_client(self.settings)
        try:
            hb = Keys(self.settings.namespace).heartbeat(self.shard, self.name)
            return bool(c.hget(hb, "engine_up") == b"1")
        except (redis.RedisError, OSError):
            return False
        finally:
            c.close()


@pytest.fixture
def cluster_settings(cluster: RedisCluster) -> Callable[..., Settings]:
    """``make(**overrides)``: settings on the (whole, empty) cluster, a fresh namespace each."""

    def make(**overrides: Any) -> Settings:
        base: dict[str, Any] = {
            "redis_url": cluster.url,
            "namespace": f"c{secrets.token_hex(4)}",
            "shards": 4,
            "gc_freeze": False,
            "heartbeat_s": 0.5,
        }
        return Settings(**(base | overrides))

    return make


@pytest.fixture
def cr(cluster: RedisCluster) -> Iterator[redis.Redis]:
    """prefixq's sync client on the cluster URL (what the CLI and the waiters use)."""
    c = sync_client(Settings(redis_url=cluster.url))
    yield c
    c.close()


@pytest.fixture
def cluster_worker() -> Iterator[Callable[..., ClusterFakeWorker]]:
    """``cluster_worker(settings, shard=..., name=..., engine=...)``: a started
    `ClusterFakeWorker`; every one built is stopped when the test ends."""
    built: list[ClusterFakeWorker] = []

    def make(settings: Settings, *, until: str = "up", **kw: Any) -> ClusterFakeWorker:
        fw = ClusterFakeWorker(settings, **kw)
        built.append(fw)
        fw.start(until=until)
        return fw

    yield make
    errors: list[BaseException] = []
    for fw in reversed(built):
        try:
            fw.stop()
        except BaseException as e:  # stop them all, then report the first failure
            errors.append(e)
    if errors:
        raise errors[0]
