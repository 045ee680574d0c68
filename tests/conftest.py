"""Shared fixtures: a private redis-server per session, settings, workers.

Real parts only: `redis_server` is a `redis-server` binary on a free port (tests may kill and
restart it); `fake_worker` builds in-process workers (the real `Worker` loop over
tests/fake_engine.py) and always stops them; `start_worker` starts `prefixq worker` processes with
the real vLLM CPU engine on the embedded model; `engines` is the session's 2-shard deployment of
two such workers. Locally a missing redis-server skips Redis tests; in CI (CI=true) it fails them.
Helpers every module shares (the CLI runner, the result waiter) are in tests/helpers.py.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from helpers import FakeWorker
from prefixq.cli.redis_server import RedisServer, free_port
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.worker.command import worker_command
from redis_cluster import cluster, cluster_settings, cluster_worker, cr, redis_cluster  # noqa: F401

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
ENGINE_START_TIMEOUT = 900


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server (AOF on) for the whole session."""
    if not shutil.which("redis-server"):
        if IN_CI:
            pytest.fail("redis-server is not installed (CI must have it)")
        pytest.skip("redis-server not on PATH")
    with RedisServer(appendonly=True) as srv:
        yield srv


@pytest.fixture
def make_settings(redis_server: RedisServer) -> Callable[..., Settings]:
    """``make_settings(**overrides)``: settings on the private server, a fresh namespace each."""

    def make(**overrides: Any) -> Settings:
        base: dict[str, Any] = {
            "redis_url": redis_server.url,
            "namespace": f"t{secrets.token_hex(4)}",
            "shards": 1,
        }
        return Settings(**(base | overrides))

    return make


@pytest.fixture
def settings(make_settings: Callable[..., Settings]) -> Settings:
    return make_settings()


@pytest.fixture
def r(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


@pytest.fixture
def fake_worker() -> Iterator[Callable[..., FakeWorker]]:
    """``fake_worker(settings, name=..., shard=..., engine=..., wrap=..., until=...)`` -> a
    started `FakeWorker` (tests/helpers.py); also a context manager that stops it on exit.
    Whatever it built is stopped (loop stopped, thread joined) when the test ends."""
    built: list[FakeWorker] = []

    def make(settings: Settings, *, until: str = "up", **overrides: Any) -> FakeWorker:
        fw = FakeWorker(settings, **overrides)
        built.append(fw)
        return fw.start(until=until)

    yield make
    errors: list[BaseException] = []
    for fw in reversed(built):
        try:
            fw.stop()
        except BaseException as e:  # stop them all, then report the first failure
            errors.append(e)
    if errors:
        raise errors[0]


@pytest.fixture(scope="session")
def model_path() -> str:
    """The embedded SmolLM2 folder (prepared once into the user cache)."""
    from prefixq.engine.embedded_model import default_cache_dir, resolve_model

    return resolve_model("", default_cache_dir())


class WorkerProc:
    """A `prefixq worker` process; `wait_up()` blocks until its engine serves."""

    def __init__(
        self, settings: Settings, shard: int, model: str, log: Path, name: str, extra: list[str]
    ) -> None:
        self.settings, self.shard, self.name, self.log = settings, shard, name, log
        fields = (
            "redis_url",
            "namespace",
            "shards",
            "claim_idle_s",
            "heartbeat_s",
            "grace_s",
            "max_attempts",
        )
        cmd = [*worker_command(settings, shard, model, name=name, fields=fields), *extra]
        self._out = open(log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def wait_up(self, timeout: float = ENGINE_START_TIMEOUT) -> WorkerProc:
        r = redis.Redis.from_url(self.settings.redis_url)
        hb = Keys(self.settings.namespace).heartbeat(self.shard, self.name)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker exited {self.proc.returncode}:\n{self.tail()}")
                if r.hget(hb, "engine_up") == b"1":
                    return self
                time.sleep(0.5)
        finally:
            r.close()
        raise RuntimeError(f"worker not up after {timeout}s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 120) -> int:
        self.signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
        finally:
            self._out.close()


@pytest.fixture(scope="session")
def start_worker(
    tmp_path_factory: pytest.TempPathFactory, model_path: str
) -> Iterator[Callable[..., WorkerProc]]:
    """``start_worker(settings, shard=0, name=..., extra=[...])`` -> a started (not yet up)
    worker process; every one is stopped at the end of the session."""
    procs: list[WorkerProc] = []
    logs = tmp_path_factory.mktemp("workers")

    def start(
        settings: Settings,
        shard: int = 0,
        name: str = "",
        extra: list[str] | None = None,
        model: str = "",
    ) -> WorkerProc:
        name = name or f"w{len(procs)}-s{shard}"
        wp = WorkerProc(
            settings, shard, model or model_path, logs / f"{name}.log", name, extra or []
        )
        procs.append(wp)
        return wp

    yield start
    stop_all(procs)


def stop_all(procs: list[WorkerProc], timeout: float = 60) -> None:
    """SIGTERM every worker at once, then wait for each: their engines shut down side by side."""
    for wp in procs:
        wp.signal(signal.SIGTERM)
    for wp in procs:
        wp.stop(timeout=timeout)


#: the session's shared workers (`engines`), once started; stopped after the last test that
#: uses them (`pytest_runtest_teardown`), not at the end of the session
_SHARED: list[WorkerProc] = []
#: node id of the last collected test that uses `engines`
_LAST_ENGINES_USER: list[str] = []


@pytest.fixture(scope="session", autouse=True)
def _engines_early(request: pytest.FixtureRequest) -> None:
    """Start the shared workers' processes with the session's first test when any selected test
    uses them: their engines build (over a minute on 2 cores) while the fast modules run
    (`pytest_collection_modifyitems` puts those first); `engines` then waits for them."""
    if _LAST_ENGINES_USER:
        request.getfixturevalue("_engines_started")


@pytest.fixture(scope="session")
def _engines_started(redis_server: RedisServer, start_worker: Callable[..., WorkerProc]) -> Any:
    s = Settings(
        redis_url=redis_server.url,
        namespace=f"cluster{secrets.token_hex(3)}",
        shards=2,
        claim_idle_s=5.0,
        heartbeat_s=1.0,
        grace_s=60.0,
    )
    ports = [free_port() for _ in range(2)]  # each serves /metrics (tests/test_grafana.py)
    workers = [
        start_worker(s, shard=k, name=f"cluster-s{k}", extra=["--metrics-port", str(ports[k])])
        for k in range(2)
    ]
    _SHARED[:] = workers

    class Cluster:
        settings = s
        metrics_ports = ports

        def __init__(self) -> None:
            self.workers = workers

    return Cluster()


@pytest.fixture(scope="session")
def engines(_engines_started: Any) -> Any:
    """The shared engine deployment of the session: a 2-shard namespace with one real vLLM CPU
    worker per shard (``.settings``, ``.workers``, ``.metrics_ports``). Tests submit their own
    bursts to it. Its workers are stopped after the last test that uses them."""
    for w in _engines_started.workers:
        w.wait_up()
    return _engines_started


def _group(items: list[pytest.Item]) -> int:
    """A module's place in the run: 0 fast; 1 uses the shared workers; 2 other real engines;
    3 slow only (fake engines, no vLLM: they run once every engine is stopped)."""
    if any("engines" in it.fixturenames for it in items):
        return 1
    if any(it.get_closest_marker("engine") for it in items):
        return 2
    return 3 if any(it.get_closest_marker("slow") for it in items) else 0


@pytest.hookimpl(trylast=True)  # after -m and -k deselected what will not run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Fast modules first, then the modules on the shared workers, then those that start engines
    of their own, then the slow fake-engine ones; each module's tests stay together and in order
    (module fixtures are built once). Notes the last test on the shared workers."""
    modules: dict[str, list[pytest.Item]] = {}
    for it in items:
        modules.setdefault(it.nodeid.split("::")[0], []).append(it)
    group = {m: _group(its) for m, its in modules.items()}
    items.sort(key=lambda it: group[it.nodeid.split("::")[0]])  # stable: order kept within
    users = [it.nodeid for it in items if "engines" in it.fixturenames]
    _LAST_ENGINES_USER[:] = users[-1:]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last test on the shared workers (its module's fixtures torn down too), stop
    them: the tests that start engines of their own run without two idle ones beside them."""
    yield
    if _SHARED and _LAST_ENGINES_USER and item.nodeid == _LAST_ENGINES_USER[0]:
        stop_all(_SHARED)
        _SHARED.clear()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The fault suite's ledger (tests/ledger.py), as the summary's last line."""
    ledger = getattr(sys.modules.get("ledger"), "LEDGER", None)
    if ledger is not None and ledger.faults:
        terminalreporter.write_line(
            f"faults injected: {ledger.faults}, requests lost: {ledger.lost}, "
            f"duplicated: {ledger.duplicated}"
        )
