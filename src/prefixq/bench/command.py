"""The ``prefixq bench`` subcommand: flags -> `BenchConfig` -> run -> table, JSON, plot."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from prefixq.core.errors import ConfigError
from prefixq.core.settings import Settings


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    from prefixq.bench.setups import STANDALONE_KINDS

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
        "dummy:llama-3.1-8b (config only, dummy weights, token-id prompts), or "
        "sim:llama-3.1-8b (vLLM's scheduler and KV cache on an H200's modelled clock, no "
        "device: a design tool, not a measurement; bench/sim_engine.py)",
    )
    b.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    b.add_argument(
        "--workloads",
        default="no-reuse,reuse",
        help="comma-separated: no-reuse, reuse, overflow, multi-burst, multi-burst-1q, "
        "multi-burst-mixed, system-prompt, mixed, zipf (none: only the --fleet cases)",
    )
    b.add_argument(
        "--fleet",
        default="",
        help="the elastic fleet's cases, pipeline only, on the zipf workload after the "
        "workloads: steal (tail stealing off vs on, --pairs pairs), lose (a worker killed -9 at "
        "a quarter of the burst); needs two shards or more",
    )
    b.add_argument("--zipf-requests", type=int, default=1536, help="zipf: requests in all")
    b.add_argument(
        "--zipf-exponent", type=float, default=1.0, help="zipf: group size ~ 1/rank^exponent"
    )
    b.add_argument(
        "--setups",
        default="given",
        help="standalone set-ups beside the pipeline: given (always), sorted (the burst grouped "
        "by document, as a careful user hands it over), offload (vLLM's CPU KV offloading); "
        "WORKLOAD:NAME for one workload only, e.g. sorted,overflow:offload",
    )
    b.add_argument(
        "--offload-gib",
        type=float,
        default=0.0,
        help="host memory per offloading engine, GiB (default: 40%% of what is available)",
    )
    b.add_argument("--bench-placements", default="affinity,random", help="of the reuse workload")
    b.add_argument("--pairs", type=int, default=5)
    b.add_argument(
        "--orders",
        default="",
        help="other enqueue orders to measure on every workload with shared prefixes, or "
        "WORKLOAD:ORDER on one, e.g. input,system-prompt:depth-first,mixed:decode-first "
        "(every case runs in the enqueue_order setting's order too)",
    )
    b.add_argument(
        "--admissions",
        default="",
        help="the workers' admission orders to measure beside fair shares at the settings' KV "
        "budget, switched on for a case of their own: whole-groups, resident-first, kv-history "
        "(half the engine's cache for the prefixes inside it: kv_inflight_share 0.5), "
        "kv-history-30 and kv-history-70 (0.3, 0.7), kv-history-32k (32,768 tokens kept for the "
        "prefixes finished last: kv_history_tokens), kv-history-off (no budget); WORKLOAD:NAME "
        "for one workload",
    )
    b.add_argument(
        "--standalone",
        choices=STANDALONE_KINDS,
        default="process",
        help="standalone engines each in a process of its own (default), all in this one, or "
        "none: the pipeline alone (its cached prompt tokens against the optimum and fairness, no "
        "ratios; the workloads sized from the workers' engines), where a GPU cannot hold both "
        "sides' engines",
    )
    b.add_argument("--random-pairs", type=int, default=None, help="pairs for random placement")
    b.add_argument("--requests", type=int, default=64, help="no-reuse requests")
    b.add_argument(
        "--documents",
        type=int,
        default=None,
        help="documents of every workload but no-reuse (default 64; overflow and multi-burst: "
        "sized from the engines' KV capacity)",
    )
    b.add_argument("--questions", type=int, default=4, help="questions per document")
    b.add_argument(
        "--overflow",
        type=float,
        default=3.0,
        help="overflow, multi-burst: documents holding this many times the KV capacity",
    )
    b.add_argument("--burst-questions", type=int, default=2, help="multi-burst: per burst")
    b.add_argument("--burst-gap", type=float, default=3.0, help="multi-burst: s between bursts")
    b.add_argument("--bursts", type=int, default=3, help="multi-burst: bursts (one tenant each)")
    b.add_argument(
        "--burst-share",
        type=float,
        default=1.0,
        help="multi-burst: the share of the documents each burst after the first asks about",
    )
    b.add_argument(
        "--burst-priorities",
        default="",
        help="multi-burst: each burst's priority in order, e.g. normal,normal,high (a "
        "high-priority burst arriving mid-pass; missing ones: normal)",
    )
    b.add_argument(
        "--pass-off",
        default="",
        help="workloads to measure with the shared pass off too (the producer's shared_pass "
        "setting), beside the default: e.g. multi-burst",
    )
    b.add_argument("--system-prompts", type=int, default=4, help="system-prompt workload")
    b.add_argument("--system-tokens", type=int, default=2000, help="system-prompt workload")
    b.add_argument("--decode-requests", type=int, default=64, help="mixed: decode-heavy ones")
    b.add_argument("--decode-prompt-tokens", type=int, default=64, help="mixed: their prompts")
    b.add_argument("--long-output", type=int, default=512, help="mixed: decode-heavy answers")
    b.add_argument("--short-output", type=int, default=16, help="mixed: prefill-heavy answers")
    b.add_argument("--doc-tokens", type=int, default=4000)
    b.add_argument("--question-tokens", type=int, default=32)
    b.add_argument("--output-tokens", type=int, default=128)
    b.add_argument("--token-ids", action="store_true", help="prompts as random token ids")
    b.add_argument("--layout", default="", help="a note on the hardware layout, kept in the JSON")
    b.add_argument("--quick", action="store_true", help="a CI-sized run (1 pair, tiny bursts)")
    b.add_argument(
        "--plan",
        type=int,
        default=None,
        metavar="KV_TOKENS",
        help="print the cases and an estimate of their duration on engines of KV_TOKENS each "
        "(a model calibrated on one H200, bench/plan.py), start nothing",
    )
    b.add_argument("--json", dest="json_out", default=None, help="write the report here")
    b.add_argument("--plot", default=None, help="write a PNG plot here")


def run(args: argparse.Namespace, settings: Settings) -> int:
    from prefixq.bench.report import plot, table
    from prefixq.bench.runner import BenchConfig, run_bench
    from prefixq.bench.sim_engine import is_sim
    from prefixq.bench.workloads import WORKLOADS, Shape, Sizes
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
    elif is_sim(args.model):  # the simulated engine: token ids of the dummy model's vocabulary
        from prefixq.bench.dummy import VOCAB

        model, vocab, token_ids = args.model, VOCAB, True
    else:  # resolved once the flags are checked (the embedded model unpacks on first use)
        model = args.model
    shape = Shape(
        doc_tokens=args.doc_tokens,
        question_tokens=args.question_tokens,
        output_tokens=args.output_tokens,
        token_ids=token_ids,
        vocab=vocab,
    )
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip() not in ("", "none")]
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad:
        raise ConfigError(f"--workloads: unknown {', '.join(bad)} (known: {', '.join(WORKLOADS)})")
    sizes = Sizes(
        requests=args.requests,
        documents=args.documents,
        questions=args.questions,
        overflow=args.overflow,
        burst_questions=args.burst_questions,
        burst_gap=args.burst_gap,
        bursts=args.bursts,
        burst_share=args.burst_share,
        burst_priorities=_priorities(args.burst_priorities),
        system_prompts=args.system_prompts,
        system_tokens=args.system_tokens,
        decode_requests=args.decode_requests,
        decode_prompt_tokens=args.decode_prompt_tokens,
        long_output=args.long_output,
        short_output=args.short_output,
        zipf_requests=args.zipf_requests,
        zipf_exponent=args.zipf_exponent,
    )
    cfg = BenchConfig(
        model=model,
        gpus=gpus,
        engine_args=engine_args,
        workloads=workloads,
        placements=[p for p in args.bench_placements.split(",") if p],
        pairs=args.pairs,
        random_pairs=args.random_pairs or args.pairs,
        sizes=sizes,
        shape=shape,
        layout=args.layout,
        order=settings.enqueue_order,
        orders=_orders(args.orders),
        admissions=_admissions(args.admissions),
        pass_off=[w for w in args.pass_off.split(",") if w],
        standalone=args.standalone,
        setups=_setups(args.setups, args.standalone),
        offload_gib=args.offload_gib,
        fleet=_fleet(args.fleet, len(gpus)),
    )
    if args.quick:
        cfg.random_pairs = cfg.pairs = 1
        cfg.sizes = dataclasses.replace(
            sizes,
            requests=4,
            documents=args.documents or 4,
            questions=2,
            system_prompts=2,
            system_tokens=64,
            decode_requests=2,
            long_output=16,
            short_output=4,
            zipf_requests=min(args.zipf_requests, 24),
        )
        cfg.shape = Shape(
            doc_tokens=300, question_tokens=16, output_tokens=8, token_ids=token_ids, vocab=vocab
        )
    if args.plan is not None:
        from prefixq.bench.plan import estimate
        from prefixq.bench.plan import table as plan_table

        planned = estimate(cfg, args.plan, orphan_after_s=settings.orphan_after_s)
        print(plan_table(planned))
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(planned, f, indent=1)
        return 0
    if not args.model.startswith("dummy:") and not is_sim(args.model):
        cfg.model = resolve_model(args.model, default_cache_dir(settings.cache_dir))
    err = Console(stderr=True)
    with err.status("benchmark") as status:
        reaper = start_reaper()  # engines die with the benchmark, even after kill -9
        try:
            partial = _partial_writer(args.json_out)
            report = asyncio.run(
                run_bench(cfg, settings, step=lambda m: status.update(m), checkpoint=partial)
            )
        finally:
            stop_reaper(reaper)
    table(report, Console(file=sys.stderr, width=None if err.is_terminal else 160))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
        Path(args.json_out + PARTIAL).unlink(missing_ok=True)
    if args.plot:
        plot(report, args.plot)
    if not args.json_out:
        print(json.dumps(report, indent=1))
    return 0


#: the report so far, beside ``--json``'s path while the run goes on (gone once it is written)
PARTIAL = ".partial"


def _partial_writer(path: str | None) -> Callable[[dict[str, Any]], None] | None:
    """Writes the report so far to ``path`` + `PARTIAL` after each case (atomically: a run
    killed while writing leaves the previous one), so that a run cut short (a GPU machine taken
    back) keeps the cases it finished; None without ``--json``."""
    if not path:
        return None
    out = Path(path + PARTIAL)

    def write(report: dict[str, Any]) -> None:
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1, default=str))
        os.replace(tmp, out)

    return write


def _setups(raw: str, standalone: str) -> list[str]:
    from prefixq.bench.setups import GIVEN, NO_STANDALONE, parse_setups

    setups = parse_setups(raw)
    others = [x for x in setups if x.rpartition(":")[2] != GIVEN]
    if standalone == NO_STANDALONE and others:
        raise ConfigError(
            f"--setups {','.join(others)}: standalone set-ups need standalone engines "
            "(--standalone none runs the pipeline alone)"
        )
    return setups


def _fleet(raw: str, shards: int) -> list[str]:
    from prefixq.bench.fleet_cases import FLEET_CASES

    cases = [c.strip() for c in raw.split(",") if c.strip()]
    bad = [c for c in cases if c not in FLEET_CASES]
    if bad:
        raise ConfigError(f"--fleet: unknown {', '.join(bad)} (known: {', '.join(FLEET_CASES)})")
    if cases and shards < 2:
        raise ConfigError("--fleet needs two shards or more (--gpus 0,0, or --cpu 2)")
    return [c for c in FLEET_CASES if c in cases]  # lose last: it kills a worker


def _priorities(raw: str) -> tuple[str, ...]:
    from prefixq.core.sharing import PRIORITIES

    got = tuple(p.strip() for p in raw.split(",") if p.strip())
    bad = [p for p in got if p not in PRIORITIES]
    if bad:
        known = ", ".join(PRIORITIES)
        raise ConfigError(f"--burst-priorities: unknown {', '.join(bad)} (known: {known})")
    return got


def _orders(raw: str) -> list[str]:
    from prefixq.bench.setups import parse_scoped
    from prefixq.client.order import ORDERS

    return parse_scoped(raw, ORDERS, "--orders")


def _admissions(raw: str) -> list[str]:
    from prefixq.bench.setups import applies, parse_scoped
    from prefixq.worker.groups import ADMISSIONS

    items = parse_scoped(raw, tuple(ADMISSIONS), "--admissions")
    for x in items:  # one named for a workload that cannot take it
        name, _, adm = x.rpartition(":")
        if name and adm != "fair" and not applies(adm, name):
            raise ConfigError(
                f"--admissions: {name}'s requests share no prefix, so only the KV budget's "
                f"admissions apply there, not {adm}"
            )
    return items
