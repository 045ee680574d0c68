"""Who gets the engine's free slots: priorities first, then tenants by weight, then bursts equally.

`Scheduler` is the worker's in-memory view of its shard's queues (no I/O: worker/reader.py does
the reading). Each burst with work on the shard is a `Lane`: its entries already read but not
admitted (its *stock*), and whether its Redis lane may hold entries not yet delivered
(``remote``). Lanes belong to a `Tenant` of their priority band. Two decisions per read round:
`Scheduler.plan` (what to read) and `Scheduler.pick` (what to admit), in the same order. Keep the
default path cheap: one burst, one tenant plans one read and picks in O(1) per entry.
docs/architecture.md, "Sharing a shard", has the rules, the read round and the costs.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prefixq.core.entries import Entry
from prefixq.core.keys import CARRIED, POS
from prefixq.core.settings import Settings
from prefixq.core.sharing import PRIORITIES, band, parse_caps, parse_weights
from prefixq.worker.deliveries import WAIT_INTAKE, WAIT_LANE, Delivery, Ref
from prefixq.worker.groups import Resident, take_whole

if TYPE_CHECKING:
    from prefixq.worker.shard import ShardStream

__all__ = ["Lane", "Plan", "Scheduler", "Tenant"]

Item = tuple[Delivery, Entry]
#: seconds at most that a lane entry waits for the intake entry of its burst sent before it
#: (`Scheduler.gated`): the intake may be backed up behind other bursts' entries, and the burst's
#: fair turns are not held up longer than this for its order
GATE_S = 1.0
#: an admitted entry and the tenant it is counted for (its request leaves: `Scheduler.left`)
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
    #: those already reported to Redis: `Scheduler.tallies`)
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


@dataclass(slots=True)
class Plan:
    """One round's reads: XREADGROUP groups (keys, COUNT per key), and what each key was asked."""

    reads: list[tuple[list[str], int]] = field(default_factory=list)
    asked: dict[str, int] = field(default_factory=dict)
    #: nothing to read or pick: block on the intakes
    block: bool = False


class Scheduler:
    """The worker's queues of one shard. ``intakes``: the intake keys, highest priority first;
    ``lane_key(burst)``: a lane's key; ``weights``/``caps``: per tenant (settings)."""

    def __init__(
        self,
        intakes: list[str],
        lane_key: Callable[[str], str],
        *,
        weights: dict[str, float],
        caps: dict[str, int],
        read_count: int,
    ) -> None:
        self.intakes = intakes
        self._lane_key = lane_key
        self.weights, self.caps = weights, caps
        self.read_count = read_count
        #: stock of a band beyond which its intake is not read (capped tenants' heads wait there)
        self.stock_max = 2 * read_count
        self.lanes: dict[str, Lane] = {}
        self.by_key: dict[str, Lane] = {}
        self.bands: list[dict[str, Tenant]] = [{} for _ in PRIORITIES]
        #: the last read of each band's intake was full: it may hold more
        self.intake_more = [True] * len(PRIORITIES)
        self.stocked = [0] * len(PRIORITIES)
        #: entries taken over from dead workers: admitted before anything else
        self.first: deque[Item] = deque()
        #: lanes of ended bursts that may hold entries: read out apart from the shares
        self.draining: set[Lane] = set()
        #: every entry in stock or in ``first`` (leased to this worker)
        self.held: set[Ref] = set()
        #: requests inside the engine by tenant name, whatever the priority (kept for caps only)
        self.inflight: Counter[str] = Counter()
        #: admission beyond fair shares (groups.py; off by default): whole groups, and the
        #: worker's window they must fit in; resident prefixes first; a pick held a group back
        self.whole_groups = False
        self.window = 0
        self.resident: Resident | None = None
        self.holding = False
        #: lanes whose next entry is `gated`: read whatever is asked of the others
        self.waiting: set[Lane] = set()
        #: per band, reads of its intake that came back short (its entries all delivered)
        self.drained = [0] * len(PRIORITIES)
        #: the time of the last pick (gates hold `GATE_S` at most)
        self.clock = 0.0

    def set_admission(self, *, whole_groups: bool, resident_first: bool) -> None:
        """Switch groups.py's admission orders on or off (settings, or `prefixq bench`)."""
        self.whole_groups = whole_groups
        if not resident_first:
            self.resident = None
        elif self.resident is None:
            self.resident = Resident()

    @classmethod
    def of(cls, stream: ShardStream, settings: Settings) -> Scheduler:
        """The scheduler of ``stream``'s shard, with the settings' tenant weights and caps."""
        shard, keys = stream.shard, stream.keys
        sched = cls(
            stream.intakes,
            lambda burst: keys.lane(shard, burst),
            weights=parse_weights(settings.tenant_weights),
            caps=parse_caps(settings.tenant_caps),
            read_count=settings.read_count,
        )
        sched.set_admission(
            whole_groups=settings.group_admission, resident_first=settings.resident_first
        )
        return sched

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

    def place(self, lane: Lane, d: Delivery, now: float, *, from_lane: bool) -> None:
        """Note ``d``'s place in its burst's enqueue order (`POS`, client/layout.py) and what it
        must wait for; ``from_lane``: read from ``lane``'s stream (else from an intake). An entry
        put back on the intake (`CARRIED`) waits for nothing and tells nothing; a place that does
        not parse (a forged entry) is ignored."""
        fields = d.fields
        raw = fields.get(POS) if fields else None
        if raw is None:
            return
        lanes, _, intakes = raw.partition(b":")
        if not (lanes.isdigit() and intakes.isdigit() and len(raw) < 40):
            return
        n_lane, n_intake = int(lanes), int(intakes)
        d.rank = n_lane + n_intake
        if CARRIED in fields:
            return
        if from_lane:
            lane.lane_read = max(lane.lane_read, n_lane + 1)
            if n_intake > lane.intake_read:
                d.wait, d.before, d.mark = WAIT_INTAKE, n_intake, self.drained[lane.tenant.band]
                d.read_at = now
        else:
            lane.intake_read = max(lane.intake_read, n_intake + 1)
            if n_lane > lane.lane_read:
                d.wait, d.before = WAIT_LANE, n_lane

    def gated(self, lane: Lane, d: Delivery) -> bool:
        """``d`` waits for entries of its burst sent before it that may still be undelivered
        (`place`): a doorbell read ahead of the lane entries it announces, while its lane may
        hold them (the lane is read meanwhile: a round or a few); a lane entry read ahead of the
        intake entry before it (its chunk's predecessor's doorbell, or the head), until that is
        read or a read of the intake comes back short, `GATE_S` at most. A gate once open stays
        open (``d.wait`` is cleared)."""
        if not d.wait:
            return False
        if d.wait == WAIT_LANE:
            if d.before > lane.lane_read and lane.remote:
                return True
        elif (
            d.before > lane.intake_read
            and d.mark == self.drained[lane.tenant.band]
            and self.clock - d.read_at < GATE_S
        ):
            return True
        d.wait = 0
        return False

    def stock(self, lane: Lane, item: Item) -> None:
        """An entry read for ``lane``, to be admitted in turn."""
        self.stock_many(lane, [item])

    def stock_many(self, lane: Lane, items: list[Item]) -> None:
        """Entries read for ``lane`` (its own stream's, in one go), to be admitted in turn."""
        if not items:
            return
        if any(d.wait for d, _ in items):  # it may hold its lane back (`_held_back`)
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

    # ---- the two decisions -------------------------------------------------------------------
    def top_band(self) -> int | None:
        """The highest band with work: stock or possible remote entries of a tenant not at its
        cap, or an intake that may hold more and will be read (not while the band's stock, all
        of capped tenants then, is at `stock_max`: that would hold lower bands back for nothing)."""
        for b, tenants in enumerate(self.bands):
            for t in tenants.values():
                work = t.has_ready() or t.has_remote()
                if not work:
                    t.active = False
                elif not self.capped(t.name):
                    return b
            if self.intake_more[b] and self.stocked[b] < self.stock_max:
                return b
        return None

    def plan(self, room: int) -> Plan:
        """What to read this round, for ``room`` free slots.

        Only the highest band that has work (strict priority) is read, as many entries as the
        free slots its stock cannot fill, spread over its tenants by weight (the tenant with the
        least virtual time first; a tenant's virtual time grows by 1/weight per admission) and
        over each tenant's lanes in turn; the intakes of that band and of the bands above it are
        read too (new bursts' heads, lane doorbells). Lanes of ended bursts are read out apart."""
        plan = Plan()
        drain = [lane.key for lane in self.draining]
        top = self.top_band()
        if top is None:
            if not self.first and not drain:
                plan.block = True
                plan.reads = [(list(self.intakes), min(room, self.read_count))]
                plan.asked = dict.fromkeys(self.intakes, plan.reads[0][1])
                return plan
        else:
            tenants = [t for t in self.bands[top].values() if not self.capped(t.name)]
            held_back = self._held_back(top)
            need = room - len(self.first) - sum(t.stocked - held_back[t.name] for t in tenants)
            if need > 0:
                for b in range(top + 1):
                    if self.stocked[b] < self.stock_max:
                        plan.asked[self.intakes[b]] = need
                by_count: dict[int, list[str]] = {}
                for key, n in self._allocate(tenants, need, held_back).items():
                    by_count.setdefault(n, []).append(key)
                    plan.asked[key] = n
                intakes = [k for k in self.intakes if k in plan.asked]
                if intakes:
                    by_count.setdefault(need, [])[:0] = intakes
                plan.reads = [(keys, n) for n, keys in by_count.items()]
        if drain:
            plan.reads.append((drain, self.read_count))
            plan.asked.update(dict.fromkeys(drain, self.read_count))
        return plan

    def _held_back(self, band_: int) -> Counter[str]:
        """The stock of band ``band_``'s lanes whose next entry is gated, by tenant name: it
        fills no slot (its lanes are read on meanwhile; lanes no longer gated leave
        `waiting`)."""
        out: Counter[str] = Counter()
        if not self.waiting:  # the usual round: nothing to look at
            return out
        keep = [lane for lane in self.waiting if lane.stock and self.gated(lane, lane.stock[0][0])]
        self.waiting = set(keep)
        for lane in keep:
            if lane.tenant.band == band_:
                out[lane.tenant.name] += len(lane.stock)
        return out

    def _allocate(
        self, tenants: list[Tenant], need: int, held_back: Counter[str]
    ) -> dict[str, int]:
        """``need`` reads spread over the remote lanes of ``tenants`` (lane key -> count);
        ``held_back``: stock of gated lanes by tenant name."""
        live = [t for t in tenants if t.has_remote()]
        if not live:
            return {}
        if len(live) == 1 and len(live[0].remote) == 1:  # the default path: one burst
            return {live[0].remote[0].key: self._room_of(live[0], need, held_back)}
        out: Counter[str] = Counter()
        vt = {id(t): t.vtime for t in live}
        left = {id(t): self._room_of(t, need, held_back) for t in live}
        for _ in range(need):
            open_ = [t for t in live if left[id(t)] > 0 and t.has_remote()]
            if not open_:
                break
            t = min(open_, key=lambda x: vt[id(x)])
            lane = t.remote.popleft()
            t.remote.append(lane)
            out[lane.key] += 1
            vt[id(t)] += 1.0 / t.weight
            left[id(t)] -= 1
        return dict(out)

    def _room_of(self, t: Tenant, need: int, held_back: Counter[str]) -> int:
        cap = self.caps.get(t.name)
        if cap is None:
            return need
        return max(0, min(need, cap - self.inflight[t.name] - t.stocked + held_back[t.name]))

    def read(self, plan: Plan, counts: dict[str, int]) -> None:
        """What the reads of ``plan`` returned (entries per key): a lane that gave fewer than
        asked is drained for now (its doorbell will say when it has more)."""
        for key, asked in plan.asked.items():
            got = counts.get(key, 0)
            lane = self.by_key.get(key)
            if lane is not None:
                self.set_remote(lane, got >= asked)
            elif key in self.intakes:
                b = self.intakes.index(key)
                self.intake_more[b] = got >= asked
                if got < asked:
                    self.drained[b] += 1

    def pick(self, n: int, now: float) -> list[Picked]:
        """Up to ``n`` entries to admit now, in admission order: one slot at a time, from the
        stock, entries taken over from dead workers first, then the highest band with work, the
        tenant with the least virtual time (not at its cap), its next lane in turn."""
        out: list[Picked] = []
        held = self.held
        self.holding = False
        self.clock = now
        while self.first and len(out) < n:
            d, e = self.first.popleft()
            held.discard(d.ref)
            t = self.tenant_of(e)
            self.admitted(t, e, now)
            out.append((d, e, t))
        top = self.top_band() if len(out) < n else None
        if top is None:
            return out
        tenants = [t for t in self.bands[top].values() if t.has_ready() and not self.capped(t.name)]
        resident = self.resident
        while tenants and len(out) < n:
            t = tenants[0] if len(tenants) == 1 else min(tenants, key=_vtime)
            if resident is not None and len(tenants) > 1:
                t = resident.prefer(tenants, t)
            lane = self._open(t)
            if lane is None:  # each of its lanes waits for entries sent before its next one
                tenants.remove(t)  # (its stock fills no slot: `plan` reads on for them)
                continue
            k = 1
            if len(tenants) == 1 and len(t.ready) == 1:  # one lane to take from: in one go
                k = min(n - len(out), len(lane.stock))
                cap = self.caps.get(t.name)
                if cap is not None:
                    k = max(1, min(k, cap - self.inflight[t.name]))
            if self.whole_groups:
                single = len(tenants) == 1 and len(t.ready) == 1
                fit = take_whole(lane, k if single else n - len(out), self.window or n)
                if not fit:  # its next group waits for room; the other tenants may go
                    self.holding = True
                    tenants.remove(t)
                    continue
                k = fit if single else 1
            waited = 0.0
            stock, taken = lane.stock, 0
            for _ in range(k):
                d, e = stock[0]
                if d.wait and self.gated(lane, d):  # it waits: the rest too
                    self.waiting.add(lane)
                    break
                stock.popleft()
                taken += 1
                held.discard(d.ref)
                if e.enqueued:
                    waited += now - e.enqueued
                out.append((d, e, t))
                lane.last_ref = e.prefix_ref
                if resident is not None:
                    resident.note(e)
            if not lane.stock:
                t.ready.popleft()
                lane.queued = False
            elif k == 1:
                t.ready.rotate(-1)
            k = taken
            t.stocked -= k
            self.stocked[top] -= k
            t.vtime += k / t.weight
            t.running += k
            t.admissions += k
            t.waited += max(0.0, waited)
            if self.caps:
                self.inflight[t.name] += k
            if self.capped(t.name) or not t.has_ready():
                tenants.remove(t)
        return out

    def _open(self, t: Tenant) -> Lane | None:
        """``t``'s next lane in turn whose next entry is not gated (the gated ones go to the back
        of its turn and into `waiting`), or None."""
        ready = t.ready
        for _ in range(len(ready)):
            lane = ready[0]
            if not lane.stock:
                ready.popleft()
                lane.queued = False
            elif self.gated(lane, lane.stock[0][0]):
                self.waiting.add(lane)
                ready.rotate(-1)
            else:
                return lane
        return None


def _vtime(t: Tenant) -> float:
    return t.vtime


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
