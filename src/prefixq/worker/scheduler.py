"""Who gets the engine's free slots: priorities first, then tenants by weight, then bursts equally.

`Scheduler` is the worker's in-memory view of its shard's queues (no I/O: worker/reader.py does
the reading), and its policy. The queues themselves — each burst's `Lane` with its *stock* of
entries read and not yet admitted, the `Tenant` of its priority band it belongs to, and what each
tenant has in the engine — are `Lanes` (lanes.py), which the scheduler extends; what an entry
waits for before it is admitted is gates.py's. Two decisions per read round: `Scheduler.plan`
(what to read) and `Scheduler.pick` (what to admit), in the same order. Keep the default path
cheap: one burst, one tenant plans one read and picks in O(1) per entry.
docs/architecture.md, "Sharing a shard", has the rules, the read round and the costs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prefixq.core.settings import Settings
from prefixq.core.sharing import PRIORITIES, parse_caps, parse_weights
from prefixq.worker import gates
from prefixq.worker.deliveries import Delivery
from prefixq.worker.groups import Resident, take_whole
from prefixq.worker.lanes import Lane, Lanes, Picked, Tenant

if TYPE_CHECKING:
    from prefixq.worker.shard import ShardStream

__all__ = ["Plan", "Scheduler"]


@dataclass(slots=True)
class Plan:
    """One round's reads: XREADGROUP groups (keys, COUNT per key), and what each key was asked."""

    reads: list[tuple[list[str], int]] = field(default_factory=list)
    asked: dict[str, int] = field(default_factory=dict)
    #: nothing to read or pick: block on the intakes
    block: bool = False


class Scheduler(Lanes):
    """The worker's queues of one shard and who goes first. ``intakes``: the intake keys, highest
    priority first; ``lane_key(burst)``: a lane's key; ``weights``/``caps``: per tenant
    (settings)."""

    def __init__(
        self,
        intakes: list[str],
        lane_key: Callable[[str], str],
        *,
        weights: dict[str, float],
        caps: dict[str, int],
        read_count: int,
    ) -> None:
        super().__init__(lane_key, weights=weights, caps=caps)
        self.intakes = intakes
        self.read_count = read_count
        #: stock of a band beyond which its intake is not read (capped tenants' heads wait there)
        self.stock_max = 2 * read_count
        #: the last read of each band's intake was full: it may hold more
        self.intake_more = [True] * len(PRIORITIES)
        #: admission beyond fair shares (groups.py; off by default): whole groups, and the
        #: worker's window they must fit in; resident prefixes first; a pick held a group back
        self.whole_groups = False
        self.window = 0
        self.resident: Resident | None = None
        self.holding = False
        #: per band, reads of its intake that came back short (its entries all delivered)
        self.drained = [0] * len(PRIORITIES)
        #: the time of the last pick (gates hold `gates.GATE_S` at most)
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

    # ---- gates (gates.py) --------------------------------------------------------------------
    def place(self, lane: Lane, d: Delivery, now: float, *, from_lane: bool) -> None:
        """Note what ``d`` must wait for (`gates.place`); ``from_lane``: read from ``lane``'s
        stream (else from an intake)."""
        drained = self.drained[lane.tenant.band]
        gates.place(lane, d, now, from_lane=from_lane, drained=drained)

    def gated(self, lane: Lane, d: Delivery) -> bool:
        """``d`` still waits for entries of its burst sent before it (`gates.gated`)."""
        if not d.wait:  # the usual case: nothing to wait for
            return False
        return gates.gated(lane, d, drained=self.drained[lane.tenant.band], clock=self.clock)

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
            room = self._room_of(live[0], need, held_back)  # 0: at its cap with what it holds
            return {live[0].remote[0].key: room} if room else {}
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
                cap = self.caps.get(t.name)  # a group beyond the cap is admitted as it fits
                window = self.window or n if cap is None else min(self.window or n, cap)
                fit = take_whole(lane, k if single else n - len(out), window)
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
