"""The soak's faults of an elastic fleet (docs/delivery.md, "An elastic fleet"): a GPU that is
lost for good, one that joins mid-burst, one that drains and leaves. Every primary worker runs
with ``--hand-over``, and the soak's ``orphan_after_s`` is a few heartbeats. How each is seen:

- ``worker_lost``: a primary with entries pending on it and no other worker of its shard alive
  (serving or starting), killed -9 (its exit status says so) and never started again: the
  moves stream then records its shard's queue moving to live shards (``why`` orphaned, from
  that shard) within ``orphan_after_s`` plus its heartbeat's TTL and a margin; a shard is only
  lost while another primary serves;
- ``worker_join``: a worker started with ``--join`` serves (its heartbeat says so) on the shard
  its log names: the lowest one without a live worker (a lost or drained one), else a new one,
  the deployment's shard count grown by one (at most two new shards a run);
- ``worker_drain``: SIGTERM to a primary with entries queued on its shard, and no other worker
  there: exit 0 within the stop bound, and the moves stream records its queue handed over
  (``why`` drain, from that shard); it is not started again (a join or the end of the schedule
  brings the shard back).

Shards left without a worker by these are what `Soak.restore` serves again once the schedule
is over; until then producers place nothing new there and what was queued has moved.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import redis

from prefixq.store.deployment import resolve_shards
from prefixq.worker.worker import stop_bound_s
from soaklib.deployment import Worker, pending_on, queue_keys
from soaklib.faults import Fault, busy_primary, sigterm
from soaklib.run import Landed, SoakRun

#: seconds past orphan_after_s + the heartbeat TTL a lost shard's queue may take to start moving
MOVE_MARGIN_S = 15.0
#: new shards the joins of one run may add
MAX_GROWTH = 2


def _live_primaries(soak: SoakRun) -> list[Worker]:
    n = resolve_shards(soak.r, soak.settings)
    return [w for k in range(n) if (w := soak.workers.primary(k)) is not None]


def _moved_from(soak: SoakRun, shard: int, why: str, since_ms: int) -> int:
    """Requests the moves stream records moved off ``shard`` for ``why`` since ``since_ms``."""
    n = 0
    for _, f in soak.r.xrange(soak.keys.moves, min=f"{since_ms}-0"):
        if f.get(b"why") == why.encode() and f.get(b"from") == str(shard).encode():
            n += int(f.get(b"requests") or 0)
    return n


def _now_ms(soak: SoakRun) -> int:
    secs, micros = soak.r.time()
    return int(secs) * 1000 + int(micros) // 1000


class WorkerLost(Fault):
    kind = "worker_lost"
    weight = 1.0

    def run(self, soak: SoakRun) -> list[Landed]:
        if len(_live_primaries(soak)) < 2:
            return []
        # alone on its shard: a worker still starting there (a restart, or a join that took the
        # shard while the restart warmed up) keeps the shard live, and nothing should move
        got = busy_primary(soak, alone=True)
        if got is None:
            return []
        w, n = got
        since = _now_ms(soak)
        w.proc.send_signal(signal.SIGKILL)
        if w.proc.wait(30) != -signal.SIGKILL:
            return []
        s = soak.settings
        bound = s.orphan_after_s + s.heartbeat_ttl_s + MOVE_MARGIN_S
        t0 = time.monotonic()
        while time.monotonic() - t0 < bound:
            moved = _moved_from(soak, w.shard, "orphaned", since)
            if moved:
                took = time.monotonic() - t0
                return [
                    Landed(
                        self.kind,
                        f"{w.name} (shard {w.shard}) killed -9 with {n} entries pending, not "
                        f"restarted: {moved} requests moved off its shard after {took:.1f}s",
                    )
                ]
            time.sleep(0.25)
        soak.problem(f"shard {w.shard}'s queue did not move within {bound:.0f}s of losing {w.name}")
        return []


class WorkerJoin(Fault):
    kind = "worker_join"
    weight = 1.0

    def run(self, soak: SoakRun) -> list[Landed]:
        before = resolve_shards(soak.r, soak.settings)
        served = {w.shard for w in _live_primaries(soak)}
        if len(served) == before and before >= soak.settings.shards + MAX_GROWTH:
            return []
        w = soak.workers.start(-1, "", "--join")
        if not soak.workers.wait_serving(w, soak.r, 60):
            soak.problem(f"joining worker {w.name} did not serve:\n{w.log.read_text()[-1500:]}")
            return []
        after = resolve_shards(soak.r, soak.settings)
        how = "a new shard" if after > before else "a shard without a live worker"
        return [Landed(self.kind, f"{w.name} joined as shard {w.shard} ({how}) and serves")]


class WorkerDrain(Fault):
    kind = "worker_drain"
    weight = 1.0

    def run(self, soak: SoakRun) -> list[Landed]:
        primaries = _live_primaries(soak)
        if len(primaries) < 2:
            return []
        # the primary alone on its shard with the most entries queued and not yet read (a drain
        # of an empty queue hands nothing over: it is not counted)
        best: tuple[int, Worker, int] | None = None
        for w in primaries:
            others = [x for x in soak.workers.all if x.shard == w.shard and x.alive and x is not w]
            if others or not soak.workers.serving(w, soak.r):
                continue
            try:
                queued = sum(soak.r.xlen(k) for k in queue_keys(soak.r, soak.keys, w.shard))
                n = pending_on(soak.r, soak.keys, w.shard, w.name)
            except redis.RedisError:
                return []
            if queued - n > 0 and (best is None or queued - n > best[0]):
                best = (queued - n, w, n)
        if best is None:
            return []
        _, w, n = best
        since = _now_ms(soak)
        if sigterm(soak, w, n, self.kind, " (draining)") is None:
            return []
        moved = _moved_from(soak, w.shard, "drain", since)
        if not moved:
            return []  # its engine finished what was queued first: nothing to hand over
        bound = stop_bound_s(soak.settings, hand_over=True)
        return [
            Landed(
                self.kind,
                f"{w.name} (shard {w.shard}) drained: exit 0 within {bound:.0f}s, "
                f"{moved} requests handed over, not restarted",
            )
        ]


#: the fleet's kinds, beside faults.FAULTS
FLEET_FAULTS: dict[str, Callable[[], Fault]] = {
    f.kind: f for f in (WorkerLost, WorkerJoin, WorkerDrain)
}
