"""``prefixq submit``, ``results`` and ``cancel``: the commands on one burst, from the JSONL file
it is submitted from to the results written back and its cancellation.
"""

from __future__ import annotations

import argparse
import json
import sys

from prefixq.core.errors import ConfigError, ValidationError
from prefixq.core.settings import Settings


def cmd_submit(args: argparse.Namespace, settings: Settings) -> int:
    from prefixq.cli.progress import BurstProgress, EnqueueProgress
    from prefixq.client import Producer, results
    from prefixq.client.out_file import out_path_problem
    from prefixq.client.request_file import read_request_file
    from prefixq.core.webhooks import check_url
    from prefixq.integrations.rq_callbacks import RQ_ON_COMPLETE
    from prefixq.openai.outputs import input_metadata, write_results

    _check_timeout(args.timeout)
    if not args.wait and (args.out or args.timeout is not None):
        raise ConfigError("--out and --timeout go with --wait")
    if not args.out and (args.format or args.token_ids):
        raise ConfigError("--format and --token-ids go with --out")
    if args.on_complete_url is not None:  # a usage error, before the file is read
        try:
            check_url(args.on_complete_url, "--on-complete-url")
        except ValidationError as e:
            raise ConfigError(str(e)) from None
    why = out_path_problem(args.out) if args.out else None
    if why:
        raise ConfigError(f"--out {args.out}: the results cannot be written there (it {why})")
    reqs = read_request_file(args.file, settings)  # checked whole, read again as it is sent
    meta = input_metadata(args.file)
    fmt = args.format or ("openai" if meta and meta.get("input_format") == "openai" else None)
    if args.token_ids and fmt == "openai":  # refused before the burst is submitted, not after
        raise ConfigError("--token-ids goes with the prefixq format, not openai")
    with EnqueueProgress(len(reqs)) as bar:
        burst = Producer(settings, on_burst_done=RQ_ON_COMPLETE).submit(
            reqs,
            burst_id=args.burst_id,
            progress=bar.update,
            metadata=meta,
            on_complete_url=args.on_complete_url,
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
    from prefixq.client.out_file import out_path_problem
    from prefixq.openai.outputs import write_results

    _check_timeout(args.timeout)
    why = out_path_problem(args.out) if args.out else None
    if why:  # before waiting for the results, not after
        raise ConfigError(f"--out {args.out}: the results cannot be written there (it {why})")

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
