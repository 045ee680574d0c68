"""Admission beyond fair shares, off by default until measured (docs/BENCHMARKS.md, issue 22):

- **whole groups** (``group_admission``): the requests of one stored prefix (a document's
  questions, which the producer enqueues together) go into the engine together. A group that
  does not fit the free room waits for it rather than being split at the window's edge, where
  its later requests could come after the engine evicted its prefix. A group already begun, one
  larger than the window, or one whose end is not in the stock yet is admitted as it fits.
- **resident first** (``resident_first``): when the scheduler picks between tenants of an equal
  fair-share turn (one more admission would leave a tenant within `SLACK` of the least virtual
  time), it takes the one whose next request's prefix was among the last `RECENT` admitted (likely
  still in the engine's cache). Each tenant stays within one admission of its share.

The scheduler (scheduler.py) calls them; they keep no I/O and touch only the stock they are given.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from prefixq.core.entries import Entry
from prefixq.worker.kv_sizing import KV_HISTORY_SHARES, KV_HISTORY_TOKENS


class _Lane(Protocol):  # lanes.Lane, as seen here (scheduler.py imports this module)
    stock: Any
    remote: bool
    last_ref: str | None


class _Tenant(Protocol):  # lanes.Tenant
    vtime: float
    weight: float
    ready: Any

    def has_ready(self) -> bool: ...


T = TypeVar("T", bound=_Tenant)


class _Switch(Protocol):  # scheduler.Scheduler
    def set_admission(self, *, whole_groups: bool, resident_first: bool) -> None: ...


#: the admission orders `prefixq bench` switches workers between (control command
#: ``admission:<name>``): (whole groups, resident first)
ADMISSIONS = {
    "fair": (False, False),
    "whole-groups": (True, False),
    "resident-first": (False, True),
    # fair shares, with the engine's in-flight prefixes held to a share of its cache
    # (kv_sizing.py `KV_HISTORY_SHARES`: half, or 30% and 70%), or keeping a number of tokens
    # for the prefixes finished last (`KV_HISTORY_TOKENS`)
    **dict.fromkeys([*KV_HISTORY_SHARES, *KV_HISTORY_TOKENS], (False, False)),
}

#: virtual time (admissions of weight 1) within which tenants count as having an equal turn
SLACK = 1.0
#: admissions whose prefixes count as resident
RECENT = 512


def take_whole(lane: _Lane, k: int, window: int) -> int:
    """How many of ``lane``'s first ``k`` stocked entries to admit so that no group is split
    (``k`` may exceed the stock: the room left when several lanes share it)."""
    stock = lane.stock
    n, i = len(stock), 0
    k = min(k, n)
    while i < k:
        ref = stock[i][1].prefix_ref
        j = i + 1
        if ref is not None:
            while j < n and stock[j][1].prefix_ref == ref:
                j += 1
        if j <= k:  # the whole group fits
            i = j
            continue
        if i == 0:
            begun = ref is not None and ref == lane.last_ref
            complete = j < n or not lane.remote
            if begun or not complete or j > window:
                return k  # admitted as it fits: waiting would not keep it whole
        return i  # the rest waits for room
    return i


class Resident:
    """The prefixes of the last `RECENT` admissions."""

    def __init__(self) -> None:
        self._recent: deque[str] = deque()
        self._count: Counter[str] = Counter()

    def note(self, e: Entry) -> None:
        ref = e.prefix_ref
        if ref is None:
            return
        self._recent.append(ref)
        self._count[ref] += 1
        if len(self._recent) > RECENT:
            old = self._recent.popleft()
            self._count[old] -= 1
            if not self._count[old]:
                del self._count[old]

    def holds(self, e: Entry) -> bool:
        return e.prefix_ref is not None and e.prefix_ref in self._count

    def prefer(self, tenants: Sequence[T], least: T) -> T:
        """Among ``tenants`` of ``least``'s turn (one admission more leaves them within `SLACK`
        of its virtual time), the first whose next entry's prefix is resident; else ``least``."""
        if self.holds(least.ready[0].stock[0][1]):
            return least
        for t in tenants:
            near = t is not least and t.vtime + 1.0 / t.weight <= least.vtime + SLACK
            near = near and t.has_ready()
            if near and self.holds(t.ready[0].stock[0][1]):
                return t
        return least


def commands(sched: _Switch) -> dict[str, Callable[[], Awaitable[None]]]:
    """Control commands switching ``sched`` between `ADMISSIONS` (worker/control.py)."""

    def switch(whole: bool, resident: bool) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            sched.set_admission(whole_groups=whole, resident_first=resident)

        return run

    return {f"admission:{name}": switch(*flags) for name, flags in ADMISSIONS.items()}
