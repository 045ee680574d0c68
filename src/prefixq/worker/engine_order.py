"""Engine priorities that carry the fair shares into the engine's own queue.

The worker keeps up to ``max_inflight`` requests inside vLLM (twice its ``max_num_seqs``), so a
burst that fits that window goes in whole and vLLM, not the scheduler, decides who runs next.
vLLM's ``scheduling_policy="priority"`` serves waiting requests by (priority, arrival), lower
first, and takes any int. `EngineOrder` gives each request a priority = its band's offset
(``high`` < ``normal`` < ``low``, `SPAN` apart: strict) plus a virtual time:

- each burst has a clock that grows by k / weight per request handed to the engine (its
  tenant's weight; k: that tenant's bursts with requests in the engine), so bursts of a band
  interleave inside the engine by tenant weight, and a tenant's bursts share its weight;
- a burst with no request in the engine starts at the band's *front*, never below its own
  clock (no credit for an idle spell): the mean, over the band's bursts in the engine, of how
  far each has got there (the largest virtual time of its requests that finished, or its oldest
  one while none has). A burst that arrives while the engine is busy with others thus goes
  before part of what they have waiting there, about its share of the requests running when it
  arrived: those finish for the others while it waits, and its completions keep pace with
  theirs from then on. The mean of completion fronts, not the oldest request still there, so
  one slow request does not hand a newcomer credit for everything started since.

Requests already running are not preempted by a lower value (vLLM preempts only when KV blocks
run out, and then the highest value it runs), so a burst's first completions come once the
running ones finish: about one service time late. Nothing here does I/O.
"""

from __future__ import annotations

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
    #: how far it has got in the engine: the largest virtual time of its requests that
    #: finished since it entered, its first one's before that
    front: int = 0


@dataclass(slots=True)
class _Band:
    bursts: dict[str, _Burst] = field(default_factory=dict)
    #: bursts with requests in the engine, by tenant
    tenants: Counter[str] = field(default_factory=Counter)
    #: the fronts of the bursts with requests in the engine, summed, and how many
    fronts: int = 0
    live: int = 0
    inflight: int = 0


class EngineOrder:
    """Each request's engine priority, in admission order (`enter`), and its leaving (`left`)."""

    def __init__(self) -> None:
        self._bands = [_Band() for _ in PRIORITIES]

    def enter(self, priority: str, tenant: str, burst: str, weight: float) -> int:
        """The engine priority of a request of ``burst`` handed to the engine now; give it back
        to `left` when the request leaves the engine."""
        b = self._bands[band(priority)]
        f = b.bursts.get(burst)
        if f is None:
            f = b.bursts[burst] = _Burst(tenant)
        if not f.inflight:  # it enters: at the band's front, or its own clock if ahead
            if b.live:
                f.clock = max(f.clock, b.fronts // b.live)
            f.front = f.clock = min(f.clock, SPAN - 1)
            b.fronts += f.front
            b.live += 1
            b.tenants[tenant] += 1
        tag = f.clock
        f.clock = min(f.clock + max(1, round(SCALE * b.tenants[tenant] / weight)), SPAN - 1)
        f.inflight += 1
        b.inflight += 1
        return band_priority(priority) * SPAN + tag

    def left(self, priority: str, burst: str, engine_priority: int) -> None:
        """A request that `enter` gave ``engine_priority`` left the engine."""
        b = self._bands[band(priority)]
        f = b.bursts[burst]
        f.inflight -= 1
        b.inflight -= 1
        if not b.inflight:  # nothing of the band in the engine: no order to keep, start afresh
            self._bands[band(priority)] = _Band()
            return
        if f.inflight:
            tag = engine_priority - band_priority(priority) * SPAN
            if tag > f.front:
                b.fronts += tag - f.front
                f.front = tag
        else:  # it left the engine
            b.fronts -= f.front
            b.live -= 1
            b.tenants[f.tenant] -= 1
            if not b.tenants[f.tenant]:
                del b.tenants[f.tenant]
            if len(b.bursts) > 2 * b.live + 64:  # forget idle bursts (back, one starts at the
                # front: credit for at most what it ran ahead of it)
                for name in [n for n, x in b.bursts.items() if not x.inflight]:
                    del b.bursts[name]

    def inflight(self, priority: str) -> int:
        """Requests of a priority in the engine (tests)."""
        return self._bands[band(priority)].inflight

    def kept(self, priority: str) -> int:
        """Bursts remembered for a priority (tests: bounded by those in the engine)."""
        return len(self._bands[band(priority)].bursts)
