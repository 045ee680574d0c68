"""Fit the simulated engine's step costs (bench/sim_engine.py `StepCost`) to a GPU's standalone
runs.

The standalone set-ups hand every burst's requests to one vLLM engine at their arrivals, with no
prefixq in between: what they take depends only on vLLM's scheduler and the time of each step.
This runs them on `SimCore` in virtual time (seconds of CPU for a minute of GPU) and prints, for
each candidate cost, each burst's finish and the requests the first burst finished before the
last one arrived, against the figures a real run measured (a `prefixq bench --json` report).

    python scripts/sim_fit.py docs/bench/h200-kv-shares-2026-12-05-partial.json \
        --step-ms 3,5 --token-us 20,23,26 --context-ns 16,24,32

Not a measurement: a fit whose error it prints, for the design tool to start from.
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any

from prefixq.bench.engine_set import engine_request
from prefixq.bench.setups import sorted_order
from prefixq.bench.sim_engine import SimCore
from prefixq.bench.workloads import Shape, Sizes, build
from prefixq.core.inputs import normalize
from prefixq.core.settings import Settings

KV_BYTES = 17_179_869_184


def standalone(
    core: SimCore, reqs: list[tuple[int, float, list[int], int]]
) -> tuple[list[float], int, int]:
    """Run ``reqs`` (burst, arrival, prompt ids, max_tokens; in hand-over order) in virtual
    time: each burst's last finish, the cached tokens, and the first burst's finishes before
    the last arrival."""
    pending = sorted(range(len(reqs)), key=lambda i: reqs[i][1])  # stable: order kept
    t, p = 0.0, 0
    burst_of: dict[str, int] = {}
    last: dict[int, float] = {}
    cached = early = 0
    last_arrival = max(r[1] for r in reqs)
    while p < len(pending) or core.sched.has_requests():
        while p < len(pending) and reqs[pending[p]][1] <= t:
            i = pending[p]
            burst, _, ids, max_tokens = reqs[i]
            burst_of[f"r{i}"] = burst
            core.add(f"r{i}", ids, max_tokens, 0, t)
            p += 1
        if not core.sched.has_requests():
            t = reqs[pending[p]][1]
            continue
        out, seconds, sampled = core.schedule()
        t += seconds
        for f in core.finish(out, sampled, t):
            b = burst_of[f.rid]
            last[b] = t
            cached += f.cached
            early += b == 0 and t < last_arrival
    return [round(last[b], 2) for b in sorted(last)], cached, early


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("report", help="a prefixq bench --json report with multi-burst standalone runs")
    ap.add_argument("--step-ms", default="5")
    ap.add_argument("--token-us", default="26")
    ap.add_argument("--context-ns", default="32")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    a = ap.parse_args()
    measured = _measured(a.report)
    print("measured:", json.dumps(measured))
    s = Settings()
    wl = build(
        "multi-burst", Shape(token_ids=True, vocab=128_256), Sizes(), capacity_tokens=131_072
    )
    bursts = [normalize(b.requests, s) for b in wl.bursts]
    flat: list[tuple[int, float, list[int], int]] = []
    for k, (b, reqs) in enumerate(zip(wl.bursts, bursts, strict=True)):
        for i, q in enumerate(reqs):
            er = engine_request(q, f"{k}-{i}")
            flat.append((k, b.at, er.prompt_token_ids or [], int(er.sampling["max_tokens"])))
    orders = {"standalone": list(range(len(flat))), "standalone-sorted": sorted_order(bursts)}
    grid = itertools.product(
        *(map(float, x.split(",")) for x in (a.step_ms, a.token_us, a.context_ns))
    )
    for step_ms, token_us, context_ns in grid:
        args: dict[str, Any] = {
            "kv_cache_memory_bytes": KV_BYTES,
            "max_num_seqs": a.max_num_seqs,
            "max_num_batched_tokens": a.max_num_batched_tokens,
            "sim_step_ms": step_ms,
            "sim_token_us": token_us,
            "sim_context_ns": context_ns,
        }
        err, row = 0.0, {}
        for mode, order in orders.items():
            ends, cached, early = standalone(SimCore(args), [flat[i] for i in order])
            row[mode] = {"finished_s": ends, "early": early, "cached": cached}
            m = measured.get(mode)
            if m:
                err += sum((x / y - 1) ** 2 for x, y in zip(ends, m["finished_s"], strict=True))
                err += ((early - m["early"]) / max(1, m["early"])) ** 2
        print(f"step_ms={step_ms} token_us={token_us} context_ns={context_ns} "
              f"err={err:.4f} {json.dumps(row)}", flush=True)  # fmt: skip


def _measured(path: str) -> dict[str, Any]:
    """Each standalone mode's finishes (first pair) and the first burst's finishes before the
    last arrival, from a report."""
    with open(path) as f:
        w = json.load(f)["workloads"]["multi-burst"]
    out: dict[str, Any] = {}
    for mode, runs in w["placements"]["affinity"]["shares"].items():
        if mode == "pipeline" or not runs:
            continue
        r = runs[0]
        out[mode] = {
            "finished_s": r["finished_s"],
            "early": 198 - r["completed"][0],
        }
    return out


if __name__ == "__main__":
    main()
