"""`prefixq bench --plan KV_TOKENS`: the cases a run would measure and how long it would take,
without starting an engine, so that a GPU run can be trimmed to the time it is lent.

The estimate is a model calibrated on the one-H200 runs of docs/BENCHMARKS.md (Llama-3.1-8B
shaped, bf16): a run takes `PREFILL_S` per prompt token computed (not served from the cache) plus
`DECODE_S` per output token; the pipeline and the sorted set-up are taken to reach the optimum
(they did: 99.8%), the burst as given to hit what a least-recently-used cache of the engines'
capacity keeps in its order, and offloading to hit what one of the GPU's and the host's capacity
together keeps, a hit from the host costing `HOST_HIT` of computing it. Engine start-up: the
first engine `FIRST_START_S` (kernel JIT, compile, CUDA graphs), each further one `NEXT_START_S`.
Checked against the issue's runs (one engine per mode at ``gpu_memory_utilization=0.42``: about
327,000 KV tokens): reuse 160 x 4 as given, 1,024,144 cached tokens measured and 964,000
modelled; 56 s and 30 s measured as given and grouped, 60 s and 31 s modelled.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from prefixq.bench.measures import optimum_cached
from prefixq.bench.setups import (
    MODE_OF,
    OFFLOAD,
    admissions_for,
    one_setup,
    scoped,
    setups_for,
)
from prefixq.bench.workloads import SHARING, Workload, build

PREFILL_S = 3.0e-5
DECODE_S = 1.37e-4
HOST_HIT = 0.15
FIRST_START_S = 240.0
NEXT_START_S = 50.0
#: per run: caches reset, placement computed, results collected
RUN_OVERHEAD_S = 1.0
#: host memory per offloading engine when --offload-gib does not say: 40% of what a one-H200
#: machine (128 GiB) has available
HOST_GIB = 48.0
#: KV bytes per token of the benchmark model (Llama-3.1-8B: 32 layers x 8 KV heads x 128 x 2 x 2)
BYTES_PER_TOKEN = 131_072


def lru_cached(
    wl: Workload, order: Sequence[int], capacity: int, block: int, own_tokens: int
) -> int:
    """Prompt tokens an LRU cache of ``capacity`` tokens serves to ``wl`` run in ``order``."""
    cache: OrderedDict[str, int] = OrderedDict()
    used, total = 0, 0
    for i in order:
        path = wl.paths[i]
        hit = 0
        for node in path:
            if node in cache:
                hit = wl.depth[node]
        total += hit // block * block
        parent = 0
        for node in path:
            size = wl.depth[node] - parent
            parent = wl.depth[node]
            if node in cache:
                cache.move_to_end(node)
                continue
            cache[node] = size
            used += size
        used += own_tokens  # the request's own blocks take room too, and are never reused
        while used > capacity and cache:
            _, size = cache.popitem(last=False)
            used -= size
        used = min(used, capacity)
    return total


def estimate(
    cfg: Any, kv_tokens: int, *, block: int = 16, orphan_after_s: float = 45.0
) -> dict[str, Any]:
    """The cases of ``cfg`` (a `BenchConfig`) on engines of ``kv_tokens`` each, with seconds
    (``orphan_after_s``: the wait of the fleet's lose case before the move)."""
    shards = len(cfg.gpus)
    capacity = kv_tokens * shards
    gib = cfg.offload_gib or HOST_GIB
    offload_tokens = int(gib * (1 << 30) / BYTES_PER_TOKEN)
    cases: list[dict[str, Any]] = []
    alone = cfg.standalone_engines  # else the pipeline's runs only
    for name in cfg.workloads:
        wl = build(name, cfg.shape, cfg.sizes, capacity_tokens=capacity)
        placements = cfg.placements if name == "reuse" else ["affinity"]
        setups = setups_for(cfg.setups, name) if alone else []
        orders = [(p, cfg.order, setups) for p in placements]
        one = one_setup(cfg.setups, name) if alone else []  # as the runner measures further cases
        if name in SHARING:
            others = [o for o in scoped(cfg.orders, name) if o != cfg.order]
            orders += [("affinity", o, one) for o in others]
        adms = admissions_for(cfg.admissions, name)
        orders += [("affinity", f"{cfg.order}+{a}", one) for a in adms]
        if name in SHARING and name in cfg.pass_off:
            orders.append(("affinity", f"{cfg.order}, pass off", one))
        for placement, order, ups in orders:
            pairs = cfg.random_pairs if placement == "random" else cfg.pairs
            secs = {m: _seconds(wl, m, capacity, offload_tokens, block) for m in _modes(ups)}
            runs = pairs * len(secs)
            total = pairs * sum(secs.values()) + runs * RUN_OVERHEAD_S
            cases.append(
                {
                    "workload": name,
                    "placement": placement,
                    "order": order,
                    "requests": len(wl.paths),
                    "documents": wl.documents,
                    "pairs": pairs,
                    "run_s": {m: round(v, 1) for m, v in secs.items()},
                    "seconds": round(total, 1),
                }
            )
        if name in ("no-reuse", "reuse"):  # the run without gc.freeze
            cases[-1]["seconds"] += round(_seconds(wl, "pipeline", capacity, 0, block), 1)
    if cfg.fleet:  # bench/fleet_cases.py: the pipeline alone, 2 runs a pair, then one lose run
        wl = build("zipf", cfg.shape, cfg.sizes)
        # the engines side by side, those sharing a GPU sharing its time (calibrated: one per GPU)
        per_run = _seconds(wl, "pipeline", capacity, 0, block) / len(set(cfg.gpus))
        for case in cfg.fleet:
            runs = 2 * cfg.pairs if case == "steal" else 1
            extra = 0.0
            if case == "lose":  # a quarter on all shards, the rest on one fewer, and the wait
                extra = per_run * 0.75 * (shards / max(1, shards - 1) - 1) + orphan_after_s
            cases.append(
                {
                    "workload": f"fleet/{case}",
                    "placement": "affinity",
                    "order": cfg.order,
                    "requests": len(wl.paths),
                    "documents": wl.documents,
                    "pairs": runs,
                    "run_s": {"pipeline": round(per_run, 1)},
                    "seconds": round(runs * (per_run + RUN_OVERHEAD_S) + extra, 1),
                }
            )
    offloads = any(OFFLOAD in setups_for(cfg.setups, w) for w in cfg.workloads)
    engines = (2 if alone else 1) + (1 if offloads and alone else 0)
    start = FIRST_START_S + (engines * shards - 1) * NEXT_START_S
    runs_s = sum(c["seconds"] for c in cases)
    return {
        "kv_tokens_per_engine": kv_tokens,
        "engines": engines * shards,
        "start_s": round(start),
        "runs_s": round(runs_s),
        "total_s": round(start + runs_s),
        "cases": cases,
    }


def _modes(setups: Sequence[str]) -> list[str]:
    return [MODE_OF[x] for x in setups] + ["pipeline"]


def _seconds(wl: Workload, mode: str, capacity: int, offload: int, block: int) -> float:
    n = len(wl.paths)
    prompt = sum(wl.depth[p[-1]] if p else 0 for p in wl.paths) + n * _own(wl)
    if mode in ("pipeline", "standalone-sorted"):
        cached = optimum_cached(wl.paths, wl.depth, [0] * n, block)
        host = 0
    else:
        order = range(n)
        cached = lru_cached(wl, order, capacity, block, _own(wl))
        host = 0
        if mode == "standalone-offload" and offload:
            both = lru_cached(wl, order, capacity + offload, block, _own(wl))
            host = both - cached
            cached = both
    output = sum(int(q.get("max_tokens", 0)) for q in wl.requests)
    compute = prompt - cached + HOST_HIT * host
    last_arrival = max(b.at for b in wl.bursts)
    return max(PREFILL_S * compute + DECODE_S * output, last_arrival)


def _own(wl: Workload) -> int:
    """Tokens of a request's own part (the question), from the first request."""
    q = wl.requests[0]
    own = q.get("prompt_token_ids")
    if own is not None:
        return len(own)
    return len(q.get("prompt") or "") // 4


def table(plan: dict[str, Any]) -> str:
    """The plan as lines of text."""
    out = [
        f"{plan['engines']} engines of {plan['kv_tokens_per_engine']} KV tokens each: start-up "
        f"~{plan['start_s']} s, runs ~{plan['runs_s']} s, total ~{plan['total_s']} s "
        f"({plan['total_s'] / 60:.1f} min)"
    ]
    for c in plan["cases"]:
        per = ", ".join(f"{m} {s}" for m, s in c["run_s"].items())
        out.append(
            f"  {c['workload']:<13} {c['placement']:<8} {c['order']:<28} {c['requests']:>5} req "
            f"({c['documents']} docs) x {c['pairs']} pairs: ~{c['seconds']:.1f} s  [one run: {per}]"
        )
    return "\n".join(out)
