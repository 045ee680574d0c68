"""The ``prefixq bench`` subcommand: flags -> `BenchConfig` -> run -> table, JSON, plot."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from rich.console import Console

from prefixq.core.settings import Settings


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    b = sub.add_parser(
        "bench", parents=[common], help="pipeline vs standalone vLLM, paired finite bursts"
    )
    where = b.add_mutually_exclusive_group()
    where.add_argument("--gpus", help="GPU per shard, e.g. 0,1 (or 0,0: two engines on GPU 0)")
    where.add_argument("--cpu", type=int, default=None, metavar="N", help="N shards on the CPU")
    b.add_argument(
        "--model",
        default="",
        help="HF folder, the embedded default, or "
        "dummy:llama-3.1-8b (config only, dummy weights, token-id prompts)",
    )
    b.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    b.add_argument("--workloads", default="no-reuse,reuse")
    b.add_argument("--bench-placements", default="affinity,random")
    b.add_argument("--pairs", type=int, default=5)
    b.add_argument(
        "--orders",
        default="",
        help="other enqueue orders to measure on the reuse workload, e.g. input,leaders-first "
        "(every case runs in the enqueue_order setting's order)",
    )
    b.add_argument(
        "--standalone",
        choices=("process", "inline"),
        default="process",
        help="standalone engines each in a process of its own (default), or all in this one",
    )
    b.add_argument("--random-pairs", type=int, default=None, help="pairs for random placement")
    b.add_argument("--requests", type=int, default=64, help="no-reuse requests")
    b.add_argument("--documents", type=int, default=64, help="reuse documents")
    b.add_argument("--questions", type=int, default=4, help="reuse questions per document")
    b.add_argument("--doc-tokens", type=int, default=4000)
    b.add_argument("--question-tokens", type=int, default=32)
    b.add_argument("--output-tokens", type=int, default=128)
    b.add_argument("--token-ids", action="store_true", help="prompts as random token ids")
    b.add_argument("--layout", default="", help="a note on the hardware layout, kept in the JSON")
    b.add_argument("--quick", action="store_true", help="a CI-sized run (1 pair, tiny bursts)")
    b.add_argument("--json", dest="json_out", default=None, help="write the report here")
    b.add_argument("--plot", default=None, help="write a PNG plot here")


def run(args: argparse.Namespace, settings: Settings) -> int:
    from prefixq.bench.report import plot, table
    from prefixq.bench.runner import BenchConfig, run_bench
    from prefixq.bench.workloads import Shape
    from prefixq.engine.embedded_model import default_cache_dir, resolve_model
    from prefixq.engine.reaper import start_reaper, stop_reaper

    gpus: list[str | None] = (
        [g.strip() for g in args.gpus.split(",")] if args.gpus else [None] * (args.cpu or 1)
    )
    engine_args = list(args.engine_arg)
    vocab, token_ids = 32_000, args.token_ids
    if args.model.startswith("dummy:"):
        from prefixq.bench.dummy import VOCAB, dummy_model

        model, extra = dummy_model()
        engine_args = [f"{k}={v}" for k, v in extra.items()] + engine_args
        vocab, token_ids = VOCAB, True
    else:
        model = resolve_model(args.model, default_cache_dir(settings.cache_dir))
    shape = Shape(
        doc_tokens=args.doc_tokens,
        question_tokens=args.question_tokens,
        output_tokens=args.output_tokens,
        token_ids=token_ids,
        vocab=vocab,
    )
    cfg = BenchConfig(
        model=model,
        gpus=gpus,
        engine_args=engine_args,
        workloads=[w for w in args.workloads.split(",") if w],
        placements=[p for p in args.bench_placements.split(",") if p],
        pairs=args.pairs,
        random_pairs=args.random_pairs or args.pairs,
        no_reuse_requests=args.requests,
        reuse_documents=args.documents,
        questions=args.questions,
        shape=shape,
        layout=args.layout,
        order=settings.enqueue_order,
        orders=_orders(args.orders),
        standalone=args.standalone,
    )
    if args.quick:
        cfg.random_pairs = 1
        cfg.pairs, cfg.no_reuse_requests, cfg.reuse_documents, cfg.questions = 1, 4, 4, 2
        cfg.shape = Shape(
            doc_tokens=300, question_tokens=16, output_tokens=8, token_ids=token_ids, vocab=vocab
        )
    err = Console(stderr=True)
    with err.status("benchmark") as status:
        reaper = start_reaper()  # engines die with the benchmark, even after kill -9
        try:
            report = asyncio.run(run_bench(cfg, settings, step=lambda m: status.update(m)))
        finally:
            stop_reaper(reaper)
    table(report, Console(file=sys.stderr, width=None if err.is_terminal else 160))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        plot(report, args.plot)
    if not args.json_out:
        print(json.dumps(report, indent=1))
    return 0


def _orders(raw: str) -> list[str]:
    from prefixq.client.order import ORDERS
    from prefixq.core.errors import ConfigError

    orders = [o.strip() for o in raw.split(",") if o.strip()]
    bad = [o for o in orders if o not in ORDERS]
    if bad:
        raise ConfigError(f"--orders: unknown {', '.join(bad)} (known: {', '.join(ORDERS)})")
    return orders
