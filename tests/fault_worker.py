"""A worker process with the deterministic FakeEngine, for fault tests that need a real process.

``python tests/fault_worker.py worker --shard K [--name N] [--crash-after-record] [settings]``
runs the real `Worker` loop (signal handlers as `prefixq worker` installs them) over
tests/fake_engine.py (its `serve`, which the in-process `fake_worker` fixture runs too); it takes
every settings flag `prefixq worker` takes and exits with the same codes (0 after SIGTERM, 3 after
an engine death, 2 for a configuration error).
``--crash-after-record`` makes the first result write record its results and then die (exit 137)
before the entries are acked: a crash between the two halves of a write. ``--hold-start S``
blocks the start for S seconds before the worker is built, as vLLM's engine build blocks the
thread (SIGTERM/SIGINT are handled from the first line, as `prefixq worker` does:
prefixq.cli.worker_signals). ``--join`` and ``--hand-over`` are `prefixq worker`'s: the shard a
joining worker takes (it logs "joins the deployment as shard K"), and its queue handed over as it
stops; ``--hold-join S`` blocks S seconds after the join, or after a ``--shard K`` worker's hold
on its shard (an engine's build), ``--fail-start`` then fails the start (an engine that does not
come up: exit 1).

``python tests/fault_worker.py workers --cpu N [settings]`` runs the real supervisor
(`prefixq.cli.worker_process.supervise`, as `prefixq workers` does) over such worker processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
from typing import Any

from fake_engine import serve
from prefixq.cli.fleet_commands import holding, joined
from prefixq.cli.main import _settings_parser, settings_from
from prefixq.cli.worker_process import supervise
from prefixq.cli.worker_signals import WorkerSignals
from prefixq.core.errors import ConfigError
from prefixq.worker.shard import ShardStream

CRASH_EXIT = 137
log = logging.getLogger("fault_worker")


def crash_after_record() -> None:
    """Patch the stream protocol: the first group of results is recorded (Lua), and the worker
    dies before the ack."""

    async def crashing(self: ShardStream, batch: Any) -> None:
        print(f"fault_worker: recorded {len(batch)} results, crashing before the ack", flush=True)
        os._exit(CRASH_EXIT)

    ShardStream.ack = crashing  # type: ignore[method-assign]


def worker(argv: list[str]) -> int:
    signals = WorkerSignals().install()  # as `prefixq worker` does, on its first line
    p = argparse.ArgumentParser(parents=[_settings_parser()])
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--name", default="")
    p.add_argument("--crash-after-record", action="store_true")
    p.add_argument("--hold-start", type=float, default=0.0, metavar="S")
    p.add_argument("--join", action="store_true")
    p.add_argument("--hold-join", type=float, default=0.0, metavar="S")
    p.add_argument("--fail-start", action="store_true")
    p.add_argument("--hand-over", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=args.log_level or "INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.crash_after_record:
        crash_after_record()

    log.info("worker shard=%d starting (pid %d)", args.shard, os.getpid())
    if args.hold_start:  # a start-up that takes this long, blocking the thread (an engine's)
        time.sleep(args.hold_start)
    try:
        s = settings_from(args)
        with contextlib.ExitStack() as stack:
            if args.join:
                args.shard = stack.enter_context(joined(s))
                log.info("worker joins the deployment as shard %d", args.shard)
            else:  # as `prefixq worker --shard K` does: no joiner takes it while it starts
                stack.enter_context(holding(s, args.shard))
            if args.hold_join:  # an engine start after the join, blocking the thread
                time.sleep(args.hold_join)
            if args.fail_start:
                raise RuntimeError("fault_worker: the engine failed to start")
            return asyncio.run(
                serve(
                    s, args.shard, name=args.name, on_worker=signals.serve, hand_over=args.hand_over
                )
            )
    except ConfigError as e:
        print(f"prefixq: error: {e}", file=sys.stderr)
        return 2


def workers(argv: list[str]) -> int:
    """The real supervisor, spawning this script's ``worker`` instead of ``prefixq worker``."""
    p = argparse.ArgumentParser()
    p.add_argument("--cpu", type=int, required=True)
    args, rest = p.parse_known_args(argv)
    popen = subprocess.Popen

    def spawn(cmd: list[str], *a: Any, **kw: Any) -> Any:
        i = cmd.index("prefixq")
        assert cmd[i - 1 : i + 2] == ["-m", "prefixq", "worker"], cmd
        return popen([*cmd[: i - 1], os.path.abspath(__file__), "worker", *cmd[i + 2 :]], *a, **kw)

    subprocess.Popen = spawn  # type: ignore[misc,assignment]
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return supervise([*rest, "--shards", str(args.cpu)], [None] * args.cpu, restart_delay=0.5)


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    sys.exit(worker(rest) if mode == "worker" else workers(rest))
