"""The standalone set-ups a user of vLLM alone would try, measured beside the pipeline:

- ``given`` (mode ``standalone``): the burst handed to the engines as given;
- ``sorted`` (mode ``standalone-sorted``): the burst sorted by its user, each document's
  requests together (the "perfect user": `prefixq.client.order`'s ``grouped`` order, applied
  to each burst on its own), on the same engines;
- ``offload`` (mode ``standalone-offload``): as given, on engines of their own started with
  vLLM's CPU KV offloading (``kv_offloading_size`` GiB of host memory per engine, backend
  ``native``: the engine arguments of vLLM 0.26, 0.28, 0.32 and 0.33 alike), sized to what the host
  can give (`host_offload_gib`) unless ``--offload-gib`` says.

All of them get the pipeline's shard assignment and the same arrivals.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from prefixq.client.order import enqueue_order, peeks
from prefixq.core.records import Request

GIVEN, SORTED, OFFLOAD = "given", "sorted", "offload"
SETUPS = (GIVEN, SORTED, OFFLOAD)
MODE_OF = {GIVEN: "standalone", SORTED: "standalone-sorted", OFFLOAD: "standalone-offload"}
#: how the standalone engines run (`prefixq bench --standalone`): each in a process of its own,
#: all in the benchmark's process, or none at all (the pipeline's own figures: cached prompt
#: tokens against the optimum, fairness; no ratios), for GPUs that cannot hold both sides' engines
NO_STANDALONE = "none"
STANDALONE_KINDS = ("process", "inline", NO_STANDALONE)
#: share of the host's available memory the offloading engines may pin, all together
HOST_SHARE = 0.4


def parse_scoped(raw: str, known: tuple[str, ...], flag: str) -> list[str]:
    """A comma-separated list whose items are ``NAME`` (every workload) or ``WORKLOAD:NAME``
    (that workload only), names from ``known``; ConfigError naming ``flag`` otherwise."""
    from prefixq.bench.workloads import WORKLOADS
    from prefixq.core.errors import ConfigError

    items = [x.strip() for x in raw.split(",") if x.strip()]
    for x in items:
        wl, sep, name = x.rpartition(":")
        if name not in known or (sep and wl not in WORKLOADS):
            raise ConfigError(
                f"{flag}: unknown {x!r} (NAME or WORKLOAD:NAME; names: {', '.join(known)}; "
                f"workloads: {', '.join(WORKLOADS)})"
            )
    return items


def scoped(items: list[str], workload: str) -> list[str]:
    """The names of a `parse_scoped` list that apply to ``workload``, in order, once each."""
    out = [x.rpartition(":")[2] for x in items if x.rpartition(":")[0] in ("", workload)]
    return list(dict.fromkeys(out))


def applies(admission: str, workload: str) -> bool:
    """Whether ``admission`` can change how ``workload`` runs: every one where requests share
    prefixes; elsewhere (``no-reuse``) only the KV budget's (worker/kv_sizing.py), the one that
    changes how many requests of their own go in at once."""
    from prefixq.bench.workloads import SHARING
    from prefixq.worker.kv_sizing import KV_HISTORY_SHARES, KV_HISTORY_TOKENS

    return workload in SHARING or admission in KV_HISTORY_SHARES or admission in KV_HISTORY_TOKENS


def admissions_for(items: list[str], workload: str) -> list[str]:
    """The admissions (``--admissions``) measured on ``workload`` beside the default (``fair``):
    those that apply there (`applies`)."""
    return [a for a in scoped(items, workload) if a != "fair" and applies(a, workload)]


def parse_setups(raw: str) -> list[str]:
    """``--setups``: names from `SETUPS`, each for every workload or ``WORKLOAD:NAME``."""
    return parse_scoped(raw, SETUPS, "--setups")


def setups_for(items: list[str], workload: str) -> list[str]:
    """The set-ups measured on ``workload``: ``given`` always (the ratios of every earlier run
    are against it), first; ``sorted`` only where requests share prefixes (elsewhere it is the
    burst as given)."""
    from prefixq.bench.workloads import SHARING

    skip = {GIVEN} if workload in SHARING else {GIVEN, SORTED}
    return [GIVEN, *(x for x in scoped(items, workload) if x not in skip)]


def one_setup(items: list[str], workload: str) -> list[str]:
    """The one standalone set-up that a workload's further cases (other orders, admissions, the
    shared pass off) run beside: the sorting user where ``--setups`` measures it, else the burst
    as given."""
    return [SORTED] if SORTED in setups_for(items, workload) else [GIVEN]


def sorted_order(bursts: list[list[Request]]) -> list[int]:
    """Indexes into the bursts' concatenation: each burst sorted by document (grouped)."""
    out: list[int] = []
    start = 0
    for reqs in bursts:
        out += [start + i for i in enqueue_order("grouped", peeks(reqs, "grouped"))]
        start += len(reqs)
    return out


def offload_unsupported() -> str | None:
    """Why vLLM here cannot offload the KV cache to the CPU (None: it can)."""
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
    except ImportError:
        return "vLLM is not installed"
    if "kv_offloading_size" not in {f.name for f in dataclasses.fields(AsyncEngineArgs)}:
        return "this vLLM has no kv_offloading_size engine argument"
    return None


def offload_args(args: dict[str, Any], gib: float) -> dict[str, Any]:
    """Engine arguments of the offloading set-up: the others plus ``gib`` GiB of host memory."""
    return args | {"kv_offloading_size": gib, "kv_offloading_backend": "native"}


def host_offload_gib(engines: int, meminfo: str = "/proc/meminfo") -> float:
    """GiB of host memory each of ``engines`` offloading engines may pin: `HOST_SHARE` of what
    the host has available, split evenly, in steps of 0.5 GiB (at least 0.5)."""
    avail_kib = 0
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                avail_kib = int(line.split()[1])
                break
    each = HOST_SHARE * avail_kib / (1 << 20) / max(1, engines)
    return max(0.5, int(each * 2) / 2)
