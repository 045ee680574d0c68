"""How large the KV budget (worker/kv_budget.py) is: the settings' share of the engine's cache, or
the share that keeps ``kv_history_tokens`` for the prefixes finished last (`share_for`), the
shared pass's window that follows it (`pass_window_for`), and the bench's admissions that switch
a live worker to another (`commands`)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

from prefixq.core.settings import DEFAULT_KV_HISTORY, Settings

if TYPE_CHECKING:
    from prefixq.worker.kv_budget import KvBudget
    from prefixq.worker.shared_pass import PassMarks

log = logging.getLogger(__name__)

__all__ = [
    "HISTORY_TRUST",
    "KV_HISTORY_SHARE",
    "KV_HISTORY_SHARES",
    "KV_HISTORY_TOKENS",
    "MIN_INFLIGHT_SHARE",
    "apply",
    "commands",
    "pass_window_for",
    "share_for",
    "size",
]

#: of the cache the budget leaves to finished prefixes, the share a joining burst counts on
#: finding still there (questions' and answers' blocks, and the engine's own rounding, take some)
HISTORY_TRUST = 0.8


#: the budget `prefixq bench --admissions kv-history` switches a worker to
KV_HISTORY_SHARE = 0.5
#: every budget the bench's admissions switch to (``admission:<name>``), to measure the share;
#: ``kv-history-off`` none at all (against a budget the settings set)
KV_HISTORY_SHARES = {
    "kv-history": KV_HISTORY_SHARE,
    "kv-history-30": 0.3,
    "kv-history-70": 0.7,
    "kv-history-off": 0.0,
}
#: the histories (tokens kept, ``kv_history_tokens``) the bench's admissions switch to
KV_HISTORY_TOKENS = {"kv-history-32k": 32768}
#: the least share of the cache ``kv_history_tokens`` leaves to the prefixes inside the engine:
#: below it the engine's batch shrinks (simulated, two engines of 65,536 tokens: a burst alone
#: 22% slower at 0.5, 4% at 0.7; docs/BENCHMARKS.md, 2026-12-06)
MIN_INFLIGHT_SHARE = 0.7


def share_for(share: float, history_tokens: int, kv_tokens: int) -> float:
    """The budget's share of an engine of ``kv_tokens``: ``share``, or with ``history_tokens``
    set, the share that keeps that many tokens for the prefixes finished last (at least
    `MIN_INFLIGHT_SHARE` for those inside; 0, no budget, while the cache's size is unknown).
    The history a joining burst needs is the documents the pass finished before it came: a
    number of documents, not a share of the cache (docs/BENCHMARKS.md, 2026-12-06)."""
    if share > 0 or history_tokens <= 0:
        return share
    if kv_tokens <= 0:
        return 0.0
    return max(MIN_INFLIGHT_SHARE, 1.0 - history_tokens / kv_tokens)


def pass_window_for(pass_window: float, share: float) -> float:
    """The shared pass's window (a share of the KV cache) for a budget of ``share`` (0: none)."""
    if share <= 0:
        return pass_window
    return max(pass_window, HISTORY_TRUST * (1.0 - share))


def apply(budget: KvBudget, marks: PassMarks, share: float, pass_window: float) -> None:
    """Hold ``budget`` to ``share`` of its cache and widen the pass's window to match."""
    budget.resize(share)
    marks.resize(pass_window_for(pass_window, share))


def _settings_share(settings: Settings, kv_tokens: int) -> float:
    """The settings' budget (``kv_inflight_share`` or ``kv_history_tokens``) on ``kv_tokens``."""
    return share_for(settings.kv_inflight_share, settings.kv_history_tokens, kv_tokens)


def size(budget: KvBudget, marks: PassMarks, kv_tokens: int, settings: Settings) -> None:
    """Size the budget and the pass's window for an engine of ``kv_tokens`` (0: unknown)."""
    share, history = settings.kv_inflight_share, settings.kv_history_tokens
    if (share or history) and kv_tokens <= 0:
        what = f"kv_inflight_share {share}" if share else f"kv_history_tokens {history}"
        chosen = share or history != DEFAULT_KV_HISTORY  # the default's: no news (a test engine)
        log.log(
            logging.WARNING if chosen else logging.DEBUG,
            "%s: no KV cache size stated; no budget",
            what,
        )
    budget.kv_tokens = marks.kv_tokens = kv_tokens
    apply(budget, marks, _settings_share(settings, kv_tokens), settings.pass_window)


def commands(
    switches: Mapping[str, Callable[[], Awaitable[None]]],
    budget: KvBudget,
    marks: PassMarks,
    settings: Settings,
) -> dict[str, Callable[[], Awaitable[None]]]:
    """worker/groups.py's admission commands (``switches``), each setting the budget too:
    ``admission:kv-history`` (and the others of `KV_HISTORY_SHARES`) to its share, those of
    `KV_HISTORY_TOKENS` to their history, every other to the settings' budget."""

    def with_budget(name: str, run: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
        adm = name.removeprefix("admission:")

        async def go() -> None:
            await run()
            if adm in KV_HISTORY_SHARES:
                share = KV_HISTORY_SHARES[adm]
            elif adm in KV_HISTORY_TOKENS:
                share = share_for(0.0, KV_HISTORY_TOKENS[adm], budget.kv_tokens)
            else:
                share = _settings_share(settings, budget.kv_tokens)
            apply(budget, marks, share, settings.pass_window)

        return go

    return {name: with_budget(name, run) for name, run in switches.items()}
