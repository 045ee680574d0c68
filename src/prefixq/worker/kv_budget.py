"""`KvBudget`: the distinct prefixes of the requests in the engine, held to a share of its cache.

vLLM admits waiting requests while KV blocks are free, and a cached block nobody references counts
as free: with a burst's hundreds of requests in its queue, the running requests' own blocks take
nearly the whole cache, and a finished document's prefix is evicted as soon as the next one loads.
A burst that joins the shared pass (worker/shared_pass.py) then finds nothing behind the
completion front, and recomputes every document the pass did before it came.

With a budget (``kv_history_tokens``, by default; its size: worker/kv_sizing.py), a request enters
the engine only while the distinct prefixes of the requests inside it (each group's prompt tokens
once, and the part it shares with other groups, its ancestor, once for all: affinity/ancestors.py; a
request without a group its own) fit that share of the engine's KV cache; the rest of the cache
keeps the prefixes finished last, where a joining burst starts (its window grows to match:
`pass_window_for`). A request whose group is already inside goes at once (it adds its question and
answer only), and so does one whose group the engine finished last (`resident`, the pass's window:
still cached, it loads nothing); a group that does not fit waits, and the waiting groups go in the
engine's own order (its priority, lower first, then admission), all of a group's waiting requests
together; nothing waits while the engine is empty (a group larger than the budget goes alone).
A request without a group (its prefix, if any, no other request of its burst shares) leaves
nothing worth keeping: it is held only while a group is inside the engine, whose history the
rest of the cache keeps; with none inside it goes as it would without a budget (on a GPU, a burst
of documents of their own ran 1.3% slower held to the budget: docs/BENCHMARKS.md).

The requests waiting here are not in the engine, and the worker's window does not count them
(`outside`, up to `WAITING_WINDOWS` windows of them): with them counted, the first burst's next
documents filled the window while they waited, and a later burst's questions about the document
the engine held were read only after it had left, and loaded it again. Now they are read and go in
with it (riders), or wait with the first burst's requests of their document, in its place.
Waiting groups go in only while fewer requests than the window are inside (`window`; a group
goes whole): the engine holds about its window, as without the budget, never the four windows
let in at once as room frees up. A waiting request whose burst ends (cancelled or expired:
`end`) leaves at once instead of waiting for room.
On by default (32,768 tokens kept; ``kv_history_tokens`` 0 turns it off): docs/BENCHMARKS.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator, Container
from typing import NamedTuple

from prefixq.core.entries import Entry
from prefixq.core.errors import EngineAborted
from prefixq.worker.lanes import Item

__all__ = ["WAITING_WINDOWS", "KvBudget"]

#: windows (the worker's ``max_inflight``) of requests that may wait for room beyond its window
WAITING_WINDOWS = 4

#: what `KvBudget.holding` gives while the budget is off
_OFF: contextlib.AbstractAsyncContextManager[None] = contextlib.nullcontext()

#: a request's group, or the request itself (its burst and index) when it has none
_Key = int | tuple[str, int]
#: a group's shared ancestor (affinity/ancestors.py): its key and tokens, counted once
_Up = tuple[int, int]


class _Waiter(NamedTuple):
    """A request waiting for room."""

    tokens: int
    #: set when it goes: False, let in; True, its burst ended
    fut: asyncio.Future[bool]
    burst: str
    task: asyncio.Task[object] | None
    #: what `give_back` returns for it, its delivery and entry (None: nothing)
    tag: Item | None
    #: its group's shared ancestor (`_Up`), None without one
    up: _Up | None = None


class KvBudget:
    """Counts the distinct prefix tokens inside the engine against ``share`` of ``kv_tokens``
    (either 0: no limit)."""

    def __init__(self, share: float = 0.0, kv_tokens: int = 0) -> None:
        self.share = share
        self.kv_tokens = kv_tokens
        #: tokens the distinct prefixes inside the engine may take (0: no limit)
        self.capacity = 0
        #: group -> [requests inside, its tokens beyond its ancestor's]
        self._inside: dict[_Key, list[int]] = {}
        #: the groups inside that have a shared ancestor: theirs; the ancestors inside: [groups
        #: inside under it, its tokens] (each counted once in ``used``)
        self._up: dict[_Key, _Up] = {}
        self._ancestors: dict[int, list[int]] = {}
        #: tokens of the groups inside; how many of them are groups (not requests of their own)
        self.used = 0
        self._groups = 0
        #: requests inside; the most a waiting group may find there to go in (the worker's
        #: window, ``max_inflight``; 0: no limit)
        self._requests = 0
        self.window = 0
        #: waiting groups: (engine priority, admission, group) on a heap; their requests
        #: (`_Waiter`s)
        self._heap: list[tuple[int, int, _Key]] = []
        self._waiting: dict[_Key, list[_Waiter]] = {}
        self._seq = itertools.count()
        #: requests in ``_waiting``; the worker stops (`give_back`)
        self._count = 0
        self._giving_back = False
        #: the most tokens the groups inside took at once; requests that waited for room
        self.peak = 0
        self.held = 0
        #: the groups the engine finished last and most likely still caches (the shared pass's
        #: window): one of them goes in at once, as a group inside does (it loads nothing)
        self.resident: Container[int] | None = None
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
        """Requests waiting for room (outside the engine: the worker's window does not count
        them, worker/worker.py `room`)."""
        return self._count

    def outside(self, window: int) -> int:
        """Of the requests the worker holds in flight, those its window of ``window`` does not
        count: the ones waiting for room, up to `WAITING_WINDOWS` windows of them. So a later
        burst's questions about a document the engine holds are read and go in with it while
        the first burst's next documents wait here (`hold`: a group inside goes at once)."""
        return min(self._count, WAITING_WINDOWS * window)

    def holding(
        self, e: Entry, priority: int, tag: Item | None = None
    ) -> contextlib.AbstractAsyncContextManager[None]:
        """`hold`, or nothing at all while the budget is off (the default: no cost per
        request; a budget switched on counts the requests that enter from then on)."""
        return self.hold(e, priority, tag) if self.capacity else _OFF

    @contextlib.asynccontextmanager
    async def hold(self, e: Entry, priority: int, tag: Item | None = None) -> AsyncIterator[None]:
        """Inside the engine for the block: wait for room for ``e``'s prefix first
        (EngineAborted if its burst ends meanwhile: `end`); ``tag``: what `give_back` returns
        for it if the worker stops while it waits."""
        key: _Key = e.group if e.group is not None else (e.burst, e.index)
        tokens = e.work + e.predicted_cached
        up = None
        if e.group is not None and e.ancestor is not None:  # never more than the prompt's tokens
            up = (e.ancestor, min(e.ancestor_tokens, tokens))
        resident = self.resident is not None and e.group is not None and e.group in self.resident
        cost = self._cost(tokens, up)
        if self.capacity and key not in self._inside and not resident and not self._fits(key, cost):
            if self._giving_back:  # the worker stops: it is left pending at once (`give_back`)
                raise asyncio.CancelledError
            fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            waiter = _Waiter(tokens, fut, e.burst, asyncio.current_task(), tag, up)
            self.held += 1
            waiters = self._waiting.get(key)
            if waiters is None:  # its group's first waiting request places it
                waiters = self._waiting[key] = []
                heapq.heappush(self._heap, (priority, next(self._seq), key))
            waiters.append(waiter)
            self._count += 1
            try:
                ended = await fut
            except BaseException:
                if fut.done() and not fut.cancelled():  # let in as it was cancelled: go out
                    if not fut.result():
                        self._leave(key)
                else:
                    waiters.remove(waiter)
                    self._count -= 1
                    if not waiters and self._waiting.get(key) is waiters:
                        del self._waiting[key]
                    self._wake()
                raise
            if ended:
                raise EngineAborted(f"burst {e.burst} ended while its request waited for room")
        else:
            self._enter(key, tokens, up)
        try:
            yield
        finally:
            self._leave(key)

    def _cost(self, tokens: int, up: _Up | None) -> int:
        """What a group of ``tokens`` under ``up`` adds to ``used`` (its ancestor's tokens once)."""
        return tokens - up[1] if up is not None and up[0] in self._ancestors else tokens

    def _fits(self, key: _Key, tokens: int) -> bool:
        """Whether a request of ``key`` adding ``tokens`` goes in now: nothing waits before it,
        and there is `_room`."""
        return not self._waiting and self._room(key, tokens)

    def _room(self, key: _Key, tokens: int) -> bool:
        """Whether ``tokens`` more of ``key`` fit: they do while the engine is empty, and a
        request of its own needs no room while no group is inside (there is no shared prefix to
        keep room for without one)."""
        if not self._inside or not (isinstance(key, int) or self._groups):
            return True
        return self.used + tokens <= self.capacity

    def end(self, burst: str) -> None:
        """``burst`` was cancelled or expired (worker/ends.py): its requests waiting for room
        leave at once (`hold` raises EngineAborted: they get its ended result), and the groups
        behind them may go."""
        for key, waiters in list(self._waiting.items()):
            for w in [w for w in waiters if w.burst == burst and not w.fut.done()]:
                waiters.remove(w)
                self._count -= 1
                w.fut.set_result(True)
            if not waiters:
                del self._waiting[key]
        self._wake()

    def give_back(self) -> list[Item]:
        """The worker stops: the requests waiting for room never started, so they are not let
        in during the grace period (up to `WAITING_WINDOWS` windows of work): their tasks are
        cancelled (a cancelled wait is never let in), and their tags returned, for the worker to
        give their entries back as it does those read and not started (worker/reader.py
        `release`); from now on one that would wait is cancelled at once (left pending)."""
        self._giving_back = True
        waiters = [w for ws in self._waiting.values() for w in ws if not w.fut.done()]
        for w in waiters:
            if w.task is not None:
                w.task.cancel()
        return [w.tag for w in waiters if w.tag is not None]

    def _enter(self, key: _Key, tokens: int, up: _Up | None = None) -> None:
        self._requests += 1
        inside = self._inside.get(key)
        if inside is None:
            inside = self._inside[key] = [0, 0]
            self._groups += isinstance(key, int)
            if up is not None:  # its ancestor's tokens count once, with the first group under it
                self._up[key] = up
                held = self._ancestors.setdefault(up[0], [0, up[1]])
                self.used += 0 if held[0] else held[1]
                held[0] += 1
        inside[0] += 1
        up = self._up.get(key)
        own = tokens - up[1] if up is not None else tokens
        if own > inside[1]:
            self.used += own - inside[1]
            inside[1] = own
        self.peak = max(self.peak, self.used)

    def _leave(self, key: _Key) -> None:
        self._requests -= 1
        inside = self._inside[key]
        inside[0] -= 1
        if not inside[0]:
            del self._inside[key]
            self.used -= inside[1]
            self._groups -= isinstance(key, int)
            up = self._up.pop(key, None)
            if up is not None:
                held = self._ancestors[up[0]]
                held[0] -= 1
                if not held[0]:
                    del self._ancestors[up[0]]
                    self.used -= held[1]
        if self._heap:  # room, or a place in the window
            self._wake()

    def _wake(self) -> None:
        """Let the waiting groups in, in order, while the first fits (all when off) and fewer
        requests than the window are inside."""
        heap = self._heap
        while heap:
            key = heap[0][2]
            waiters = self._waiting.get(key)
            if not waiters:  # all of it went already (a stale second place)
                heapq.heappop(heap)
                continue
            tokens = self._cost(max(w.tokens for w in waiters), waiters[0].up)
            cap, inside = self.capacity, self._inside
            if inside and self.window and self._requests >= self.window:
                return
            if cap and key not in inside and not self._room(key, tokens):
                return
            heapq.heappop(heap)
            del self._waiting[key]
            for w in waiters:
                if not w.fut.done():  # one cancelled meanwhile uncounts itself (`hold`)
                    self._count -= 1
                    self._enter(key, w.tokens, w.up)
                    w.fut.set_result(False)
