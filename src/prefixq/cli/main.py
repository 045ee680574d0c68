"""The ``prefixq`` command. Exit codes: 0 ok, 1 failure, 2 usage or configuration error.

Every `Settings` field is a flag on every subcommand (``--redis-url``, ``--max-inflight`` ...) and
an environment variable (``REDIS_URL``, ``PREFIXQ_MAX_INFLIGHT`` ...); flags win.

Here: the parser and the dispatch. The commands, by family: prefixq.cli.worker_commands
(worker, workers), prefixq.cli.burst_commands (submit, results, cancel),
prefixq.cli.serve_commands (serve, dashboard), prefixq.cli.ops_commands (inspect, check,
reclaim, dead), prefixq.cli.fleet_commands (handover, worker --join); demo and bench hand on to
prefixq.cli.demo and prefixq.bench.command.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from typing import get_type_hints

from redis.exceptions import RedisError

from prefixq.cli.burst_commands import cmd_cancel, cmd_results, cmd_submit
from prefixq.cli.fleet_commands import cmd_handover
from prefixq.cli.logs import configure as configure_logging
from prefixq.cli.ops_commands import cmd_check, cmd_dead, cmd_inspect, cmd_reclaim
from prefixq.cli.serve_commands import cmd_dashboard, cmd_serve
from prefixq.cli.worker_commands import cmd_worker, cmd_workers
from prefixq.client.submit_args import check_burst_id
from prefixq.core.errors import ConfigError, PrefixqError, SetupError, ValidationError
from prefixq.core.settings import Settings


def _burst_id(text: str) -> str:
    """A burst id argument: refused by argparse (a usage error, exit 2) unless it is one a burst
    can have (before: an id with a byte that is not UTF-8 reached Redis and ended in a
    traceback)."""
    try:
        return check_burst_id(text)
    except ValidationError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _settings_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("settings (each also an env var: REDIS_URL, PREFIXQ_<NAME>)")
    hints = get_type_hints(Settings)
    for f in dataclasses.fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        if kind is bool:
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None)
        else:
            g.add_argument(flag, dest=f.name, type=kind, default=None, metavar=f.name.upper())
    g.add_argument(
        "--log-level",
        default=None,
        type=str.upper,
        choices=LEVELS,
        help="DEBUG, INFO, WARNING, ERROR (env PREFIXQ_LOG_LEVEL; default INFO for worker, "
        "workers, demo, serve, dashboard; else WARNING)",
    )
    g.add_argument(
        "--log-format",
        choices=FORMATS,
        default=None,
        help="text (default) or json (env PREFIXQ_LOG_FORMAT): one object per line with ts, "
        "level, logger, msg",
    )
    return p


def _add_listen_args(p: argparse.ArgumentParser) -> None:
    """``--host`` and ``--port`` of a command that serves HTTP (serve, dashboard)."""
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; others need PREFIXQ_API_KEYS)",
    )
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")


def build_parser() -> argparse.ArgumentParser:
    common = _settings_parser()
    p = argparse.ArgumentParser(prog="prefixq", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("demo", parents=[common], help="the main job on the embedded model")
    d.add_argument("--model", default="", help="HF folder (default: embedded SmolLM2-135M)")
    d.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    d.add_argument("--max-tokens", type=int, default=48)

    w = sub.add_parser("worker", parents=[common], help="serve one shard on one GPU or the CPU")
    which = w.add_mutually_exclusive_group(required=True)
    which.add_argument("--shard", type=int)
    which.add_argument(
        "--join",
        action="store_true",
        help="serve the lowest shard without a live worker, or a new one (the count grows by 1)",
    )
    w.add_argument(
        "--hand-over",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="on SIGTERM: finish what is in the engine, move the rest of the queue to live "
        "shards, exit 0 (default off; on for `prefixq workers`)",
    )
    w.add_argument("--gpu", default=None, help="GPU index (sets CUDA_VISIBLE_DEVICES); none=CPU")
    w.add_argument("--model", default="", help="HF folder or name (default: embedded model)")
    w.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an AsyncEngineArgs field, repeatable (e.g. max_model_len=8192)",
    )
    w.add_argument("--name", default="", help="consumer name (default: host-shard-gpu)")

    ws = sub.add_parser("workers", parents=[common], help="one supervised worker per GPU")
    grp = ws.add_mutually_exclusive_group(required=True)
    grp.add_argument(
        "--gpus",
        help="comma-separated GPU indexes (or GPU-/MIG- UUIDs): shard i runs on the i-th listed",
    )
    grp.add_argument("--cpu", type=int, metavar="N", help="N CPU workers (shards 0..N-1)")
    ws.add_argument("--model", default="")
    ws.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    ws.add_argument(
        "--hand-over",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each worker hands its queue to live shards when it stops (default on)",
    )

    s = sub.add_parser("submit", parents=[common], help="enqueue a burst from a JSONL file")
    s.add_argument("file", help="JSONL: plain lines or OpenAI batch lines ('-' = stdin)")
    s.add_argument("--wait", action="store_true", help="wait with a progress bar")
    s.add_argument("--out", help="with --wait: write results here (JSONL, input order)")
    s.add_argument("--timeout", type=float, default=None, help="with --wait: give up after S s")
    s.add_argument("--burst-id", type=_burst_id, default=None)
    s.add_argument(
        "--on-complete-url",
        default=None,
        help="POST a signed batch.completed/cancelled/expired webhook here when the burst ends "
        "(docs/operations.md, 'Receiving webhooks')",
    )
    s.add_argument("--token-ids", action="store_true", help="include output token ids")
    s.add_argument(
        "--format",
        choices=("prefixq", "openai"),
        default=None,
        help="with --out: result lines (prefixq) or OpenAI batch output lines (openai); default "
        "openai for an OpenAI batch file, else prefixq",
    )

    r = sub.add_parser("results", parents=[common], help="write a burst's results (JSONL)")
    r.add_argument("burst", type=_burst_id)
    r.add_argument("--out", help="file (default: stdout)")
    r.add_argument("--timeout", type=float, default=None, help="wait at most S s for results")
    r.add_argument("--token-ids", action="store_true")
    r.add_argument(
        "--format",
        choices=("prefixq", "openai"),
        default=None,
        help="result lines (prefixq) or OpenAI batch output lines (openai); default openai for "
        "a burst submitted from OpenAI batch lines, else prefixq",
    )

    sv = sub.add_parser(
        "serve", parents=[common], help="an OpenAI-compatible Batch API (/v1/files, /v1/batches)"
    )
    _add_listen_args(sv)

    db = sub.add_parser(
        "dashboard",
        parents=[common],
        help="the live dashboard alone (prefixq serve shows it too, beside /v1)",
    )
    _add_listen_args(db)

    ca = sub.add_parser(
        "cancel",
        parents=[common],
        help="cancel a burst: its unfinished requests get cancelled results",
    )
    ca.add_argument("burst", type=_burst_id)
    ca.add_argument("--json", action="store_true")

    from prefixq.bench.command import add_parser as add_bench

    add_bench(sub, common)
    i = sub.add_parser("inspect", parents=[common], help="queues, workers and burst latency")
    i.add_argument("--burst", type=_burst_id, default=None)
    i.add_argument("--json", action="store_true")
    i.add_argument("--recent", type=int, default=5, help="bursts to show (default 5)")
    i.add_argument("--watch", action="store_true", help="refresh a live view until Ctrl-C")
    i.add_argument("--interval", type=float, default=2.0, help="with --watch: seconds (default 2)")
    i.add_argument(
        "--watch-count",
        type=int,
        default=0,
        metavar="N",
        help="with --watch: stop after N views (default 0: until Ctrl-C)",
    )

    c = sub.add_parser(
        "check", parents=[common], help="exit 0 if a live worker serves each shard (healthcheck)"
    )
    c.add_argument("--shard", type=int, default=None, help="check this shard only")
    c.add_argument(
        "--local",
        action="store_true",
        help="only this host's workers, on any shard: one healthy is enough (the probe of a pod "
        "running `worker --join`)",
    )
    c.add_argument(
        "--alive",
        action="store_true",
        help="a fresh heartbeat is enough, engine loading or stopping included (liveness)",
    )

    rc = sub.add_parser(
        "reclaim",
        parents=[common],
        help="hand entries idle on dead workers back to live ones; dead-letter those past "
        "max_attempts",
    )
    rc.add_argument("--shard", type=int, default=None, help="this shard only (default: all)")
    rc.add_argument("--idle-s", type=float, default=None, help="idle time (default claim_idle_s)")
    rc.add_argument("--json", action="store_true")

    ho = sub.add_parser(
        "handover",
        parents=[common],
        help="move a shard's queued work to the live shards now, whole prefix groups at a time",
    )
    ho.add_argument("--shard", type=int, required=True)
    ho.add_argument("--json", action="store_true")

    dl = sub.add_parser("dead", parents=[common], help="list (or --requeue) dead letters")
    dl.add_argument("--shard", type=int, default=None, help="this shard only (default: all)")
    dl.add_argument(
        "--requeue",
        action="store_true",
        help="re-submit them (their failed results are taken back)",
    )
    dl.add_argument(
        "--id",
        action="append",
        default=[],
        metavar="DEAD_ID",
        help="with --requeue: only this dead letter (repeatable)",
    )
    dl.add_argument("--limit", type=int, default=1000, help="list at most N per shard")
    dl.add_argument("--json", action="store_true")
    # no abbreviations: `inspect --shard 1` read as `--shards 1` (a settings flag) changed the
    # shard count in silence; an unknown flag is an error, whatever it starts like
    p.allow_abbrev = False
    for one in sub.choices.values():
        one.allow_abbrev = False
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    names = {f.name for f in dataclasses.fields(Settings)}
    return Settings.from_env(**{k: v for k, v in vars(args).items() if k in names})


LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORMATS = ("text", "json")


def _log_env(var: str, choices: Sequence[str]) -> str | None:
    """``var``'s value when set (the flag's env twin), checked as the flag's choices are."""
    raw = os.environ.get(var, "").strip()
    if not raw:
        return None
    value = raw.upper() if choices is LEVELS else raw.lower()
    if value not in choices:
        raise ConfigError(f"{var}={raw!r} must be one of {', '.join(choices)}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    default_level = (
        "INFO" if args.command in ("worker", "workers", "demo", "serve", "dashboard") else "WARNING"
    )
    try:
        level = args.log_level or _log_env("PREFIXQ_LOG_LEVEL", LEVELS) or default_level
        fmt = args.log_format or _log_env("PREFIXQ_LOG_FORMAT", FORMATS) or "text"
        configure_logging(level, fmt)
    except ConfigError as e:
        print(f"prefixq: error: {e}", file=sys.stderr)
        return 2
    try:
        settings = settings_from(args)
        if args.command == "workers":
            return cmd_workers(args, settings, argv)
        return _COMMANDS[args.command](args, settings)
    except (ConfigError, SetupError) as e:
        print(f"prefixq: error: {e}", file=sys.stderr)
        return 2
    except PrefixqError as e:
        print(f"prefixq: error: {e}", file=sys.stderr)
        return 1
    except FileNotFoundError as e:
        print(f"prefixq: error: {e.filename}: no such file", file=sys.stderr)
        return 1
    except BrokenPipeError:  # stdout's reader went away (`prefixq results B | head`): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that the flush at exit does not fail again
        return 1
    except OSError as e:  # a file that cannot be written or read: a directory, no permission
        where = f"{e.filename}: " if e.filename else ""
        print(f"prefixq: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except RedisError as e:  # what the retries did not absorb; refused credentials -> 2
        from prefixq.store.connection import sync_client
        from prefixq.store.redis_errors import describe, is_oom

        settings = settings_from(args)
        client = sync_client(settings) if is_oom(e) else None  # for its memory figures
        try:
            err = describe(settings, e, client)
        finally:
            if client is not None:
                client.close()
        print(f"prefixq: error: {err}", file=sys.stderr)
        return 2 if isinstance(err, ConfigError) else 1
    except KeyboardInterrupt:
        return 130


def cmd_bench(args: argparse.Namespace, settings: Settings) -> int:
    from prefixq.bench import command as bench

    return bench.run(args, settings)


def cmd_demo(args: argparse.Namespace, settings: Settings) -> int:
    from prefixq.cli.demo import run_demo

    return run_demo(
        settings, model=args.model, engine_args=args.engine_arg, max_tokens=args.max_tokens
    )


_COMMANDS: dict[str, Callable[[argparse.Namespace, Settings], int]] = {
    "worker": cmd_worker,
    "submit": cmd_submit,
    "results": cmd_results,
    "serve": cmd_serve,
    "dashboard": cmd_dashboard,
    "cancel": cmd_cancel,
    "inspect": cmd_inspect,
    "check": cmd_check,
    "reclaim": cmd_reclaim,
    "handover": cmd_handover,
    "dead": cmd_dead,
    "bench": cmd_bench,
    "demo": cmd_demo,
}


if __name__ == "__main__":
    sys.exit(main())
