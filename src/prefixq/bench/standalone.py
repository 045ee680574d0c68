"""Standalone vLLM, one process per engine: the baseline a careful user of vLLM alone would run.

Each engine lives in a process of its own (bound to its GPU), as ``vllm serve`` or an offline
script per GPU would, so that no engine shares an event loop or a Python interpreter with
another. A run: every process is first sent its share of the burst (off the clock), then told
to go; each hands every request to its engine at once (``FINAL_ONLY`` outputs), or each at its
arrival when the workload has several bursts (multi-burst: a burst's requests are added when it
arrives), and reports when each was added, its first token, its end and its tokens. The run
starts when the parent says go and ends when the last process reports its last request done (one
host, one clock).

`bench.engines.Standalone` keeps every engine in the benchmark's own process (``--standalone
inline``: how runs before 2026-11-30 measured, kept for comparison).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from typing import Any

from prefixq.bench.engine_set import Answered, Engines, Handed
from prefixq.bench.timeline import Stamp
from prefixq.core.errors import SetupError
from prefixq.engine.protocol import EngineRequest


def _serve(conn: Connection, model: str, engine_args: dict[str, Any], gpu: str | None) -> None:
    """The engine process: commands in, answers out, until ``close``."""
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu  # before vLLM or torch see a device
    asyncio.run(_loop(conn, model, engine_args))


async def _loop(conn: Connection, model: str, engine_args: dict[str, Any]) -> None:
    from prefixq.bench.sim_engine import SimEngine, is_sim
    from prefixq.engine.vllm_engine import VllmEngine

    engine = SimEngine(model, engine_args) if is_sim(model) else VllmEngine(model, engine_args)
    await engine.start()
    conn.send(("up", engine.kv_tokens))
    loaded: list[tuple[int, float, EngineRequest]] = []
    while True:
        cmd, *args = await asyncio.to_thread(conn.recv)
        if cmd == "load":
            loaded = args[0]
            conn.send(("loaded",))
        elif cmd == "go":
            conn.send(("done", *await _run(engine, loaded)))
        elif cmd == "reset":
            await engine.reset_prefix_cache()
            conn.send(("ok",))
        else:  # close
            await engine.close()
            conn.send(("closed",))
            return


async def _run(
    engine: Any, reqs: list[tuple[int, float, EngineRequest]]
) -> tuple[float, list[tuple[Any, ...]]]:
    """Every request handed to the engine at its arrival (seconds after go; all at once for 0),
    in the order given; one row per request, with its index in the burst."""
    t0 = time.time()

    async def one(i: int, er: EngineRequest) -> tuple[Any, ...]:
        added = time.time()
        o = await engine.generate(er)
        return (i, added, o.first_token, time.time(), o.prompt_tokens, o.cached_tokens,
                len(o.token_ids), er.sampling.get("max_tokens"))  # fmt: skip

    async def arrive(at: float, group: list[tuple[int, EngineRequest]]) -> list[tuple[Any, ...]]:
        await asyncio.sleep(max(0.0, t0 + at - time.time()))
        tasks = [asyncio.create_task(one(i, er)) for i, er in group]  # added in this order
        return list(await asyncio.gather(*tasks))

    by_time: dict[float, list[tuple[int, EngineRequest]]] = {}
    for i, at, er in reqs:
        by_time.setdefault(at, []).append((i, er))
    first = [asyncio.create_task(one(i, er)) for i, er in by_time.pop(0.0, [])]  # at once
    later = [arrive(at, group) for at, group in sorted(by_time.items())]
    got = list(await asyncio.gather(*first)) + [r for g in await asyncio.gather(*later) for r in g]
    return time.time(), got


class ProcessStandalone(Engines):
    """N engines, each in a process of its own."""

    def __init__(self, model: str, engine_args: dict[str, Any], gpus: list[str | None]) -> None:
        self.model, self.engine_args, self.gpus = model, engine_args, gpus
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._kv_tokens: list[int] = []

    @property
    def kv_tokens(self) -> list[int]:
        return self._kv_tokens

    async def start(self) -> None:
        """Start the engines one after another (engines sharing a GPU profile its memory)."""
        ctx = mp.get_context("spawn")
        for gpu in self.gpus:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(child, self.model, self.engine_args, gpu))
            p.start()
            self._procs.append(p)
            self._conns.append(parent)
            up = await self._expect(len(self._conns) - 1, "up")
            self._kv_tokens.append(int(up[1]))

    async def _expect(self, k: int, what: str) -> tuple[Any, ...]:
        conn, proc = self._conns[k], self._procs[k]
        while not await asyncio.to_thread(conn.poll, 1.0):
            if not proc.is_alive():
                raise SetupError(f"standalone engine {k} exited {proc.exitcode}")
        msg: tuple[Any, ...] = conn.recv()
        if msg[0] != what:
            raise SetupError(f"standalone engine {k}: expected {what!r}, got {msg[0]!r}")
        return msg

    async def _hand_over(self, handed: list[Handed]) -> tuple[float, float, list[Answered]]:
        """Every process is sent its share (off the clock), then told to go; the run ends with
        the last process's last request."""
        share: list[list[tuple[int, float, EngineRequest]]] = [[] for _ in self._conns]
        for h in handed:
            share[h.shard].append((h.index, h.at, h.request))
        for k, conn in enumerate(self._conns):
            conn.send(("load", share[k]))
            await self._expect(k, "loaded")
        t0 = time.time()
        for conn in self._conns:
            conn.send(("go",))
        done = [await self._expect(k, "done") for k in range(len(self._conns))]
        t1 = max(d[1] for d in done)
        return t0, t1, [Answered(row[0], Stamp(*row[1:6]), row[6]) for d in done for row in d[2]]

    async def reset_prefix_cache(self) -> None:
        for k, conn in enumerate(self._conns):
            conn.send(("reset",))
            await self._expect(k, "ok")

    async def close(self) -> None:
        for k, conn in enumerate(self._conns):
            if self._procs[k].is_alive():
                conn.send(("close",))
                with contextlib.suppress(SetupError, EOFError, OSError):
                    await self._expect(k, "closed")
        for p in self._procs:
            p.join(30)
            if p.is_alive():
                p.kill()
