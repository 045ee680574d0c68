"""Engine priorities that carry the fair shares into the engine's own queue.

The worker keeps up to ``max_inflight`` requests inside vLLM (twice its ``max_num_seqs``), so a
burst that fits that window goes in whole and vLLM, not the scheduler, decides who runs next.
vLLM's ``scheduling_policy="priority"`` serves waiting requests by (priority, arrival), lower
first, and takes any int. `EngineOrder` gives each request a priority = its band's offset
(``high`` < ``normal`` < ``low``, `SPAN` apart: strict) plus a virtual time:

- each burst has a clock that grows by k / weight per request handed to the engine (its
  tenant's weight; k: that tenant's bursts with requests in the engine), so bursts of a band
  interleave inside the engine by tenant weight, and a tenant's bursts share its weight;
- a burst with no request in the engine starts at the band's *front*: the least virtual time of
  the band's requests still in the engine (the oldest one not finished), never below its own
  clock (no credit for an idle spell). A burst that arrives while the engine is busy with others
  thus goes before what they have waiting there, for as long as the requests that were running
  when it arrived take to finish: its completions then keep pace with theirs.

Requests already running are not preempted by a lower value (vLLM preempts only when KV blocks
run out, and then the highest value it runs), so a burst's first completions come once the
running ones finish: about one service time late. Nothing here does I/O.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field

from prefixq.core.sharing import DEFAULT_PRIORITY, PRIORITIES, band

__all__ = ["SCALE", "SPAN", "EngineOrder", "band_priority"]

#: virtual time units per request of a tenant of weight 1 (weights 1/SCALE apart still differ)
SCALE = 1000
#: the room of one band's virtual times: a band's offset is its distance from ``normal`` times SPAN
SPAN = 1 << 50


def band_priority(priority: str) -> int:
    """The engine priority of the band alone (``high`` -1, ``normal`` 0, ``low`` 1): what a
    request gets with `EngineOrder` off."""
    return band(priority) - band(DEFAULT_PRIORITY)


@dataclass(slots=True)
class _Burst:
    tenant: str
    clock: int = 0
    inflight: int = 0


@dataclass(slots=True)
class _Band:
    bursts: dict[str, _Burst] = field(default_factory=dict)
    #: bursts with requests in the engine, by tenant
    tenants: Counter[str] = field(default_factory=Counter)
    #: virtual times of the requests in the engine (a heap; those left are in ``gone``)
    tags: list[int] = field(default_factory=list)
    gone: Counter[int] = field(default_factory=Counter)
    inflight: int = 0

    def front(self) -> int:
        tags, gone = self.tags, self.gone
        while gone and gone[tags[0]]:
            top = heapq.heappop(tags)
            gone[top] -= 1
            if not gone[top]:
                del gone[top]
        return tags[0]

    def compact(self) -> None:
        """Drop the tags of requests gone (``front`` drops them only from the top)."""
        keep, gone = [], self.gone
        for tag in self.tags:
            if gone[tag]:
                gone[tag] -= 1
            else:
                keep.append(tag)
        heapq.heapify(keep)
        self.tags, self.gone = keep, Counter()


class EngineOrder:
    """Each request's engine priority, in admission order (`enter`), and its leaving (`left`)."""

    def __init__(self) -> None:
        self._bands = [_Band() for _ in PRIORITIES]

    def enter(self, priority: str, tenant: str, burst: str, weight: float) -> int:
        """The engine priority of a request of ``burst`` handed to the engine now; give it back
        to `left` when the request leaves the engine."""
        b_ = band(priority)
        b = self._bands[b_]
        f = b.bursts.get(burst)
        if f is None:
            f = b.bursts[burst] = _Burst(tenant)
        if not f.inflight:
            if b.inflight:
                f.clock = max(f.clock, b.front())
            b.tenants[tenant] += 1
        tag = min(f.clock, SPAN - 1)
        f.clock += max(1, round(SCALE * b.tenants[tenant] / weight))
        f.inflight += 1
        b.inflight += 1
        heapq.heappush(b.tags, tag)
        return band_priority(priority) * SPAN + tag

    def left(self, priority: str, burst: str, engine_priority: int) -> None:
        """A request that `enter` gave ``engine_priority`` left the engine."""
        b = self._bands[band(priority)]
        f = b.bursts[burst]
        f.inflight -= 1
        b.inflight -= 1
        tag = engine_priority - band_priority(priority) * SPAN
        b.gone[tag] += 1
        if not f.inflight:
            b.tenants[f.tenant] -= 1
            if not b.tenants[f.tenant]:
                del b.tenants[f.tenant]
        if not b.inflight:  # nothing of the band in the engine: no order to keep, start afresh
            self._bands[band(priority)] = _Band()
            return
        if len(b.tags) > 2 * b.inflight + 1024:  # an old request holds the front: compact
            b.compact()
        if len(b.bursts) > 2 * b.inflight + 64:  # forget idle bursts the front has passed
            front = b.front()
            for name in [n for n, x in b.bursts.items() if not x.inflight and x.clock <= front]:
                del b.bursts[name]

    def inflight(self, priority: str) -> int:
        """Requests of a priority in the engine (tests)."""
        return self._bands[band(priority)].inflight

    def kept(self, priority: str) -> int:
        """Virtual times and bursts kept for a priority (tests: bounded by what is in flight)."""
        b = self._bands[band(priority)]
        return len(b.tags) + len(b.gone) + len(b.bursts)
