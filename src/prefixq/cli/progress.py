"""Terminal output: progress bars (enqueue, burst completion) and the inspect tables (rich).

Everything here writes to stderr except `render_snapshot` and `watch_snapshot`, so stdout stays
machine-readable.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, Self

from redis.exceptions import RedisError
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from prefixq.client.results import BurstStatus
from prefixq.core.errors import PrefixqError

_err = Console(stderr=True)


class _Bar:
    def __init__(self, description: str, total: int, *extra: Any) -> None:
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            *extra,
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=_err,
            transient=False,
        )
        self.task: TaskID = self.progress.add_task(description, total=total or None)

    def __enter__(self) -> Self:
        self.progress.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.progress.stop()


class EnqueueProgress(_Bar):
    """Requests enqueued so far."""

    def __init__(self, total: int) -> None:
        super().__init__("enqueue", total)

    def update(self, done: int, total: int) -> None:
        self.progress.update(self.task, completed=done, total=total)


class BurstProgress(_Bar):
    """Results recorded so far: done, failed, requests/s, ETA."""

    def __init__(self, burst: str) -> None:
        super().__init__(f"burst {burst}", 0, TextColumn("{task.fields[info]}"))
        self.progress.update(self.task, info="")
        self.t0 = time.monotonic()

    def update(self, st: BurstStatus) -> None:
        n = st.done + st.failed
        rate = n / max(time.monotonic() - self.t0, 1e-6)
        self.progress.update(
            self.task,
            completed=n,
            total=st.total,
            info=f"ok {st.done} failed {st.failed} {rate:.1f} req/s",
        )


def render_snapshot(snap: dict[str, Any], console: Console | None = None) -> None:
    """The human form of `stats.snapshot`."""
    c = console or _out_console()
    for part in snapshot_renderables(snap):
        c.print(part)


def _out_console() -> Console:
    return Console(width=None if Console().is_terminal else 120)


def fleet_lines(fleet: dict[str, Any]) -> list[RenderableType]:
    """Shards without a live worker (orphaned: their queue moves) and the moves so far."""
    out: list[RenderableType] = []
    for s in fleet.get("shards", ()):
        if not s["live"] and s["dead_for_s"] > 0:
            state = (
                "orphaned: its queue moves to live shards" if s["orphaned"] else "no live worker"
            )
            out.append(f"[yellow]shard {s['shard']}: {state} ({s['dead_for_s']:.0f} s)[/]")
    moves = fleet.get("moves") or {}
    if moves:
        parts = [
            f"{why} {m['groups']} groups / {m['requests']} requests / {m['tokens']} tok"
            for why, m in sorted(moves.items())
        ]
        out.append("moves between shards: " + "; ".join(parts))
    return out


def snapshot_renderables(snap: dict[str, Any]) -> list[RenderableType]:
    """What `render_snapshot` prints, in order (tables and markup strings)."""
    out: list[RenderableType] = [
        f"[yellow]{escape(p)}[/]"
        for p in snap.get("problems", ())  # ops/tolerant.py
    ]
    t = Table(title=f"shards of {snap['namespace']}")
    cols = (
        "shard",
        "queued",
        "in flight (pending)",
        "oldest wait s",
        "workers",
        "prefill backlog tok",
        "dead",
        "cached tok (predicted) / prompt tok",
    )
    for col in cols:
        t.add_column(col, justify="right")
    for s in snap["shards"]:
        t.add_row(
            str(s["shard"]),
            str(s["waiting"]),
            str(s["pending"]),
            f"{s['oldest_waiting_s']:.1f}",
            str(s["workers"]),
            str(s["outstanding_prefill_tokens"]),
            str(s["dead_letters"]),
            f"{s['cached_tokens']} ({s['predicted_cached_tokens']}) / {s['prompt_tokens']}",
        )
    out.append(t)
    out += fleet_lines(snap.get("fleet") or {})
    workers = [(s["shard"], w) for s in snap["shards"] for w in s.get("worker_detail", ())]
    if workers:
        wt = Table(title="workers")
        for col in ("worker", "shard", "pending", "in engine at last beat", "beat age s"):
            wt.add_column(col, justify="right")
        for shard, w in workers:
            wt.add_row(
                w["name"],
                str(shard),
                str(w["pending"]),
                str(w["inflight_at_beat"]),
                f"{w['beat_age_s']:.1f}",
            )
        out.append(wt)
    sharing = snap.get("sharing") or []
    if sharing:
        st = Table(title="priorities and tenants (all shards)")
        for col in (
            "priority",
            "tenant",
            "queued",
            "in flight",
            "oldest wait s",
            "bursts",
            "admitted",
            "mean queue wait s",
        ):
            st.add_column(col, justify="right")
        for x in sharing:
            st.add_row(
                x["priority"],
                escape(x["tenant"]),
                str(x["waiting"]),
                str(x["in_flight"]),
                f"{x['oldest_waiting_s']:.1f}",
                str(x["bursts"]),
                str(x["admitted"]),
                f"{x['mean_queue_wait_s']:.3f}",
            )
        out.append(st)
    for b in snap["bursts"]:
        if "error" in b:
            out.append(f"[bold]burst {b['burst']}[/]: [red]{escape(b['error'])}[/]")
            continue
        out.append(
            f"[bold]burst {b['burst']}[/]: {b['status']}, {b['done']} ok + {b['failed']} "
            f"failed of {b['total']}, {b['requests_per_s']} req/s over {b['span_s']} s; "
            f"placement {b['placement']}, per shard {b['per_shard']}; priority "
            f"{b.get('priority', 'normal')}, tenant {escape(str(b.get('tenant', 'default')))}"
        )
        sampled = b["sampled"] < b["results"]
        bt = Table(
            caption=f"sampled {b['sampled']} of {b['results']} results, at random"
            if sampled
            else None
        )
        for col in ("stage (s)", "p50", "p95", "p99", "max"):
            bt.add_column(col, justify="right")
        for name, key in (
            ("queue wait", "queue_wait_s"),
            ("admit -> first token", "first_token_s"),
            ("end to end", "end_to_end_s"),
        ):
            d = b[key]
            bt.add_row(name, *(f"{d[k]:.3f}" for k in ("p50", "p95", "p99", "max")))
        out.append(bt)
        out.append(
            f"  prompt tokens {b['prompt_tokens']}, from the prefix cache "
            f"{b['cached_tokens']} ({b['cached_ratio']:.1%}; predicted "
            f"{b['predicted_cached_tokens']}); bytes: raw msgpack {b['raw_bytes']} -> "
            f"stored {b['encoded_bytes']} ({b['compression']}x)"
        )
        by_worker = b.get("workers") or {}
        if by_worker:
            out.append(
                "  results by worker: "
                + ", ".join(f"{escape(w)} {n}" for w, n in by_worker.items())
            )
    return out


def watch_snapshot(
    fetch: Callable[[], dict[str, Any]],
    *,
    interval: float,
    count: int = 0,
    console: Console | None = None,
) -> int:
    """``inspect --watch``: show `snapshot_renderables(fetch())` in place (rich Live), refreshed
    every ``interval`` s, until ``count`` views were shown (0 = no limit) or Ctrl-C / SIGTERM,
    which end it quietly. A failing refresh keeps the last view under a red line; a failing first
    fetch raises. Returns the number of views shown.

    The signals set a flag instead of raising KeyboardInterrupt: an exception raised while a
    finalizer runs (a socket's ``__del__``, say) is printed and dropped by Python, and the view
    would then never end."""
    c = console or _out_console()
    shown = 0
    problem = ""
    quit_ = threading.Event()
    with _signals_set(quit_, signal.SIGINT, signal.SIGTERM):
        snap = fetch()
        with Live(console=c, auto_refresh=False) as live:
            while not quit_.is_set():
                head = Text(
                    f"prefixq inspect --watch: {snap['namespace']} at "
                    f"{time.strftime('%H:%M:%S', time.localtime(snap['at']))}, every "
                    f"{interval:g} s (Ctrl-C quits)",
                    style="dim",
                )
                parts: list[RenderableType] = [head]
                if problem:
                    parts.append(Text(problem, style="bold red"))
                live.update(Group(*parts, *snapshot_renderables(snap)), refresh=True)
                shown += 1
                if (count and shown >= count) or quit_.wait(interval):
                    break
                try:
                    snap, problem = fetch(), ""
                except (PrefixqError, RedisError, OSError) as e:
                    problem = f"refresh failed: {e}; showing the last view"
    return shown


@contextlib.contextmanager
def _signals_set(flag: threading.Event, *signums: signal.Signals) -> Iterator[None]:
    """While inside, the signals set ``flag`` (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {n: signal.signal(n, lambda *_: flag.set()) for n in signums}
    try:
        yield
    finally:
        for n, handler in before.items():
            signal.signal(n, handler)
