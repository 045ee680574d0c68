"""Process entry points: one worker bound to a GPU (or the CPU), and a supervisor of many."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from prefixq.cli.worker_signals import WorkerSignals, start_worker
from prefixq.core.settings import Settings
from prefixq.engine.reaper import start_reaper, stop_reaper
from prefixq.worker.command import worker_command

__all__ = [
    "EXIT_CONFIG",
    "WORKER_ENGINE_ARGS",
    "metrics_exporter",
    "run_worker",
    "supervise",
    "worker_command",
]

if TYPE_CHECKING:
    from prefixq.engine.protocol import Engine
    from prefixq.integrations.metrics import MetricsExporter
    from prefixq.worker.worker import Worker

log = logging.getLogger(__name__)

#: engine arguments every worker starts its engine with (an --engine-arg overrides them):
#: "priority" orders the engine's waiting queue by priority, then arrival (with one priority:
#: first come, first served, as vLLM's default "fcfs"), so a high-priority request the worker
#: admits behind queued normal ones goes before them (docs/engine.md). Standalone engines in
#: `prefixq bench` keep vLLM's defaults.
WORKER_ENGINE_ARGS: dict[str, Any] = {"scheduling_policy": "priority"}

#: `prefixq worker` exit code for a usage or configuration error (bad flag, refused credentials):
#: the supervisor does not restart it, since a restart cannot fix it
EXIT_CONFIG = 2


def metrics_exporter(worker: Worker, port: int, *, addr: str = "0.0.0.0") -> MetricsExporter:
    """The Prometheus exporter of ``worker``, given the collaborators it reads (not registered:
    ``worker.add_middleware(...)``)."""
    from prefixq.integrations.metrics import MetricsExporter

    return MetricsExporter(
        port,
        settings=worker.settings,
        shard=worker.shard,
        name=worker.name,
        health=worker.health,
        sched=worker.sched,
        gc=worker.gc,
        loop_lag=worker.probes.loop.lag,
        fleet=worker.fleet,
        addr=addr,
    )


def run_worker(
    settings: Settings,
    shard: int,
    model: str,
    *,
    gpu: str | None = None,
    engine_args: dict[str, Any] | None = None,
    name: str = "",
    signals: WorkerSignals | None = None,
    hand_over: bool = False,
) -> int:
    """Run one worker in this process until SIGTERM/SIGINT or engine death; returns exit code.
    ``signals``: the handlers the process installed on its first line (cli/worker_signals.py:
    a stop before the worker serves exits 0 at once); installed here if not given."""
    signals = signals or WorkerSignals().install()
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu  # before vLLM/torch see any device
    from prefixq.bench.sim_engine import SimEngine, is_sim
    from prefixq.engine.pooling import engine_args_for
    from prefixq.engine.vllm_engine import VllmEngine, cpu_defaults
    from prefixq.worker.worker import Worker

    engine: Engine
    if is_sim(model):  # vLLM's scheduler on a GPU's clock (bench/sim_engine.py)
        engine = SimEngine(model, WORKER_ENGINE_ARGS | (engine_args or {}))
    else:
        args = WORKER_ENGINE_ARGS | ({} if gpu is not None else cpu_defaults())
        args |= engine_args_for(settings.task) | (engine_args or {})  # an embed worker pools
        engine = VllmEngine(model, args)

    async def main() -> int:
        from prefixq.integrations.rq_callbacks import RqCompletion
        from prefixq.integrations.webhooks import WebhookSender, configured

        worker = Worker(
            settings,
            shard,
            engine,
            name=name,
            gpu=gpu,
            middleware=[RqCompletion(settings)],
            hand_over=hand_over,
        )
        if settings.metrics_port > 0:
            worker.add_middleware(metrics_exporter(worker, settings.metrics_port))
        if configured(settings):  # the on_complete_url of bursts, with no server running
            worker.add_middleware(WebhookSender(settings))
        signals.serve(worker, asyncio.get_running_loop())
        return await worker.run()

    reaper = start_reaper()  # the engine's processes die with this one, even after kill -9
    try:
        return asyncio.run(main())
    finally:
        stop_reaper(reaper)


#: signals that stop the supervisor and its workers (a closed terminal's SIGHUP and SIGQUIT too:
#: left to their default they killed it and orphaned the workers); the workers get SIGTERM for
#: the last two (they handle SIGTERM and SIGINT)
SUPERVISOR_STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
#: a worker that served this long before it exited starts its restart count (and delay) afresh
HEALTHY_RUN_S = 60.0
#: the longest wait before a restart (the delay doubles from ``restart_delay`` per quick exit)
MAX_RESTART_DELAY_S = 60.0
_PR_SET_PDEATHSIG = 1


def _dies_with(parent: int) -> Any:
    """A ``preexec_fn``: the worker gets SIGTERM when the supervisor dies (kill -9 included: it
    drains and exits instead of serving on with no parent), or exits at once if it already has."""

    def run() -> None:
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:
            os._exit(0)

    return run


def exit_status(rc: int) -> int:
    """A child's return code as a shell reports it: killed by signal N is 128 + N, not -N."""
    return 128 - rc if rc < 0 else rc


def supervise(
    settings_args: Sequence[str],
    gpus: Sequence[str | None],
    *,
    restart_delay: float = 2.0,
    max_restarts: int = 100,
    metrics_port: int = 0,
) -> int:
    """Start ``prefixq worker`` for each GPU (shard i on gpus[i]) and restart any that exits
    non-zero (engine death, crash; not 2, a configuration error), after ``restart_delay`` doubled
    per quick exit up to `MAX_RESTART_DELAY_S`, at most ``max_restarts`` times in a row (a worker
    that served `HEALTHY_RUN_S` starts afresh). A stop (`SUPERVISOR_STOPS`) is passed on, and no
    worker is started or restarted after it, even one waiting for its restart; returns when all
    have exited: the worst exit status (128 + N for one killed by signal N).
    With ``metrics_port`` N > 0, shard i serves its metrics on port N + i."""
    procs: dict[int, subprocess.Popen[bytes]] = {}
    started: dict[int, float] = {}
    restarts = dict.fromkeys(range(len(gpus)), 0)
    stopping = False
    me = os.getpid()

    def spawn(i: int) -> None:
        cmd = [sys.executable, "-m", "prefixq", "worker", "--shard", str(i), *settings_args]
        if gpus[i] is not None:
            cmd += ["--gpu", str(gpus[i])]
        if metrics_port > 0:
            cmd += ["--metrics-port", str(metrics_port + i)]
        # a stop sent right away waits for its handlers; the worker dies with this process. The
        # worker is in procs before this process's own stops are unblocked: one that came during
        # the start (handled at the unblock) reaches it too, rather than leaving it serving
        # while this process waits for it for good
        start_worker(
            cmd, started=functools.partial(procs.__setitem__, i), preexec_fn=_dies_with(me)
        )
        started[i] = time.monotonic()
        log.info("started worker shard=%d gpu=%s pid=%d", i, gpus[i], procs[i].pid)

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        passed = signum if signum in (signal.SIGTERM, signal.SIGINT) else signal.SIGTERM
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(passed)

    for sig in SUPERVISOR_STOPS:
        signal.signal(sig, on_signal)
    for i in range(len(gpus)):
        if not stopping:
            spawn(i)
    due: dict[int, float] = {}  # shard -> when its restart is due
    failed: dict[int, int] = {}  # shard -> the exit status it is restarted after
    worst = 0
    while procs or due:
        time.sleep(0.2)
        now = time.monotonic()
        for i, when in list(due.items()):
            if stopping:  # its restart is off: it ended with its last exit
                worst = max(worst, failed[i])
                del due[i]
            elif now >= when:
                del due[i]
                spawn(i)
        for i, p in list(procs.items()):
            rc = p.poll()
            if rc is None:
                continue
            del procs[i]
            status = exit_status(rc)
            if rc < 0:
                log.error("worker shard=%d was killed by signal %d", i, -rc)
            if stopping or rc == 0:
                worst = max(worst, status)
                continue
            if rc == EXIT_CONFIG:
                log.error("worker shard=%d: configuration error (exit 2); not restarting", i)
                worst = max(worst, status)
                continue
            if now - started[i] >= HEALTHY_RUN_S:
                restarts[i] = 0
            if restarts[i] >= max_restarts:
                log.error("worker shard=%d exited %d; restart limit reached", i, status)
                worst = max(worst, status)
                continue
            restarts[i] += 1
            delay = min(restart_delay * 2 ** (restarts[i] - 1), MAX_RESTART_DELAY_S)
            log.warning(
                "worker shard=%d exited %d; restarting in %.1fs (%d)", i, status, delay, restarts[i]
            )
            due[i], failed[i] = now + delay, status
    return worst
