"""The two sides of the comparison: standalone engines in this process, and prefixq workers.

Standalone: N vLLM `AsyncLLM` engines in the benchmark process, each bound to its GPU (or the
CPU), every request of a burst handed to its engine at once (``FINAL_ONLY`` outputs) — what a
careful user of vLLM alone would write. Pipeline: N long-lived `prefixq worker` processes with the
same engine arguments and GPU binding, fed through Redis by the real `Producer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefixq.bench.engine_set import Answered, Engines, Handed
from prefixq.bench.sim_engine import SimEngine, is_sim
from prefixq.bench.timeline import Stamp
from prefixq.core.errors import SetupError
from prefixq.core.settings import Settings
from prefixq.engine.vllm_engine import VllmEngine
from prefixq.worker import control
from prefixq.worker.command import worker_command


@contextlib.contextmanager
def _visible(gpu: str | None) -> Iterator[None]:
    """CUDA_VISIBLE_DEVICES for an engine core spawned inside the block."""
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    try:
        yield
    finally:
        if gpu is not None:
            if old is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = old


class Standalone(Engines):
    """N engines in this process."""

    def __init__(self, model: str, engine_args: dict[str, Any], gpus: list[str | None]) -> None:
        self.engines: list[VllmEngine | SimEngine] = [
            SimEngine(model, engine_args) if is_sim(model) else VllmEngine(model, engine_args)
            for _ in gpus
        ]
        self.gpus = gpus

    @property
    def kv_tokens(self) -> list[int]:
        return [e.kv_tokens for e in self.engines]

    async def start(self) -> None:
        for engine, gpu in zip(self.engines, self.gpus, strict=True):
            with _visible(gpu):
                await engine.start()

    async def _hand_over(self, handed: list[Handed]) -> tuple[float, float, list[Answered]]:
        """Every request to its engine as a task of its own."""
        t0 = time.time()

        async def one(h: Handed) -> Answered:
            if h.at > 0:
                await asyncio.sleep(max(0.0, t0 + h.at - time.time()))
            added = time.time()
            o = await self.engines[h.shard].generate(h.request)
            stamp = Stamp(added, o.first_token, time.time(), o.prompt_tokens, o.cached_tokens)
            return Answered(h.index, stamp, len(o.token_ids))

        tasks = [asyncio.create_task(one(h)) for h in handed]  # created (and added) in order
        got = list(await asyncio.gather(*tasks))
        return t0, time.time(), got

    async def reset_prefix_cache(self) -> None:
        for e in self.engines:
            await e.reset_prefix_cache()

    async def close(self) -> None:
        for e in self.engines:
            await e.close()


#: the settings every benchmark worker gets from the benchmark's own, whatever their values
FLEET_FIELDS = (
    "redis_url",
    "namespace",
    "shards",
    "heartbeat_s",
    "heartbeat_ttl_s",
    "orphan_after_s",
    "steal_min_tokens",
    "pass_window",
)
#: settings a benchmark's workers never take from it (one metrics port cannot serve N workers)
NOT_PASSED = frozenset({"metrics_port"})


def _changed(settings: Settings) -> list[str]:
    """The settings ``settings`` holds away from their defaults that a worker may take (not
    `NOT_PASSED`), in the order Settings declares them."""
    base = Settings()
    return [
        f.name
        for f in dataclasses.fields(Settings)
        if f.name not in NOT_PASSED and getattr(settings, f.name) != getattr(base, f.name)
    ]


def worker_fields(settings: Settings) -> tuple[str, ...]:
    """The settings a benchmark worker gets as flags: `FLEET_FIELDS`, and every other one the
    benchmark's settings (its flags, its environment) hold away from the default, so that
    ``prefixq bench --max-inflight 24`` reaches the workers (they got only `FLEET_FIELDS` and
    the environment: the flag was taken and ignored)."""
    return (*FLEET_FIELDS, *(f for f in _changed(settings) if f not in FLEET_FIELDS))


def changed_settings(settings: Settings) -> dict[str, Any]:
    """The settings a benchmark's workers run with away from their defaults (the report's
    ``config.worker_settings``: a run with ``--pass-running`` says so), but the namespace, which
    is the run's own."""
    return {f: getattr(settings, f) for f in _changed(settings) if f != "namespace"}


class Workers:
    """N `prefixq worker` processes, one per shard."""

    def __init__(
        self,
        settings: Settings,
        model: str,
        engine_args: list[str],
        gpus: list[str | None],
        logdir: Path,
    ) -> None:
        self.settings, self.model, self.engine_args, self.gpus = settings, model, engine_args, gpus
        self.names = [f"bench-s{k}" for k in range(len(gpus))]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs = [logdir / f"worker-{k}.log" for k in range(len(gpus))]

    async def start(self, r: Any, limit_s: float) -> None:
        """Start the workers one after another (engines profile GPU memory at start-up, so
        engines sharing a GPU must not start at the same time)."""
        for k in range(len(self.gpus)):
            self.procs.append(self._spawn(k))
            await self._wait_up(r, k, limit_s)

    def command(self, k: int) -> list[str]:
        """The command line of worker ``k`` (`worker_fields`: the benchmark's settings)."""
        return worker_command(
            self.settings,
            k,
            self.model,
            name=self.names[k],
            gpu=self.gpus[k],
            engine_args=self.engine_args,
            fields=worker_fields(self.settings),
        )

    def _spawn(self, k: int) -> subprocess.Popen[bytes]:
        cmd = self.command(k)
        with open(self.logs[k], "wb") as out:
            return subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )

    async def _wait_up(self, r: Any, k: int, limit_s: float) -> None:
        hb = self.settings.keys.heartbeat(k, self.names[k])
        deadline = time.monotonic() + limit_s
        while await r.hget(hb, "engine_up") != b"1":
            if self.procs[k].poll() is not None:
                raise SetupError(
                    f"worker {k} exited {self.procs[k].returncode}: "
                    f"{self.logs[k].read_text(errors='replace')[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise SetupError(f"worker {k} not up after {limit_s:.0f}s; see {self.logs[k]}")
            await asyncio.sleep(0.5)

    async def kv_tokens(self, r: Any) -> list[int]:
        """Each worker's engine's KV cache in tokens, as it answers ``stats`` (vLLM sizes it)."""
        stats = await control.send(r, self.settings.keys, "stats", self.names)
        return [int(stats[n].get("kv_tokens", 0)) for n in self.names]

    def kill(self, k: int) -> None:
        """SIGKILL worker ``k`` and every process under it (its engine) at once: a GPU host
        gone, nothing exits cleanly."""
        from prefixq.engine.reaper import descendants

        pid = self.procs[k].pid
        for p in [pid, *descendants(pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        self.procs[k].wait()

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(120)
            except subprocess.TimeoutExpired:
                p.kill()
