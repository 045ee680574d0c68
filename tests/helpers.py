"""What every test module shares (conftest.py turns the worker into the `fake_worker` fixture).

- `FakeWorker`: the real `Worker` loop over tests/fake_engine.py, on its own event loop in a
  thread; built, started and always stopped by the `fake_worker` fixture (or a ``with`` block);
- `cli` / `cli_argv`: the one way tests run the `prefixq` command (a real process);
- `wait_burst`: wait until a burst has all its results, or fail saying what is missing;
- `wait_until`: poll a condition, or fail naming what never happened;
- `fault_worker`: tests/fault_worker.py as a process (what kill -9 and SIGTERM tests need);
- `pending_on`, `queue_empty`, `queue_keys`, `queued_entries`, `wait_settled`, `requests`: Redis
  state (a shard's queues are its intakes and its bursts' lanes: prefixq.core.sharing) and bursts
  the
  fault tests share.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import redis

from fake_engine import FakeEngine, serve
from prefixq.core import wire
from prefixq.core.entries import Entry
from prefixq.core.keys import GROUP, Keys
from prefixq.core.records import Result
from prefixq.core.settings import Settings
from prefixq.core.sharing import PRIORITIES
from prefixq.worker.worker import Worker

TESTS = Path(__file__).resolve().parent
PY = sys.executable
T = TypeVar("T")

#: Redis errors a waiter rides out (the server being killed and restarted under it)
_REDIS_AWAY = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)


def wait_until(pred: Callable[[], T], timeout: float, what: str, every: float = 0.05) -> T:
    """Poll ``pred`` until it returns something true and return that; else fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


# ---- the fake-engine worker -----------------------------------------------------------------
class FakeWorker:
    """A real `Worker` loop (shard ``shard``, consumer ``name``) over a FakeEngine, on its own
    event loop in a daemon thread. `start()` returns once the worker serves (its heartbeat says
    engine_up, as `prefixq check` sees it); `stop()` is SIGTERM; `wait()` waits for the worker to
    exit by itself (an engine death). An exception of the worker is raised by `stop`/`wait`.

    ``wrap``: an async context manager factory the run is wrapped in (what `prefixq worker` does
    with its metrics exporter); ``until="built"`` returns from `start` as soon as the worker is
    built and wrapped, before it joins its group or starts its engine."""

    def __init__(
        self,
        settings: Settings,
        *,
        shard: int = 0,
        name: str = "fw",
        engine: FakeEngine | None = None,
        wrap: Callable[[Worker], AbstractAsyncContextManager[Any]] | None = None,
    ) -> None:
        self.settings, self.shard, self.name = settings, shard, name
        self.engine = engine if engine is not None else FakeEngine()
        self.wrap = wrap
        self.worker: Worker | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.rc: int | None = None
        self.error: BaseException | None = None
        self._raised = False
        self._thread = threading.Thread(target=self._main, name=f"fake-worker-{name}", daemon=True)

    def _main(self) -> None:
        def built(w: Worker, loop: asyncio.AbstractEventLoop) -> None:
            self.worker, self.loop = w, loop

        try:
            self.rc = asyncio.run(
                serve(
                    self.settings,
                    self.shard,
                    self.engine,
                    name=self.name,
                    wrap=self.wrap,
                    on_worker=built,
                )
            )
        except BaseException as e:  # handed to the test by start/stop/wait
            self.error = e

    def start(self, timeout: float = 30, *, until: str = "up") -> FakeWorker:
        if self._thread.ident is not None:
            return self
        self._thread.start()
        if until == "built":
            ready: Callable[[], bool] = lambda: self.worker is not None  # noqa: E731
        else:
            ready = self._serving
        wait_until(
            lambda: ready() or not self._thread.is_alive(), timeout, f"worker {self.name} up"
        )
        self._raise()
        assert self._thread.is_alive(), f"worker {self.name} exited {self.rc} before serving"
        return self

    def _raise(self) -> None:
        """The worker's exception, once (the fixture's clean-up does not report it again)."""
        if self.error is not None and not self._raised:
            self._raised = True
            raise self.error

    def _serving(self) -> bool:
        if self.worker is None or not self.worker.engine_up:
            return False
        c = redis.Redis.from_url(self.settings.redis_url)
        try:
            hb = Keys(self.settings.namespace).heartbeat(self.shard, self.name)
            return bool(c.hget(hb, "engine_up") == b"1")
        except _REDIS_AWAY:
            return False
        finally:
            c.close()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def wait(self, timeout: float = 60) -> int | None:
        """Until the worker exits by itself; its exit code."""
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"worker {self.name} still running after {timeout}s"
        self._raise()
        return self.rc

    def stop(self, timeout: float = 60) -> int | None:
        """Stop reading, drain within grace_s, exit (SIGTERM); its exit code. Idempotent."""
        if self._thread.ident is None:
            return None
        if self._thread.is_alive() and self.loop is not None and self.worker is not None:
            self.loop.call_soon_threadsafe(self.worker.stop)
        return self.wait(timeout)

    def call(self, fn: Callable[[Worker], Awaitable[T]], timeout: float = 30) -> T:
        """``await fn(worker)`` on the worker's own event loop; its result."""
        assert self.worker is not None and self.loop is not None, "worker not started"
        coro: Any = fn(self.worker)
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> FakeWorker:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


# ---- the prefixq command --------------------------------------------------------------------
def cli_argv(settings: Settings | None, *args: str, url: str = "") -> list[str]:
    """argv for ``prefixq ARGS`` against ``settings``' Redis (or ``url``) and namespace."""
    flags: list[str] = []
    if url or settings is not None:
        flags += ["--redis-url", url or (settings.redis_url if settings else "")]
    if settings is not None:
        flags += ["--namespace", settings.namespace]
    return [PY, "-m", "prefixq", *args, *flags]


def cli(
    settings: Settings | None,
    *args: str,
    url: str = "",
    stdin: str | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """Run ``prefixq ARGS`` (see `cli_argv`) to completion; its exit code, stdout and stderr."""
    return subprocess.run(
        cli_argv(settings, *args, url=url),
        capture_output=True,
        text=True,
        timeout=timeout,
        input=stdin,
        check=False,
    )


# ---- waiting for results --------------------------------------------------------------------
def wait_burst(
    r: redis.Redis, settings: Settings, burst: str, timeout: float = 60, *, n: int | None = None
) -> list[Result]:
    """Wait until ``burst`` has a result for each of its requests (``n``, default its record's
    total) and return them in input order; on timeout fail saying what is there and what is not.
    Rides out Redis being killed and restarted meanwhile."""
    keys = Keys(settings.namespace)
    deadline = time.monotonic() + timeout
    total, got = n or 0, 0
    while True:
        try:
            if n is None:
                total = int(r.hget(keys.burst(burst), "total") or 0)
            got = r.hlen(keys.results(burst))
            if total and got >= total:
                raw = r.hgetall(keys.results(burst))
                return sorted((Result.from_wire(wire.decode(v)) for v in raw.values()), key=_index)
        except _REDIS_AWAY:
            pass
        if time.monotonic() >= deadline:
            raise AssertionError(f"burst {burst}: {_state(r, settings, burst, got, total)}")
        time.sleep(0.05)


def _index(res: Result) -> int:
    return res.index


def _state(r: redis.Redis, s: Settings, burst: str, got: int, total: int) -> str:
    try:
        meta = {
            k.decode(): v.decode() for k, v in r.hgetall(Keys(s.namespace).burst(burst)).items()
        }
        shards = range(max(s.shards, 1))
        queues = ", ".join(f"shard {k}: {queue_empty(r, s, k)}" for k in shards)
    except _REDIS_AWAY as e:
        return f"{got} of {total} results; Redis unreachable ({e})"
    return (
        f"{got} of {total} results; record {meta}; (stream length, pending) {queues}"
        if meta
        else f"no burst record ({got} results)"
    )


# ---- Redis state the fault tests look at ----------------------------------------------------
def queue_keys(r: redis.Redis, s: Settings, shard: int = 0) -> list[str]:
    """Every stream of a shard's queues: its intakes (one per priority), then its lanes."""
    keys = Keys(s.namespace)
    lanes = sorted(b.decode() for b in r.hkeys(keys.lanes(shard)))
    return [*(keys.intake(shard, p) for p in PRIORITIES), *(keys.lane(shard, b) for b in lanes)]


def queued_entries(
    r: redis.Redis, s: Settings, shard: int = 0
) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """Every entry in a shard's queues (waiting or pending), intakes first."""
    return [row for key in queue_keys(r, s, shard) for row in r.xrange(key)]


def queue_empty(r: redis.Redis, s: Settings, shard: int = 0) -> tuple[int, int]:
    """(entries in the shard's queues, entries pending) of one shard."""
    length = pending = 0
    for key in queue_keys(r, s, shard):
        if not r.exists(key):
            continue
        length += r.xlen(key)
        with contextlib.suppress(redis.ResponseError):  # NOGROUP: no worker has joined
            pending += r.xpending(key, GROUP)["pending"]
    return length, pending


def wait_settled(r: redis.Redis, s: Settings, shard: int = 0, timeout: float = 10) -> None:
    """Until the shard's stream is empty and nothing is pending, while a worker still runs (it
    acknowledges an entry in a second round trip, just after recording its result: a result can
    be visible a moment before its entry is acked)."""
    deadline = time.monotonic() + timeout
    while (state := queue_empty(r, s, shard)) != (0, 0):
        if time.monotonic() >= deadline:
            raise AssertionError(f"shard {shard} not settled: (stream length, pending) = {state}")
        time.sleep(0.02)


def pending_on(r: redis.Redis, s: Settings, consumer: str, shard: int = 0) -> int:
    """Entries pending on one consumer of the shard's group, in any of its queues."""
    n = 0
    for key in queue_keys(r, s, shard):
        with contextlib.suppress(redis.ResponseError):  # NOGROUP: that worker has not joined
            n += len(r.xpending_range(key, GROUP, "-", "+", 10_000, consumername=consumer))
    return n


def requests(n: int, prompt: Callable[[int], str] = lambda i: f"hello {i}") -> list[dict[str, Any]]:
    """``n`` plain requests q0..q{n-1} (FakeEngine prompts steer faults: sleep:, fail:, die:)."""
    return [{"id": f"q{i}", "prompt": prompt(i), "max_tokens": 8} for i in range(n)]


def doc_burst(docs: int, per_doc: int) -> list[dict[str, Any]]:
    """``per_doc`` questions about each of ``docs`` documents (prefix groups), each 0.05 s in the
    FakeEngine (its ``sleep:`` starts the prefix: the engine reads it at the prompt's start, and
    the prefix comes first): a burst whose groups a fleet moves, steals and hands over."""
    return [
        {
            "id": f"d{d}q{q}",
            "prefix": f"sleep:0.05 document {d} " + "lorem ipsum " * 200,
            "prompt": f"question {q}",
            "max_tokens": 4,
        }
        for d in range(docs)
        for q in range(per_doc)
    ]


# ---- fake-engine worker processes -----------------------------------------------------------
WORKER_FLAGS = (
    "redis_url",
    "namespace",
    "shards",
    "max_attempts",
    "claim_idle_s",
    "heartbeat_s",
    "grace_s",
    "max_inflight",
)


def settings_flags(s: Settings, fields: Sequence[str] = WORKER_FLAGS) -> list[str]:
    """``--field value`` flags for ``fields`` of ``s``."""
    return [a for f in fields for a in ("--" + f.replace("_", "-"), str(getattr(s, f)))]


def fault_worker(
    s: Settings, log: Path, *args: str, mode: str = "worker"
) -> subprocess.Popen[bytes]:
    """tests/fault_worker.py as a process: a FakeEngine worker (``mode="worker"``), or the real
    supervisor over such workers (``mode="workers"``); output goes to ``log``."""
    return script_process(TESTS / "fault_worker.py", log, mode, *args, *settings_flags(s))


def control_command(s: Settings, cmd: str, workers: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Send control command ``cmd`` to ``workers`` (worker/control.py) and wait for their
    answers, from a client of its own."""
    from prefixq.store.connection import async_client
    from prefixq.worker import control

    async def send() -> dict[str, dict[str, Any]]:
        ar = async_client(s)
        try:
            return await control.send(ar, s.keys, cmd, list(workers))
        finally:
            await ar.aclose()

    return asyncio.run(send())


def script_process(script: Path, log: Path, *args: str) -> subprocess.Popen[bytes]:
    """``python script args...`` from the project's root, its output (both streams) to ``log``."""
    with open(log, "wb") as out:
        cmd = [PY, str(script), *args]
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=TESTS.parent)


def kill_tree(pid: int) -> int:
    """SIGKILL a process and all its descendants (the engine core) at once; returns how many."""
    import psutil

    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(procs, timeout=30)
    return len(procs)


def budget_entry(
    group: int | None,
    tokens: int = 100,
    up: tuple[int, int] | None = None,
    *,
    rid: str = "",
    index: int = 0,
) -> Entry:
    """An entry of burst ``b`` as the KV budget (worker/kv_budget.py) sees it: ``tokens`` of
    prompt, its ``group`` (None: a request of its own, whose key is its burst and ``index``) and
    its shared ancestor ``up`` (key, tokens)."""
    e = Entry("b", index, rid or f"r{group}", {}, None, None, {}, 0.0, 0, tokens, 0)
    e.group = group
    if up is not None:
        e.ancestor, e.ancestor_tokens = up
    return e
