"""``prefixq inspect``, ``check``, ``reclaim`` and ``dead``: the operator's commands over the
queues and workers (prefixq.ops: stats, health, recovery).
"""

from __future__ import annotations

import argparse
import json
import sys

from prefixq.core.errors import ConfigError
from prefixq.core.settings import Settings

#: the most bursts (`inspect --recent`) or dead letters (`dead --limit`) one listing shows
MOST_LISTED = 1_000_000
#: the longest `reclaim --idle-s` (a year; Redis's idle times are milliseconds in 64 bits)
MOST_IDLE_S = 365 * 86_400.0


def cmd_inspect(args: argparse.Namespace, settings: Settings) -> int:
    from prefixq.cli.progress import render_snapshot
    from prefixq.ops.stats import snapshot

    if not 0 <= args.recent <= MOST_LISTED:
        raise ConfigError(f"--recent must be 0 to {MOST_LISTED:,}, not {args.recent}")
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

    health = check(settings, shard=args.shard, local=args.local, alive=args.alive)
    for line in health.layout:  # a Redis Cluster: its nodes and each shard's master
        print(line)
    print(health.reason, file=sys.stdout if health.ok else sys.stderr)
    return 0 if health.ok else 1


def cmd_reclaim(args: argparse.Namespace, settings: Settings) -> int:
    """Entries idle on dead consumers back to live workers; over-limit ones to dead letters."""
    from prefixq.integrations.rq_callbacks import enqueue_on_complete
    from prefixq.ops.recovery import Recovery

    if args.idle_s is not None and not 0 <= args.idle_s <= MOST_IDLE_S:
        raise ConfigError(f"--idle-s must be 0 to {MOST_IDLE_S:,}, not {args.idle_s}")
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
    if not 1 <= args.limit <= MOST_LISTED:
        raise ConfigError(f"--limit must be 1 to {MOST_LISTED:,}, not {args.limit}")
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
