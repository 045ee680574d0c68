"""Process entry points: one worker bound to a GPU (or the CPU), and a supervisor of many."""

from __future__ import annotations

import asyncio
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
    from prefixq.engine.pooling import engine_args_for
    from prefixq.engine.vllm_engine import VllmEngine, cpu_defaults
    from prefixq.worker.worker import Worker

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


def supervise(
    settings_args: Sequence[str],
    gpus: Sequence[str | None],
    *,
    restart_delay: float = 2.0,
    max_restarts: int = 100,
    metrics_port: int = 0,
) -> int:
    """Start ``prefixq worker`` for each GPU (shard i on gpus[i]) and restart any that exits
    non-zero (engine death, crash; not 2, a configuration error). SIGTERM/SIGINT are passed on;
    returns when all have exited.
    With ``metrics_port`` N > 0, shard i serves its metrics on port N + i."""
    procs: dict[int, subprocess.Popen[bytes]] = {}
    restarts = dict.fromkeys(range(len(gpus)), 0)
    stopping = False

    def spawn(i: int) -> None:
        cmd = [sys.executable, "-m", "prefixq", "worker", "--shard", str(i), *settings_args]
        if gpus[i] is not None:
            cmd += ["--gpu", str(gpus[i])]
        if metrics_port > 0:
            cmd += ["--metrics-port", str(metrics_port + i)]
        procs[i] = start_worker(cmd)  # a stop sent right away waits for its handlers
        log.info("started worker shard=%d gpu=%s pid=%d", i, gpus[i], procs[i].pid)

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for i in range(len(gpus)):
        spawn(i)
    worst = 0
    while procs:
        time.sleep(0.5)
        for i, p in list(procs.items()):
            rc = p.poll()
            if rc is None:
                continue
            del procs[i]
            if stopping or rc == 0:
                worst = max(worst, rc)
                continue
            if rc == EXIT_CONFIG:
                log.error("worker shard=%d: configuration error (exit 2); not restarting", i)
                worst = max(worst, rc)
                continue
            if restarts[i] >= max_restarts:
                log.error("worker shard=%d exited %d; restart limit reached", i, rc)
                worst = max(worst, rc)
                continue
            restarts[i] += 1
            log.warning("worker shard=%d exited %d; restarting (%d)", i, rc, restarts[i])
            time.sleep(restart_delay)
            spawn(i)
    return worst
