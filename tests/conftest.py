"""Shared fixtures: a private redis-server per session, settings, workers.

Real parts only: `redis_server` is a `redis-server` binary on a free port (tests may kill and
restart it); `fake_worker` builds in-process workers (the real `Worker` loop over
tests/fake_engine.py) and always stops them; `start_worker` starts `prefixq worker` processes with
the real vLLM CPU engine on the embedded model; `engines` is the session's 2-shard deployment of
two such workers; `server` and `client` are a `prefixq serve` process and an OpenAI client of it
(tests/openai_server.py, a plugin here). Locally a missing redis-server skips Redis tests; in CI
(CI=true) it fails them.
Helpers every module shares (the CLI runner, the result waiter) are in tests/helpers.py.
"""

from __future__ import annotations

import gc
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
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

pytest_plugins = ["openai_server"]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
#: this process's name under pytest-xdist (``gw0``...), "" when the run is not distributed
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
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
        # what the test left to the cyclic collector (a client's socket dropped when its server
        # was killed) is collected here, quietly: the worker's own collection at its warm-up
        # (worker/gc_policy.py) otherwise raised its ResourceWarning inside the worker
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()
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
        self,
        settings: Settings,
        shard: int,
        model: str,
        log: Path,
        name: str,
        extra: list[str],
        env: dict[str, str] | None = None,
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
        if "--join" in extra:  # the worker picks its shard: no --shard
            at = cmd.index("--shard")
            del cmd[at : at + 2]
        self._out = open(log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )

    def wait_up(self, timeout: float = ENGINE_START_TIMEOUT) -> WorkerProc:
        r = redis.Redis.from_url(self.settings.redis_url)
        hb = Keys(self.settings.namespace).heartbeat(self.shard, self.name)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker exited {self.proc.returncode}:\n{self.tail()}")
                try:
                    if r.hget(hb, "engine_up") == b"1":
                        return self
                except (redis.TimeoutError, redis.ConnectionError):
                    pass  # a machine busy starting engines: ask again until the deadline
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
    worker process. One started by a test is stopped when the test ends, one started by a
    module's fixture when the module ends (`_stop_workers`), the shared ones after their last
    user; any left at the end of the session then."""
    procs = _WORKERS
    logs = tmp_path_factory.mktemp("workers")

    def start(
        settings: Settings,
        shard: int = 0,
        name: str = "",
        extra: list[str] | None = None,
        model: str = "",
        env: dict[str, str] | None = None,
    ) -> WorkerProc:
        name = name or f"w{len(procs)}-s{shard}"
        wp = WorkerProc(
            settings, shard, model or model_path, logs / f"{name}.log", name, extra or [], env
        )
        procs.append(wp)
        return wp

    yield start
    stop_all(procs)


#: every worker process `start_worker` started in this session
_WORKERS: list[WorkerProc] = []


def _stop_started_since(n: int) -> None:
    """Stop the workers started since the n-th (not the shared ones: `pytest_runtest_teardown`
    stops those after their last user)."""
    stop_all([wp for wp in _WORKERS[n:] if wp not in _SHARED and wp.proc.poll() is None])


@pytest.fixture(autouse=True)
def _stop_test_workers() -> Iterator[None]:
    """Workers a test started end with it: an idle vLLM CPU engine holds ~3.4 GB, and five of
    them left running until the session's end filled the machine's memory."""
    n = len(_WORKERS)
    yield
    _stop_started_since(n)


@pytest.fixture(scope="module", autouse=True)
def _stop_module_workers() -> Iterator[None]:
    """Workers a module's fixtures started (tests/test_faults_worker.py's pair) end with it."""
    n = len(_WORKERS)
    yield
    _stop_started_since(n)


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
    (`pytest_collection_modifyitems` puts those first); `engines` then waits for them. Under
    xdist the engine modules run first on one worker, which starts them with its first test;
    the other workers never start them."""
    if _LAST_ENGINES_USER and not XDIST_WORKER:
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


@pytest.fixture(scope="session")
def engines_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The files directory of every `prefixq serve` a module starts on the shared engine
    deployment's namespace: the servers of a namespace share one (a server given another refuses
    to start: prefixq/openai/files_volume.py)."""
    return tmp_path_factory.mktemp("engines-files") / "files"


def _group(items: list[pytest.Item]) -> int:
    """A module's place in the run: 0 fast; 1 uses the shared workers; 2 other real engines;
    3 slow only (fake engines, no vLLM: they run once every engine is stopped)."""
    if any("engines" in it.fixturenames for it in items):
        return 1
    if any(it.get_closest_marker("engine") for it in items):
        return 2
    return 3 if any(it.get_closest_marker("slow") for it in items) else 0


#: the order of the groups in a distributed run (pytest-xdist, ``./dev test``): the engine
#: modules first (one work unit, the longest), then the slow fake-engine ones, then the fast ones,
#: so the long units start early and the short ones fill the other workers' gaps
_XDIST_ORDER = {1: 0, 2: 1, 3: 2, 0: 3}


def _modules(items: list[pytest.Item]) -> dict[str, list[pytest.Item]]:
    modules: dict[str, list[pytest.Item]] = {}
    for it in items:
        modules.setdefault(it.nodeid.split("::")[0], []).append(it)
    return modules


@pytest.hookimpl(trylast=True)  # after -m and -k deselected what will not run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Fast modules first, then the modules on the shared workers, then those that start engines
    of their own, then the slow fake-engine ones (in a distributed run the engine modules first,
    then the slow ones, then the fast: `_XDIST_ORDER`); each module's tests stay together and in
    order (module fixtures are built once). Notes the last test on the shared workers; an xdist
    worker also writes down which modules run engines (`EngineUnit`)."""
    modules = _modules(items)
    group = {m: _group(its) for m, its in modules.items()}
    place = _XDIST_ORDER if XDIST_WORKER else {g: g for g in _XDIST_ORDER}
    items.sort(key=lambda it: place[group[it.nodeid.split("::")[0]]])  # stable: order kept within
    users = [it.nodeid for it in items if "engines" in it.fixturenames]
    _LAST_ENGINES_USER[:] = users[-1:]
    if any(g in (1, 2) for g in group.values()):
        _quiet_resource_tracker()
    _UNITS.clear()
    _UNITS.update({m: _unit(m, g) for m, g in sorted(group.items()) if g in (1, 2)})
    if XDIST_WORKER:
        engine_units = dict(_UNITS)
        path = _engine_modules_file(os.environ["PYTEST_XDIST_TESTRUNUID"])
        tmp = path.with_name(f"{path.name}.{XDIST_WORKER}")
        tmp.write_text(json.dumps(engine_units))
        tmp.replace(path)  # every worker writes the same units


#: the engine unit of each real-engine module (`_unit`), once collected
_UNITS: dict[str, str] = {}
#: the two work units of the real-engine modules in a distributed run, and the CPU core each
#: one's engines are bound to (vLLM's CPU engine binds its threads to core 0 unless told): the
#: modules on the shared workers (they start once per xdist worker) on one, those that start
#: engines of their own on the other, side by side
_ENGINE_UNITS = {1: "engines-shared", 2: "engines-own"}
_ENGINE_CORES = {"engines-shared": "0", "engines-own": "1"}
#: modules with engines of their own that run at the end of the shared unit (its shared workers
#: stopped by then), to even the two out: measured on 2 cores (6 December 2026), the shared unit
#: took 651 s with test_reaper.py (34 s) and the other 1,198 s, the run's critical path; these
#: four (265 s) bring them to about 915 s and 870 s (docs/testing.md)
_AFTER_SHARED = frozenset(
    {
        "tests/test_reaper.py",
        "tests/test_kv_budget_vllm.py",
        "tests/test_engine_order_vllm.py",
        "tests/test_priority_engine.py",
        "tests/test_embeddings_engine.py",
    }
)


def _unit(module: str, group: int) -> str:
    return _ENGINE_UNITS[1] if module in _AFTER_SHARED else _ENGINE_UNITS[group]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """In a distributed run, before a real-engine module's fixtures start any engine: bind the
    engines this xdist worker starts to its unit's core (`_ENGINE_CORES`), unless the run was
    given a binding of its own (VLLM_CPU_OMP_THREADS_BIND) or the machine has one core."""
    unit = _UNITS.get(item.nodeid.split("::")[0])
    if not XDIST_WORKER or unit is None or (os.cpu_count() or 1) < 2:
        return
    if not _BIND_GIVEN:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = _ENGINE_CORES[unit]


#: whether the run was started with a binding of its own (then it is kept)
_BIND_GIVEN = "VLLM_CPU_OMP_THREADS_BIND" in os.environ


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last test on the shared workers (its module's fixtures torn down too), stop
    them: the tests that start engines of their own run without two idle ones beside them."""
    yield
    if _SHARED and _LAST_ENGINES_USER and item.nodeid == _LAST_ENGINES_USER[0]:
        stop_all(_SHARED)
        _SHARED.clear()


def _engine_modules_file(testrunuid: str) -> Path:
    """Where the xdist workers of run ``testrunuid`` leave the list of modules that run engines."""
    return Path(tempfile.gettempdir()) / f"prefixq-engine-modules-{testrunuid}.json"


class _Distributed:
    """The controller of a distributed run (pytest-xdist: ``./dev test`` passes ``-n``): its
    scheduler (`pytest_xdist_make_scheduler`), and the ledgers the workers hand back."""

    def __init__(self) -> None:
        self.ledgers: list[tuple[int, int, int]] = []

    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: Any) -> Any:
        """Every module a work unit of its own (module fixtures built once), and the modules
        that run a real engine in two units (`_ENGINE_UNITS`): those on the shared workers, which
        then start once, and those that start engines of their own; each unit runs on one xdist
        worker, in the serial run's order, its engines bound to a core of their own
        (`pytest_runtest_setup`), so the two sets of engines do not share a core. Units go out in
        the collection's order (`_XDIST_ORDER`: the engine units, the longest, first: xdist gives
        each worker one unit to begin with, so they start side by side). xdist's own
        ``loadgroup`` would group by a mark, but 3.8 does it by rewriting ``item._nodeid``, which
        pytest 9 no longer reads."""
        if config.getoption("dist") == "each":
            return None
        from xdist.scheduler import LoadScopeScheduling

        class EngineUnit(LoadScopeScheduling):  # type: ignore[misc]
            engine_units: dict[str, str] = {}

            def schedule(self) -> None:
                if self.collection is None and self.nodes:  # the first call: all collected
                    path = _engine_modules_file(self.nodes[0].workerinput["testrunuid"])
                    if path.is_file():
                        self.engine_units = json.loads(path.read_text())
                        path.unlink()
                    self.config.option.loadscopereorder = False  # the collection's order
                super().schedule()

            def _split_scope(self, nodeid: str) -> str:
                module = nodeid.split("::")[0]
                return self.engine_units.get(module, module)

        return EngineUnit(config, log)

    def pytest_testnodedown(self, node: Any, error: object) -> None:
        counts = getattr(node, "workeroutput", {}).get("ledger")
        if counts:
            self.ledgers.append(tuple(counts))


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist") and not XDIST_WORKER:
        config.pluginmanager.register(_Distributed(), "prefixq-distributed")


def _quiet_resource_tracker() -> None:
    """vLLM engines run inside the test process (test_e2e.py's direct AsyncLLM,
    test_body_engine.py's `VllmEngine`) force-kill their worker process when they shut down, which
    leaves its shared memory and a semaphore registered with multiprocessing's resource tracker:
    the tracker unlinks them when the test process exits, and warns about each on stderr, after
    pytest's summary. Started here first, the tracker (a process of its own, with its own warning
    filters) ignores that warning; it still unlinks what was left."""
    from multiprocessing import resource_tracker

    before = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = "ignore::UserWarning:multiprocessing.resource_tracker"
    try:
        resource_tracker.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = before


def _ledger() -> tuple[int, int, int]:
    ledger = getattr(sys.modules.get("ledger"), "LEDGER", None)
    return (ledger.faults, ledger.lost, ledger.duplicated) if ledger is not None else (0, 0, 0)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An xdist worker hands its ledger to the controller, which prints the line."""
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        out["ledger"] = _ledger()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The fault suite's ledger (tests/ledger.py), summed over the xdist workers if any, as the
    summary's last line."""
    distributed = terminalreporter.config.pluginmanager.get_plugin("prefixq-distributed")
    counts = [_ledger(), *(distributed.ledgers if distributed else [])]
    faults, lost, duplicated = (sum(c[k] for c in counts) for k in range(3))
    if faults:
        terminalreporter.write_line(
            f"faults injected: {faults}, requests lost: {lost}, duplicated: {duplicated}"
        )
