"""`KvBudget`: the distinct prefixes of the requests in the engine, held to a share of its cache.

vLLM admits waiting requests while KV blocks are free, and a cached block nobody references counts
as free: with a burst's hundreds of requests in its queue, the running requests' own blocks take
nearly the whole cache, and a finished document's prefix is evicted as soon as the next one loads.
A burst that joins the shared pass (worker/shared_pass.py) then finds nothing behind the
completion front, and recomputes every document the pass did before it came.

With ``kv_inflight_share`` set, a request enters the engine only while the distinct prefixes of
the requests inside it (each group's prompt tokens once, a request without a group its own) fit
that share of the engine's KV cache; the rest of the cache keeps the prefixes finished last, where
a joining burst starts (its window grows to match: `pass_window_for`). A request whose group is
already inside goes at once (it adds its question and answer only); a group that does not fit
waits, and the waiting groups go in the engine's own order (its priority, lower first, then
admission), all of a group's waiting requests together; nothing waits while the engine is empty
(a group larger than the budget goes alone). Off (0) by default: measured in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

from prefixq.core.entries import Entry
from prefixq.core.settings import Settings

if TYPE_CHECKING:
    from prefixq.worker.shared_pass import PassMarks

log = logging.getLogger(__name__)

__all__ = [
    "HISTORY_TRUST",
    "KV_HISTORY_SHARE",
    "KV_HISTORY_SHARES",
    "KvBudget",
    "apply",
    "commands",
    "pass_window_for",
    "size",
]

#: of the cache the budget leaves to finished prefixes, the share a joining burst counts on
#: finding still there (questions' and answers' blocks, and the engine's own rounding, take some)
HISTORY_TRUST = 0.8

#: the budget `prefixq bench --admissions kv-history` switches a worker to
KV_HISTORY_SHARE = 0.5
#: every budget the bench's admissions switch to (``admission:<name>``), to measure the share
KV_HISTORY_SHARES = {"kv-history": KV_HISTORY_SHARE, "kv-history-30": 0.3, "kv-history-70": 0.7}

#: what `KvBudget.holding` gives while the budget is off
_OFF: contextlib.AbstractAsyncContextManager[None] = contextlib.nullcontext()

#: a request's group, or the request itself (its burst and index) when it has none
_Key = int | tuple[str, int]


def pass_window_for(pass_window: float, share: float) -> float:
    """The shared pass's window (a share of the KV cache) for a budget of ``share`` (0: none)."""
    if share <= 0:
        return pass_window
    return max(pass_window, HISTORY_TRUST * (1.0 - share))


class KvBudget:
    """Counts the distinct prefix tokens inside the engine against ``share`` of ``kv_tokens``
    (either 0: no limit)."""

    def __init__(self, share: float = 0.0, kv_tokens: int = 0) -> None:
        self.share = share
        self.kv_tokens = kv_tokens
        #: tokens the distinct prefixes inside the engine may take (0: no limit)
        self.capacity = 0
        #: group -> [requests inside, its tokens]
        self._inside: dict[_Key, list[int]] = {}
        #: tokens of the groups inside
        self.used = 0
        #: waiting groups: (engine priority, admission, group) on a heap; their requests
        self._heap: list[tuple[int, int, _Key]] = []
        self._waiting: dict[_Key, list[tuple[int, asyncio.Future[None]]]] = {}
        self._seq = itertools.count()
        #: the most tokens the groups inside took at once; requests that waited for room
        self.peak = 0
        self.held = 0
        self.resize(share, kv_tokens)

    def resize(self, share: float, kv_tokens: int | None = None) -> None:
        """A new share (or cache size); groups that now fit go."""
        self.share = share
        if kv_tokens is not None:
            self.kv_tokens = kv_tokens
        on = share > 0 and self.kv_tokens > 0  # at least 1 token: 0 is no budget at all
        self.capacity = max(1, int(share * self.kv_tokens)) if on else 0
        self._wake()

    def stats(self) -> dict[str, int | float]:
        """The control stream's ``stats`` answer's part (worker/probes.py)."""
        return {
            "kv_budget_share": self.share,
            "kv_budget_tokens": self.capacity,
            "kv_budget_peak": self.peak,
            "kv_budget_held": self.held,
        }

    def reset(self) -> None:
        """Start `peak` and `held` over (the control command ``reset_stats``)."""
        self.peak, self.held = self.used, 0

    @property
    def waiting(self) -> int:
        """Requests waiting for room."""
        return sum(len(w) for w in self._waiting.values())

    def holding(self, e: Entry, priority: int) -> contextlib.AbstractAsyncContextManager[None]:
        """`hold`, or nothing at all while the budget is off (the default: no cost per
        request; a budget switched on counts the requests that enter from then on)."""
        return self.hold(e, priority) if self.capacity else _OFF

    @contextlib.asynccontextmanager
    async def hold(self, e: Entry, priority: int) -> AsyncIterator[None]:
        """Inside the engine for the block: wait for room for ``e``'s prefix first."""
        key: _Key = e.group if e.group is not None else (e.burst, e.index)
        tokens = e.work + e.predicted_cached
        if self.capacity and key not in self._inside and not self._fits(tokens):
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.held += 1
            waiters = self._waiting.get(key)
            if waiters is None:  # its group's first waiting request places it
                waiters = self._waiting[key] = []
                heapq.heappush(self._heap, (priority, next(self._seq), key))
            waiters.append((tokens, fut))
            try:
                await fut
            except BaseException:
                if fut.done() and not fut.cancelled():  # let in as it was cancelled: go out
                    self._leave(key)
                else:
                    waiters.remove((tokens, fut))
                    if not waiters and self._waiting.get(key) is waiters:
                        del self._waiting[key]
                    self._wake()
                raise
        else:
            self._enter(key, tokens)
        try:
            yield
        finally:
            self._leave(key)

    def _fits(self, tokens: int) -> bool:
        return not self._waiting and (not self._inside or self.used + tokens <= self.capacity)

    def _enter(self, key: _Key, tokens: int) -> None:
        inside = self._inside.get(key)
        if inside is None:
            self._inside[key] = [1, tokens]
            self.used += tokens
            self.peak = max(self.peak, self.used)
        else:
            inside[0] += 1
            if tokens > inside[1]:
                self.used += tokens - inside[1]
                inside[1] = tokens
                self.peak = max(self.peak, self.used)

    def _leave(self, key: _Key) -> None:
        inside = self._inside[key]
        inside[0] -= 1
        if not inside[0]:
            del self._inside[key]
            self.used -= inside[1]
            self._wake()

    def _wake(self) -> None:
        """Let the waiting groups in, in order, while the first fits (all when off)."""
        heap = self._heap
        while heap:
            key = heap[0][2]
            waiters = self._waiting.get(key)
            if not waiters:  # all of it went already (a stale second place)
                heapq.heappop(heap)
                continue
            tokens = max(t for t, _ in waiters)
            cap, inside = self.capacity, self._inside
            if cap and inside and key not in inside and self.used + tokens > cap:
                return
            heapq.heappop(heap)
            del self._waiting[key]
            for t, fut in waiters:
                if not fut.done():
                    self._enter(key, t)
                    fut.set_result(None)


def apply(budget: KvBudget, marks: PassMarks, share: float, pass_window: float) -> None:
    """Hold ``budget`` to ``share`` of its cache and widen the pass's window to match."""
    budget.resize(share)
    marks.resize(pass_window_for(pass_window, share))


def size(budget: KvBudget, marks: PassMarks, kv_tokens: int, settings: Settings) -> None:
    """Size the budget and the pass's window for an engine of ``kv_tokens`` (0: unknown)."""
    share = settings.kv_inflight_share
    if share and kv_tokens <= 0:
        log.warning("kv_inflight_share %s: the engine states no KV cache size; no budget", share)
    budget.kv_tokens = marks.kv_tokens = kv_tokens
    apply(budget, marks, share, settings.pass_window)


def commands(
    switches: Mapping[str, Callable[[], Awaitable[None]]],
    budget: KvBudget,
    marks: PassMarks,
    settings: Settings,
) -> dict[str, Callable[[], Awaitable[None]]]:
    """worker/groups.py's admission commands (``switches``), each setting the budget too:
    ``admission:kv-history`` (and the others of `KV_HISTORY_SHARES`) to its share, every other
    to the settings' share."""

    def with_budget(name: str, run: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
        adm = name.removeprefix("admission:")
        share = KV_HISTORY_SHARES.get(adm, settings.kv_inflight_share)

        async def go() -> None:
            await run()
            apply(budget, marks, share, settings.pass_window)

        return go

    return {name: with_budget(name, run) for name, run in switches.items()}
