"""The scheduler's lanes: each burst's work on a shard, the tenants it belongs to, its stock.

`Lanes` is the queue that scheduler.py's `Scheduler` schedules from, with no policy and no I/O.
Each burst with work on the shard is a `Lane`: its entries already read but not admitted (its
*stock*, kept in the producer's order) and whether its Redis lane may hold entries not yet
delivered (``remote``). Lanes belong to a `Tenant` of their priority band, and take turns within
it (the tenant's ``ready`` and ``remote`` turns). `Lanes` also keeps the entries taken over from
dead workers (admitted before anything else) and what each tenant has in the engine (admissions,
queue waits, caps). What to read and what to admit is the scheduler's (scheduler.py); what an
entry waits for before it is admitted is gates.py's.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prefixq.core.entries import Entry
from prefixq.core.sharing import PRIORITIES, band
from prefixq.worker.deliveries import Delivery, Ref

__all__ = ["Item", "Lane", "Lanes", "Picked", "Tenant"]

Item = tuple[Delivery, Entry]
#: an admitted entry and the tenant it is counted for (its request leaves: `Lanes.left`)
Picked = tuple[Delivery, Entry, "Tenant"]


@dataclass(eq=False, slots=True)
class Tenant:
    """A tenant within one priority band."""

    name: str
    band: int
    weight: float
    #: grows by 1/weight per admission; the least goes first
    vtime: float = 0.0
    active: bool = False
    #: entries in the stock of its lanes
    stocked: int = 0
    #: its lanes with stock, in turn
    ready: deque[Lane] = field(default_factory=deque)
    #: its lanes that may hold undelivered entries, in turn
    remote: deque[Lane] = field(default_factory=deque)
    #: requests inside the engine; admitted so far and their queue waits summed (and the part of
    #: those already reported to Redis: `Lanes.tallies`)
    running: int = 0
    admissions: int = 0
    waited: float = 0.0
    reported: tuple[int, float] = (0, 0.0)

    def has_ready(self) -> bool:
        while self.ready and not self.ready[0].stock:
            self.ready.popleft().queued = False
        return bool(self.ready)

    def has_remote(self) -> bool:
        while self.remote and not (self.remote[0].remote and not self.remote[0].ended):
            self.remote.popleft().rotating = False
        return bool(self.remote)


@dataclass(eq=False, slots=True)
class Lane:
    """One burst's work on this shard."""

    burst: str
    key: str
    tenant: Tenant
    stock: deque[Item] = field(default_factory=deque)
    #: the lane stream exists in Redis (the index or a doorbell said so)
    exists: bool = False
    #: it may hold entries not yet delivered
    remote: bool = False
    #: its producer has sent every entry
    sealed: bool = False
    #: its burst was cancelled or expired: its entries are read out apart, never admitted
    ended: bool = False
    #: when ``exists`` was last confirmed (monotonic), so an older index read cannot undo it
    seen: float = 0.0
    queued: bool = False
    rotating: bool = False
    #: the prefix of its last admitted entry (whole-group admission: groups.py)
    last_ref: str | None = None
    #: of its burst's entries on the shard, how many lane entries and how many intake entries
    #: are known to be delivered (to this worker or another: each stream is read in order), from
    #: the places (`POS`) of those this worker read
    lane_read: int = 0
    intake_read: int = 0


class Lanes:
    """The lanes and tenants of one shard, and what they hold. ``lane_key(burst)``: a lane's key;
    ``weights``/``caps``: per tenant (settings)."""

    def __init__(
        self,
        lane_key: Callable[[str], str],
        *,
        weights: dict[str, float],
        caps: dict[str, int],
    ) -> None:
        self._lane_key = lane_key
        self.weights, self.caps = weights, caps
        self.lanes: dict[str, Lane] = {}
        self.by_key: dict[str, Lane] = {}
        self.bands: list[dict[str, Tenant]] = [{} for _ in PRIORITIES]
        self.stocked = [0] * len(PRIORITIES)
        #: entries taken over from dead workers: admitted before anything else
        self.first: deque[Item] = deque()
        #: lanes of ended bursts that may hold entries: read out apart from the shares
        self.draining: set[Lane] = set()
        #: every entry in stock or in ``first`` (leased to this worker)
        self.held: set[Ref] = set()
        #: requests inside the engine by tenant name, whatever the priority (kept for caps only)
        self.inflight: Counter[str] = Counter()
        #: lanes whose next entry is gated (gates.py): read whatever is asked of the others
        self.waiting: set[Lane] = set()

    # ---- lanes and tenants -------------------------------------------------------------------
    def tenant(self, band_: int, name: str) -> Tenant:
        t = self.bands[band_].get(name)
        if t is None:
            t = self.bands[band_][name] = Tenant(name, band_, self.weights.get(name, 1.0))
        return t

    def lane(self, burst: str, priority: str, tenant: str) -> Lane:
        """The lane of ``burst`` (made on first sight)."""
        lane = self.lanes.get(burst)
        if lane is None:
            key = self._lane_key(burst)
            lane = Lane(burst, key, self.tenant(band(priority), tenant))
            self.lanes[burst] = self.by_key[key] = lane
        return lane

    def drop(self, lane: Lane) -> None:
        """Forget a lane (closed, or a head with nothing left); its stock must be empty."""
        lane.remote = lane.exists = False
        self.draining.discard(lane)
        if self.lanes.get(lane.burst) is lane:
            del self.lanes[lane.burst]
            self.by_key.pop(lane.key, None)

    def _activate(self, t: Tenant) -> None:
        """A tenant back after an idle spell starts at the least virtual time of its band's
        active tenants: its share from then on, no credit for the past."""
        if t.active:
            return
        others = [  # no credit for the idle time, no debt either
            o.vtime
            for o in self.bands[t.band].values()
            if o is not t and (o.has_ready() or o.has_remote())
        ]
        if others:
            t.vtime = max(t.vtime, min(others))
        t.active = True

    def end(self, lane: Lane) -> None:
        """``lane``'s burst was cancelled or expired: what it holds is read out, never admitted."""
        lane.ended = True
        if lane.remote:
            self.draining.add(lane)

    def set_remote(self, lane: Lane, more: bool) -> None:
        """Whether ``lane``'s stream may hold undelivered entries."""
        lane.remote = more and lane.exists
        if lane.ended:
            (self.draining.add if lane.remote else self.draining.discard)(lane)
        elif lane.remote and not lane.rotating:
            lane.rotating = True
            lane.tenant.remote.append(lane)
            self._activate(lane.tenant)

    # ---- stock -------------------------------------------------------------------------------
    def stock(self, lane: Lane, item: Item) -> None:
        """An entry read for ``lane``, to be admitted in turn."""
        self.stock_many(lane, [item])

    def stock_many(self, lane: Lane, items: list[Item]) -> None:
        """Entries read for ``lane`` (its own stream's, in one go), to be admitted in turn."""
        if not items:
            return
        if any(d.wait for d, _ in items):  # it may hold its lane back (`Scheduler._held_back`)
            self.waiting.add(lane)
        if _in_order(lane.stock, items):
            lane.stock.extend(items)
        else:  # read ahead of entries enqueued before them: in the producer's order
            lane.stock = deque(sorted([*lane.stock, *items], key=_rank))
        self.held.update([d.ref for d, _ in items])
        t = lane.tenant
        t.stocked += len(items)
        self.stocked[t.band] += len(items)
        if not lane.queued:
            lane.queued = True
            t.ready.append(lane)
            self._activate(t)

    def take_over(self, item: Item) -> None:
        """An entry claimed from a dead worker: admitted before anything else."""
        self.first.append(item)
        self.held.add(item[0].ref)

    def unstock(self) -> list[Item]:
        """Everything read and not admitted (the lanes' stock and ``first``), removed."""
        out = list(self.first)
        self.first.clear()
        for b in self.bands:
            for t in b.values():
                for lane in t.ready:
                    out += lane.stock
                    lane.stock.clear()
                    lane.queued = False
                t.ready.clear()
                t.stocked = 0
        self.stocked = [0] * len(self.stocked)
        self.held.clear()
        self.waiting.clear()
        return out

    def capped(self, name: str) -> bool:
        cap = self.caps.get(name)
        return cap is not None and self.inflight[name] >= cap

    def capped_waiting(self) -> bool:
        """Stock waits only because its tenants are at their caps."""
        return any(t.stocked and self.capped(t.name) for b in self.bands for t in b.values())

    # ---- admission accounting ----------------------------------------------------------------
    def tenant_of(self, e: Entry) -> Tenant:
        return self.tenant(band(e.priority), e.tenant)

    def admitted(self, t: Tenant, e: Entry, now: float) -> None:
        """``e`` goes into the engine without being picked (the backlog replay)."""
        t.running += 1
        t.admissions += 1
        if e.enqueued:
            t.waited += max(0.0, now - e.enqueued)
        if self.caps:
            self.inflight[t.name] += 1

    def left(self, t: Tenant) -> None:
        """A request of ``t`` left the engine."""
        t.running -= 1
        if self.caps:
            self.inflight[t.name] -= 1

    def per_tenant(self) -> dict[tuple[str, str], tuple[int, int, float]]:
        """(priority, tenant) -> (in the engine, admitted, queue waits summed) (metrics; safe to
        call from another thread: it copies before it iterates)."""
        out = {}
        for b, tenants in enumerate(self.bands):
            for t in list(tenants.values()):
                out[(PRIORITIES[b], t.name)] = (t.running, t.admissions, t.waited)
        return out

    def tallies(self) -> list[tuple[str, str, int, float]]:
        """(priority, tenant, admitted, queue waits summed) since the last call (the heartbeat
        adds them to the shard's counters in Redis, for `prefixq inspect`)."""
        out = []
        for b, tenants in enumerate(self.bands):
            for t in tenants.values():
                n, w = t.reported
                if t.admissions != n:
                    out.append((PRIORITIES[b], t.name, t.admissions - n, t.waited - w))
                    t.reported = (t.admissions, t.waited)
        return out


def _rank(item: Item) -> int:
    return item[0].rank


def _in_order(stock: deque[Item], items: list[Item]) -> bool:
    """``items`` follow ``stock`` in the producer's order (the usual case: no sort needed)."""
    last = stock[-1][0].rank if stock else -1
    for d, _ in items:
        if d.rank < last:
            return False
        last = d.rank
    return True
