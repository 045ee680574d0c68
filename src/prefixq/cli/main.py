"""The ``prefixq`` command. Exit codes: 0 ok, 1 failure, 2 usage or configuration error.

Every `Settings` field is a flag on every subcommand (``--redis-url``, ``--max-inflight`` ...) and
an environment variable (``REDIS_URL``, ``PREFIXQ_MAX_INFLIGHT`` ...); flags win.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import get_type_hints

from redis.exceptions import RedisError

from prefixq.cli.logs import configure as configure_logging
from prefixq.core.errors import ConfigError, PrefixqError, SetupError
from prefixq.core.settings import Settings

log = logging.getLogger(__name__)


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
        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
        help="DEBUG, INFO, WARNING, ERROR (default INFO for worker, workers, demo, serve; "
        "else WARNING)",
    )
    g.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="text (default) or json: one object per line with ts, level, logger, msg",
    )
    return p


def build_parser() -> argparse.ArgumentParser:
    common = _settings_parser()
    p = argparse.ArgumentParser(prog="prefixq", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("demo", parents=[common], help="the main job on the embedded model")
    d.add_argument("--model", default="", help="HF folder (default: embedded SmolLM2-135M)")
    d.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    d.add_argument("--max-tokens", type=int, default=48)

    w = sub.add_parser("worker", parents=[common], help="serve one shard on one GPU or the CPU")
    w.add_argument("--shard", type=int, required=True)
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
    grp.add_argument("--gpus", help="comma-separated GPU indexes: shard i runs on the i-th")
    grp.add_argument("--cpu", type=int, metavar="N", help="N CPU workers (shards 0..N-1)")
    ws.add_argument("--model", default="")
    ws.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")

    s = sub.add_parser("submit", parents=[common], help="enqueue a burst from a JSONL file")
    s.add_argument("file", help="JSONL: plain lines or OpenAI batch lines ('-' = stdin)")
    s.add_argument("--wait", action="store_true", help="wait with a progress bar")
    s.add_argument("--out", help="with --wait: write results here (JSONL, input order)")
    s.add_argument("--timeout", type=float, default=None, help="with --wait: give up after S s")
    s.add_argument("--burst-id", default=None)
    s.add_argument("--token-ids", action="store_true", help="include output token ids")
    s.add_argument(
        "--format",
        choices=("prefixq", "openai"),
        default=None,
        help="with --out: result lines (prefixq) or OpenAI batch output lines (openai); default "
        "openai for an OpenAI batch file, else prefixq",
    )

    r = sub.add_parser("results", parents=[common], help="write a burst's results (JSONL)")
    r.add_argument("burst")
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
    sv.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; others need PREFIXQ_API_KEYS)",
    )
    sv.add_argument("--port", type=int, default=8000, help="port (default 8000)")

    db = sub.add_parser(
        "dashboard",
        parents=[common],
        help="the live dashboard alone (prefixq serve shows it too, beside /v1)",
    )
    db.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; others need PREFIXQ_API_KEYS)",
    )
    db.add_argument("--port", type=int, default=8000, help="port (default 8000)")

    ca = sub.add_parser(
        "cancel",
        parents=[common],
        help="cancel a burst: its unfinished requests get cancelled results",
    )
    ca.add_argument("burst")
    ca.add_argument("--json", action="store_true")

    from prefixq.bench.command import add_parser as add_bench

    add_bench(sub, common)
    i = sub.add_parser("inspect", parents=[common], help="queues, workers and burst latency")
    i.add_argument("--burst", default=None)
    i.add_argument("--json", action="store_true")
    i.add_argument("--recent", type=int, default=5, help="bursts to show (default 5)")
    i.add_argument("--watch", action="store_true", help="refresh a live view until Ctrl-C")
    i.add_argument("--interval", type=float, default=2.0, help="with --watch: seconds (default 2)")
    i.add_argument(
        "--watch-count", type=int, default=0, metavar="N", help="with --watch: stop after N views"
    )

    c = sub.add_parser(
        "check", parents=[common], help="exit 0 if a live worker serves each shard (healthcheck)"
    )
    c.add_argument("--shard", type=int, default=None, help="check this shard only")

    rc = sub.add_parser(
        "reclaim",
        parents=[common],
        help="hand entries idle on dead workers back to live ones; dead-letter those past "
        "max_attempts",
    )
    rc.add_argument("--shard", type=int, default=None, help="this shard only (default: all)")
    rc.add_argument("--idle-s", type=float, default=None, help="idle time (default claim_idle_s)")
    rc.add_argument("--json", action="store_true")

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
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    names = {f.name for f in dataclasses.fields(Settings)}
    return Settings.from_env(**{k: v for k, v in vars(args).items() if k in names})


def cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    from prefixq.cli.worker_signals import WorkerSignals

    signals = WorkerSignals().install()  # a stop before the worker serves exits 0 at once
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
    )


def cmd_workers(args: argparse.Namespace, settings: Settings, argv: Sequence[str]) -> int:
    from prefixq.cli.worker_process import supervise

    if args.gpus is None and args.cpu < 1:
        raise ConfigError(f"--cpu needs at least 1 worker, not {args.cpu}")
    gpus: list[str | None] = (
        [g.strip() for g in args.gpus.split(",") if g.strip()] if args.gpus else [None] * args.cpu
    )
    if not gpus:
        raise ConfigError("--gpus needs at least one GPU index")
    if settings.shards and settings.shards != len(gpus):
        raise ConfigError(f"--shards {settings.shards} but {len(gpus)} workers")
    passthrough = _strip_options(argv, {"--gpus", "--cpu", "--shards", "--metrics-port"})
    return supervise(
        [*passthrough, "--shards", str(len(gpus))], gpus, metrics_port=settings.metrics_port
    )


def _strip_options(argv: Sequence[str], drop: set[str]) -> list[str]:
    out: list[str] = []
    it: Iterator[str] = iter(argv[1:])  # argv[0] is the subcommand
    for a in it:
        name = a.split("=", 1)[0]
        if name in drop:
            if "=" not in a:
                next(it, None)
            continue
        out.append(a)
    return out


def cmd_submit(args: argparse.Namespace, settings: Settings) -> int:
    from prefixq.cli.progress import BurstProgress, EnqueueProgress
    from prefixq.client import Producer, results
    from prefixq.client.request_file import read_request_file
    from prefixq.integrations.rq_callbacks import RQ_ON_COMPLETE
    from prefixq.openai.outputs import input_metadata, write_results

    _check_timeout(args.timeout)
    if not args.wait and (args.out or args.timeout is not None):
        raise ConfigError("--out and --timeout go with --wait")
    if not args.out and (args.format or args.token_ids):
        raise ConfigError("--format and --token-ids go with --out")
    why = results.out_path_problem(args.out) if args.out else None
    if why:
        raise ConfigError(f"--out {args.out}: not a file in an existing folder (it {why})")
    reqs = read_request_file(args.file, settings)  # checked whole, read again as it is sent
    meta = input_metadata(args.file)
    fmt = args.format or ("openai" if meta and meta.get("input_format") == "openai" else None)
    if args.token_ids and fmt == "openai":  # refused before the burst is submitted, not after
        raise ConfigError("--token-ids goes with the prefixq format, not openai")
    with EnqueueProgress(len(reqs)) as bar:
        burst = Producer(settings, on_burst_done=RQ_ON_COMPLETE).submit(
            reqs, burst_id=args.burst_id, progress=bar.update, metadata=meta
        )
    print(f"submitted {len(reqs)} requests as burst {burst}", file=sys.stderr)
    try:
        if args.wait:
            with BurstProgress(burst) as bar:
                st = results.wait(burst, settings, timeout=args.timeout, progress=bar.update)
            if args.out:
                n = write_results(
                    burst, args.out, settings, fmt=args.format, token_ids=args.token_ids
                )
                print(f"wrote {n} results to {args.out}", file=sys.stderr)
            print(f"{st.done} done, {st.failed} failed", file=sys.stderr)
    finally:  # the id on stdout also when waiting fails (a timeout): the burst runs on
        print(burst)
    return 0


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and not timeout >= 0:  # nan too
        raise ConfigError(f"--timeout must be >= 0 seconds, not {timeout}")


def cmd_results(args: argparse.Namespace, settings: Settings) -> int:
    from prefixq.client import results
    from prefixq.openai.outputs import write_results

    _check_timeout(args.timeout)

    out = args.out or sys.stdout
    n = write_results(
        args.burst,
        out,
        settings,
        fmt=args.format,
        timeout=args.timeout,
        token_ids=args.token_ids,
    )
    if args.out:
        print(f"wrote {n} results to {args.out}", file=sys.stderr)
    missing = results.unrecorded_ids(args.burst, settings)
    if missing:
        print(
            f"prefixq: note: {missing} of its {n} results have no id (null): their request ids "
            f"were never recorded (burst {args.burst}'s producer stopped before writing them); "
            "a line's place in the output is its request's input index",
            file=sys.stderr,
        )
    return 0


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    """The OpenAI-compatible Batch API (docs/openai.md) and the dashboard (docs/dashboard.md),
    until SIGINT or SIGTERM."""
    from prefixq.dashboard.api import mount
    from prefixq.integrations.rq_callbacks import aenqueue_on_complete
    from prefixq.openai.serve import serve

    return serve(
        settings,
        host=args.host,
        port=args.port,
        on_burst_done=aenqueue_on_complete,
        extensions=[mount],
    )


def cmd_dashboard(args: argparse.Namespace, settings: Settings) -> int:
    """The dashboard (docs/dashboard.md) without the batch API, until SIGINT or SIGTERM."""
    from prefixq.dashboard.api import mount
    from prefixq.integrations.rq_callbacks import aenqueue_on_complete
    from prefixq.openai.serve import serve

    return serve(
        settings,
        host=args.host,
        port=args.port,
        on_burst_done=aenqueue_on_complete,
        batch_api=False,
        extensions=[mount],
    )


def cmd_cancel(args: argparse.Namespace, settings: Settings) -> int:
    """Cancel a burst (prefixq.store.burst_end.cancel); exit 0 also when it had finished already."""
    from prefixq.integrations.rq_callbacks import enqueue_on_complete
    from prefixq.store.burst_end import cancel

    rep = cancel(args.burst, settings, on_burst_done=enqueue_on_complete)
    if args.json:
        print(json.dumps(rep.to_json(), indent=2))
    elif rep.already_finished:
        print(f"burst {rep.burst} had already ended ({rep.status}); nothing changed")
    else:
        print(
            f"burst {rep.burst} {rep.status}: {rep.cancelled} requests cancelled, "
            f"{rep.done} done, {rep.failed} failed of {rep.total}"
        )
    return 0


def cmd_inspect(args: argparse.Namespace, settings: Settings) -> int:
    from prefixq.cli.progress import render_snapshot
    from prefixq.ops.stats import snapshot

    if args.recent < 0:
        raise ConfigError(f"--recent must be >= 0, not {args.recent}")
    if args.watch:
        return _watch(args, settings)
    snap = snapshot(settings, burst=args.burst, recent=args.recent)
    if args.json:
        print(json.dumps(snap, indent=2))
    else:
        render_snapshot(snap)
    return 0


def _watch(args: argparse.Namespace, settings: Settings) -> int:
    """``inspect --watch``: a live view until Ctrl-C (exit 0) or ``--watch-count`` views."""
    from prefixq.cli.progress import watch_snapshot
    from prefixq.ops.stats import snapshot
    from prefixq.store.connection import sync_client

    if args.json:
        raise ConfigError("--watch shows a live table; use --json without --watch")
    if not args.interval > 0 or args.watch_count < 0:  # nan too
        raise ConfigError("--interval must be > 0 and --watch-count >= 0")
    r = sync_client(settings)
    try:
        watch_snapshot(
            lambda: snapshot(settings, burst=args.burst, recent=args.recent, client=r),
            interval=args.interval,
            count=args.watch_count,
        )
    finally:
        r.close()
    return 0


def cmd_check(args: argparse.Namespace, settings: Settings) -> int:
    """Exit 0 if a live worker with its engine up serves each shard checked, else 1; one line."""
    from prefixq.ops.health import check

    health = check(settings, shard=args.shard)
    for line in health.layout:  # a Redis Cluster: its nodes and each shard's master
        print(line)
    print(health.reason, file=sys.stdout if health.ok else sys.stderr)
    return 0 if health.ok else 1


def cmd_reclaim(args: argparse.Namespace, settings: Settings) -> int:
    """Entries idle on dead consumers back to live workers; over-limit ones to dead letters."""
    from prefixq.integrations.rq_callbacks import enqueue_on_complete
    from prefixq.ops.recovery import Recovery

    if args.idle_s is not None and not args.idle_s >= 0:
        raise ConfigError(f"--idle-s must be >= 0, not {args.idle_s}")
    reports = Recovery(settings, on_burst_done=enqueue_on_complete).reclaim(args.shard, args.idle_s)
    if args.json:
        print(json.dumps([r.to_json() for r in reports], indent=2))
        return 0
    for r in reports:
        print(
            f"shard {r.shard}: moved {r.moved} back to the stream, dead-lettered {r.dead}, "
            f"left {r.live} to live workers ({r.raced} taken meanwhile, {r.gone} already gone)"
        )
    return 0


def cmd_dead(args: argparse.Namespace, settings: Settings) -> int:
    """List dead letters, or re-submit them with --requeue."""
    import time

    from prefixq.integrations.rq_callbacks import enqueue_on_complete
    from prefixq.ops.recovery import Recovery

    rec = Recovery(settings, on_burst_done=enqueue_on_complete)
    if args.requeue:
        rep = rec.requeue(args.shard, args.id or None)
        if args.json:
            print(json.dumps(rep.to_json(), indent=2))
        else:
            print(
                f"requeued {rep.requeued} (failed results taken back: {rep.cleared}); "
                f"{rep.resolved} had succeeded already (dropped); {len(rep.skipped)} skipped"
            )
        for dead_id, why in rep.skipped:
            print(f"skipped {dead_id}: {why}", file=sys.stderr)
        return 0
    if args.id:
        raise ConfigError("--id goes with --requeue")
    if args.limit < 1:
        raise ConfigError(f"--limit must be >= 1, not {args.limit}")
    letters = rec.letters(args.shard, limit=args.limit)
    if args.json:
        print(json.dumps([d.to_json() for d in letters], indent=2))
        return 0
    for d in letters:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d.at))
        where = f"{d.burst}:{d.index}" if d.burst is not None else "-"
        print(f"{d.id}  shard {d.shard}  delivered {d.delivered}  {where}  {when}  {d.reason}")
    print(f"{len(letters)} dead letters", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    default_level = (
        "INFO" if args.command in ("worker", "workers", "demo", "serve", "dashboard") else "WARNING"
    )
    configure_logging(args.log_level or default_level, args.log_format)
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
        from prefixq.store.connection import describe, is_oom, sync_client

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
    "dead": cmd_dead,
    "bench": cmd_bench,
    "demo": cmd_demo,
}


if __name__ == "__main__":
    sys.exit(main())
