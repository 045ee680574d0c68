"""`prefixq bench`: standalone engines vs the pipeline, in paired runs, in one process.

Engines start once and stay warm: the standalone set-ups' engines (bench/setups.py: the burst as
given and sorted by its user share engines; CPU KV offloading has engines of its own) and one
`prefixq worker` per shard. After start-up the engines' KV capacity is read (vLLM sizes it) and
sizes the overflow workloads (bench/workloads.py). Each workload runs as cases (bench/cases.py):
a placement and an enqueue order, in pairs that rotate which mode goes first. One `Producer`
submits every pipeline run over one kept connection, as an upstream service would. Throughput =
requests / seconds from the first enqueue (or engine call) to the last result; every run also
records a timeline (bench/timeline.py), cached prompt tokens against the workload's optimum
(bench/measures.py) and, for several bursts, how evenly they were served. ``orders`` measures
other enqueue orders (client/order.py) on workloads whose requests share prefixes, each against
one standalone set-up only (sorted when measured, else as given: the standalone runs do not
depend on the pipeline's order), to spare the time of the others.
"""

from __future__ import annotations

import logging
import secrets
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prefixq.bench.cases import Bursts, Env, by_gen, pipeline, reset, run_case
from prefixq.bench.engine_set import Engines
from prefixq.bench.engines import Standalone, Workers, changed_settings
from prefixq.bench.environment import environment
from prefixq.bench.fleet_cases import run_fleet
from prefixq.bench.setups import (
    GIVEN,
    NO_STANDALONE,
    OFFLOAD,
    SORTED,
    admissions_for,
    host_offload_gib,
    offload_args,
    offload_unsupported,
    one_setup,
    scoped,
    setups_for,
)
from prefixq.bench.sim_engine import is_sim
from prefixq.bench.standalone import ProcessStandalone
from prefixq.bench.workloads import SHARING, Counter, Shape, Sizes, build
from prefixq.client import Producer
from prefixq.core.errors import ConfigError, SetupError
from prefixq.core.inputs import normalize
from prefixq.core.settings import DEFAULT_ORDER, Settings
from prefixq.store.connection import async_client
from prefixq.worker import control

log = logging.getLogger(__name__)

#: workloads whose runs also measure the workers without gc.freeze (one run each)
_GC_WORKLOADS = ("no-reuse", "reuse")


@dataclass
class BenchConfig:
    """What to run; the CLI fills it from flags."""

    model: str
    gpus: list[str | None]
    engine_args: list[str] = field(default_factory=list)
    workloads: list[str] = field(default_factory=lambda: ["no-reuse", "reuse"])
    #: placements of the reuse workload (every other workload: affinity)
    placements: list[str] = field(default_factory=lambda: ["affinity", "random"])
    pairs: int = 5
    #: pairs for the random placement (its runs only measure the affinity gain)
    random_pairs: int = 5
    sizes: Sizes = field(default_factory=Sizes)
    shape: Shape = field(default_factory=Shape)
    layout: str = ""
    start_timeout: float = 1200.0
    #: the enqueue order of every case (the producer's default: settings' enqueue_order)
    order: str = DEFAULT_ORDER
    #: other enqueue orders measured on workloads whose requests share prefixes (NAME: every
    #: such workload, WORKLOAD:NAME: that one)
    orders: list[str] = field(default_factory=list)
    #: standalone engines in processes of their own ("process") or in this one ("inline")
    standalone: str = "process"
    #: the workers' admission orders measured beside the default (worker/groups.py: whole-groups,
    #: resident-first; NAME or WORKLOAD:NAME), each switched on for its case by control command
    admissions: list[str] = field(default_factory=list)
    #: workloads measured with the producers' shared pass off too (client/shared_pass.py)
    pass_off: list[str] = field(default_factory=list)
    #: the standalone set-ups (bench/setups.py; NAME or WORKLOAD:NAME); "given" always
    setups: list[str] = field(default_factory=lambda: [GIVEN])
    #: GiB of host memory per offloading engine; 0 = what the host can give (host_offload_gib)
    offload_gib: float = 0.0
    #: the elastic fleet's cases (bench/fleet_cases.py: steal, lose), on the zipf workload, after
    #: the workloads; pipeline only
    fleet: list[str] = field(default_factory=list)

    @property
    def standalone_engines(self) -> bool:
        """Whether the run starts standalone engines: not for the fleet's cases alone (no
        workload), nor with ``--standalone none`` (the pipeline's runs only)."""
        return bool(self.workloads) and self.standalone != NO_STANDALONE


Step = Callable[[str], None]


async def run_bench(
    cfg: BenchConfig,
    settings: Settings,
    step: Step | None = None,
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run every workload and pair; returns the report (see docs/BENCHMARKS.md).
    ``checkpoint`` gets the report so far after each case (and the engines' start)."""
    from prefixq.engine.vllm_engine import cpu_defaults, parse_engine_args

    say = step or (lambda _msg: None)
    ns = f"{settings.namespace[:40]}-bench-{secrets.token_hex(3)}"  # within the 64-char limit
    shards = len(cfg.gpus)
    s = settings.replace(namespace=ns, shards=shards, enqueue_order=cfg.order)
    cpu = all(g is None for g in cfg.gpus) and not is_sim(cfg.model)
    args = (cpu_defaults() if cpu else {}) | parse_engine_args(cfg.engine_args)
    worker_args = [f"{k}={v}" for k, v in args.items()]
    r = async_client(s)
    logdir = Path(tempfile.mkdtemp(prefix="prefixq-bench-"))
    alone = cfg.standalone_engines
    sides = " and the standalone engines" if alone else ""
    say(f"starting {shards} workers{sides} (logs in {logdir})")
    workers = Workers(s, cfg.model, worker_args, cfg.gpus, logdir)
    engines: dict[str, Engines] = {GIVEN: _engines(cfg, args)} if alone else {}
    report: dict[str, Any] = {
        "config": {**_config(cfg, args), "worker_settings": changed_settings(s)},
        "environment": environment(cfg.model, cfg.gpus, cfg.layout),
        "workloads": {},
    }
    env_ = report["environment"]
    try:
        t0 = time.monotonic()
        capacity = 0
        if GIVEN in engines:
            await engines[GIVEN].start()
            env_["kv_tokens"] = {"standalone": engines[GIVEN].kv_tokens}
            capacity = sum(engines[GIVEN].kv_tokens)
            wanted = {x for wl in cfg.workloads for x in setups_for(cfg.setups, wl)}
            if SORTED in wanted:
                engines[SORTED] = engines[GIVEN]
            if OFFLOAD in wanted:
                await _start_offload(cfg, args, engines, env_, say)
            say("standalone engines up; starting the workers")
        await workers.start(r, cfg.start_timeout)
        if cfg.workloads and not alone:  # the workloads sized from the workers' engines
            env_["kv_tokens"] = {"workers": await workers.kv_tokens(r)}
            capacity = sum(env_["kv_tokens"]["workers"])
        env_["engine_start_s"] = round(time.monotonic() - t0, 1)
        block = int(await r.hget(s.keys.config, "block_size") or 16)
        counter = None if cfg.shape.token_ids else _counter(cfg.model)
        async with Producer(s) as producer:
            env = Env(s, r, engines, workers, producer, say, block)
            if checkpoint is not None:
                env.saved = lambda: checkpoint(report)
                env.ran = lambda label, runs: _unfinished(report, label, runs, checkpoint)
                env.saved()
            into = report["workloads"]
            for wl in cfg.workloads:
                into[wl] = await _workload(cfg, env, wl, capacity, counter, into)
                env.saved()
            if cfg.fleet:
                zipf = build("zipf", cfg.shape, cfg.sizes, count=counter)
                report["fleet"] = await run_fleet(env, zipf, cfg.fleet, cfg.pairs)
    finally:
        workers.stop()
        for e in {id(e): e for e in engines.values()}.values():
            await e.close()
        await r.aclose()
    return report


def _engines(cfg: BenchConfig, args: dict[str, Any]) -> Engines:
    if cfg.standalone == "process":
        return ProcessStandalone(cfg.model, args, cfg.gpus)
    return Standalone(cfg.model, args, cfg.gpus)


async def _start_offload(
    cfg: BenchConfig,
    args: dict[str, Any],
    engines: dict[str, Engines],
    env: dict[str, Any],
    say: Step,
) -> None:
    """Start the offloading set-up's engines; a vLLM (or a platform) that cannot offload is
    recorded in the report (``offload``) and the set-up left out, not the whole run."""
    why = offload_unsupported()
    gib = cfg.offload_gib or host_offload_gib(len(cfg.gpus))
    env["offload"] = {"gib_per_engine": gib, "backend": "native"}
    if why is None:
        say(f"starting the offloading engines ({gib} GiB of host memory each)")
        eng = _engines(cfg, offload_args(args, gib))
        try:
            await eng.start()
        except (SetupError, ConfigError) as e:
            why = f"start-up failed: {e}"
            await eng.close()
        else:
            engines[OFFLOAD] = eng
            env["kv_tokens"]["standalone-offload"] = eng.kv_tokens
    if why is not None:
        log.warning("standalone with CPU offloading left out: %s", why)
        env["offload"]["unavailable"] = why
        cfg.setups = [x for x in cfg.setups if x.rpartition(":")[2] != OFFLOAD]


def _counter(model: str) -> Counter | None:
    """Counts prompt tokens as the engine will (text mode), with the model's own tokenizer;
    None when the model folder has none (the optimum is then estimated)."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    except Exception as e:  # no tokenizer files, or no transformers: estimate instead
        log.warning("no tokenizer in %s (%s): the cached-token optimum is estimated", model, e)
        return None

    def count(x: Any) -> int:
        if isinstance(x, list):  # leading messages, rendered as the worker renders a chat
            text = tok.apply_chat_template(x, tokenize=False)
            return len(tok(text, add_special_tokens=False).input_ids)
        return len(tok(x).input_ids)

    return count


async def _workload(
    cfg: BenchConfig,
    env: Env,
    name: str,
    capacity: int,
    counter: Counter | None,
    into: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Workload ``name``'s cases, its part of the report (kept in ``into`` from the start, and
    handed to `Env.saved` after each case)."""
    wl = build(name, cfg.shape, cfg.sizes, capacity_tokens=capacity, count=counter)
    b = Bursts(wl, [normalize(x.requests, env.s) for x in wl.bursts])
    placements = cfg.placements if name == "reuse" else ["affinity"]
    # without standalone engines (--standalone none) every case is the pipeline's runs alone
    sets = setups_for(cfg.setups, name) if cfg.standalone_engines else []
    out: dict[str, Any] = {
        "requests": len(b.flat),
        "documents": wl.documents if name != "no-reuse" else len(b.flat),
        "bursts": [
            {"requests": len(x.requests), "tenant": x.tenant, "at": x.at, "priority": x.priority}
            for x in wl.bursts
        ],
        "kv_capacity_tokens": capacity,
        "placements": {},
    }
    if into is not None:
        into[name] = out
    own = {k: v - wl.depth.get(k.rpartition("/")[0], 0) for k, v in wl.depth.items()}
    out["corpus_over_capacity"] = round(sum(own.values()) / capacity, 3) if capacity else None
    for placement in placements:
        pairs = cfg.random_pairs if placement == "random" else cfg.pairs
        out["placements"][placement] = await run_case(env, b, placement, cfg.order, pairs, sets)
        env.saved()
    one = one_setup(cfg.setups, name) if sets else []  # further cases: as bench/plan.py counts
    others = [o for o in scoped(cfg.orders, name) if o != cfg.order]
    if name in SHARING and others and "affinity" in placements:
        out["orders"] = {cfg.order: _order_view(out["placements"]["affinity"])}
        for order in others:
            case = await run_case(env, b, "affinity", order, cfg.pairs, one)
            out["orders"][order] = _order_view(case)
            env.saved()
    admissions = admissions_for(cfg.admissions, name)
    if admissions:
        out["admissions"] = {"fair": _order_view(out["placements"]["affinity"])}
        for adm in admissions:
            await control.send(env.r, env.keys, f"admission:{adm}", env.workers.names)
            try:
                case = await run_case(env, b, "affinity", cfg.order, cfg.pairs, one)
            finally:
                await control.send(env.r, env.keys, "admission:fair", env.workers.names)
            out["admissions"][adm] = _order_view(case)
            env.saved()
    if name in SHARING and name in cfg.pass_off:
        producer = env.producer
        async with Producer(env.s.replace(shared_pass=False)) as env.producer:
            try:
                case = await run_case(env, b, "affinity", cfg.order, cfg.pairs, one)
            finally:
                env.producer = producer
        out["pass_off"] = {"on": _order_view(out["placements"]["affinity"])}
        out["pass_off"]["off"] = _order_view(case)
        env.saved()
    if "affinity" in out["placements"] and "random" in out["placements"]:
        p = out["placements"]
        out["affinity_gain"] = {
            m: round(
                p["affinity"][m]["median_throughput"] / p["random"][m]["median_throughput"] - 1, 4
            )
            for m in ("pipeline", "standalone")
            if p["random"][m]["median_throughput"]  # none without standalone engines
        }
    if name in _GC_WORKLOADS:
        out["gc_unfrozen"] = await _gc_without_freeze(env, b)
    return out


def _unfinished(
    report: dict[str, Any],
    label: str,
    runs: list[dict[str, Any]] | None,
    checkpoint: Callable[[dict[str, Any]], None],
) -> None:
    """Keep the runs of the case under way in the report so far (``unfinished_case``: a case of
    two pairs on a GPU is several minutes a machine may not last); gone once the case is (its
    caller saves the report with the case right after: no write of its own then)."""
    if runs is None:
        report.pop("unfinished_case", None)
        return
    report["unfinished_case"] = {"case": label, "runs": runs}
    checkpoint(report)


def _order_view(case: dict[str, Any]) -> dict[str, Any]:
    keep = (
        "median_ratio",
        "min_ratio",
        "ratios",
        "standalone",
        "pipeline",
        "timeline",
        "setups",
        "ratios_vs",
        "cached_share",
        "optimum_cached_tokens",
        "max_share_ratio",
        "shares",
        # the workers' GC figures as of the case's last pipeline run (the idle collections' and
        # whole-heap figures count from the worker's start: issue 32's whole-heap step shows in
        # whichever case it fell due before)
        "gc_max_pause_ms_frozen",
        "gc_frozen_by_gen",
        "kv_budget",  # the budget the case's workers ran at
    )
    return {k: case[k] for k in keep if k in case}


async def _gc_without_freeze(env: Env, b: Bursts) -> dict[str, Any]:
    """One pipeline run with the workers' heaps unfrozen: the GC pauses gc.freeze avoids."""
    from prefixq.bench.cases import assignment

    names = env.workers.names
    env.say(f"{b.wl.name}: one pipeline run without gc.freeze")
    await control.send(env.r, env.keys, "gc_unfreeze", names)
    await reset(env)
    order = env.s.enqueue_order
    shards = await assignment(env.s, b.reqs, "affinity", order)
    t0, t1, _, stats = await pipeline(env, b, "affinity", order, shards)
    await control.send(env.r, env.keys, "gc_freeze", names)
    return {
        "throughput": round(len(b.flat) / (t1 - t0), 4),
        "gc_max_pause_ms": [stats[n]["gc_max_pause_ms"] for n in names],
        "gc_pauses": [stats[n]["gc_pauses"] for n in names],
        "gc_by_gen": by_gen(stats, names),
    }


def _config(cfg: BenchConfig, args: dict[str, Any]) -> dict[str, Any]:
    c = asdict(cfg)
    c["engine_args"] = args
    return c
