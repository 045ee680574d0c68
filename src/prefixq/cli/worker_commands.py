"""``prefixq worker`` and ``prefixq workers``: one worker process on one shard, and the supervisor
of one worker process per GPU (or CPU worker). The process itself is composed in
prefixq.cli.worker_process.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import Iterator, Sequence

from prefixq.core.errors import ConfigError
from prefixq.core.settings import Settings

#: the logger the worker's start line has always come from (log queries and filters match it)
log = logging.getLogger("prefixq.cli.main")


def cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    from prefixq.cli.worker_signals import WorkerSignals

    signals = WorkerSignals().install()  # a stop before the worker serves exits 0 at once
    with contextlib.ExitStack() as stack:
        if args.join:
            from prefixq.cli.fleet_commands import joined

            args.shard = stack.enter_context(joined(settings))  # released as the worker exits
            log.info("worker joins the deployment as shard %d", args.shard)
        else:
            from prefixq.cli.fleet_commands import holding

            stack.enter_context(holding(settings, args.shard))  # no joiner takes it meanwhile
        log.info("worker shard=%d starting (pid %d)", args.shard, os.getpid())
        from prefixq.cli.worker_process import run_worker
        from prefixq.engine.embedded_model import default_cache_dir, resolve_model
        from prefixq.engine.vllm_engine import parse_engine_args

        model = resolve_model(args.model, default_cache_dir(settings.cache_dir))
        return run_worker(
            settings,
            args.shard,
            model,
            gpu=args.gpu,
            engine_args=parse_engine_args(args.engine_arg),
            name=args.name,
            signals=signals,
            hand_over=args.hand_over,
        )


def cmd_workers(args: argparse.Namespace, settings: Settings, argv: Sequence[str]) -> int:
    from prefixq.cli.worker_process import supervise

    if args.gpus is None and args.cpu < 1:
        raise ConfigError(f"--cpu needs at least 1 worker, not {args.cpu}")
    gpus: list[str | None] = (
        [None] * args.cpu
        if args.gpus is None
        else [g.strip() for g in args.gpus.split(",") if g.strip()]
    )
    if not gpus:
        raise ConfigError("--gpus needs at least one GPU index")
    for g in gpus:  # what CUDA_VISIBLE_DEVICES takes: an index or a device's UUID
        if g is not None and not (g.isdigit() or g.startswith(("GPU-", "MIG-"))):
            raise ConfigError(f"--gpus: {g!r} is not a GPU index (0, 1, ...) or a GPU-/MIG- UUID")
    if settings.shards and settings.shards != len(gpus):
        raise ConfigError(f"--shards {settings.shards} but {len(gpus)} workers")
    drop = {"--gpus", "--cpu", "--shards", "--metrics-port", "--hand-over", "--no-hand-over"}
    passthrough = _strip_options(argv, drop, flags=frozenset({"--hand-over", "--no-hand-over"}))
    hand_over = "--hand-over" if args.hand_over else "--no-hand-over"
    return supervise(
        [*passthrough, "--shards", str(len(gpus)), hand_over],
        gpus,
        metrics_port=settings.metrics_port,
    )


def _strip_options(
    argv: Sequence[str], drop: set[str], *, flags: frozenset[str] = frozenset()
) -> list[str]:
    """``argv`` past the subcommand without the options in ``drop`` (and their values; those in
    ``flags`` take none)."""
    out: list[str] = []
    it: Iterator[str] = iter(argv[1:])  # argv[0] is the subcommand
    for a in it:
        name = a.split("=", 1)[0]
        if name in drop:
            if "=" not in a and name not in flags:
                next(it, None)
            continue
        out.append(a)
    return out
