"""Gates: an entry read ahead of entries of its burst sent before it waits for them.

A burst's entries reach a shard through two streams, its lane and the intake of its priority (a
lane's doorbell, a chunk's single entry, the head), and a worker reads the two apart, either one
ahead of the other. Every entry carries its place in the burst's enqueue order there (`POS`:
the lane entries and the intake entries sent before it; client/layout.py). `place` notes what an
entry must wait for, and `gated` whether it still waits: such an entry stays in its lane's stock
and fills no slot. No I/O: the scheduler (scheduler.py) calls both, with its count of short
intake reads and its clock. docs/architecture.md, "Sharing a shard", has the argument.
"""

from __future__ import annotations

from prefixq.core.keys import CARRIED, POS
from prefixq.worker.deliveries import WAIT_INTAKE, WAIT_LANE, Delivery
from prefixq.worker.lanes import Lane

__all__ = ["GATE_S", "gated", "place"]

#: seconds at most that a lane entry waits for the intake entry of its burst sent before it
#: (`gated`): the intake may be backed up behind other bursts' entries, and the burst's
#: fair turns are not held up longer than this for its order
GATE_S = 1.0


def place(lane: Lane, d: Delivery, now: float, *, from_lane: bool, drained: int) -> None:
    """Note ``d``'s place in its burst's enqueue order (`POS`, client/layout.py) and what it
    must wait for; ``from_lane``: read from ``lane``'s stream (else from an intake); ``drained``:
    the reads of the intake of ``lane``'s band that came back short so far. An entry put back on
    the intake (`CARRIED`) waits for nothing and tells nothing; a place that does not parse (a
    forged entry) is ignored."""
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
            d.wait, d.before, d.mark = WAIT_INTAKE, n_intake, drained
            d.read_at = now
    else:
        lane.intake_read = max(lane.intake_read, n_intake + 1)
        if n_lane > lane.lane_read:
            d.wait, d.before = WAIT_LANE, n_lane


def gated(lane: Lane, d: Delivery, *, drained: int, clock: float) -> bool:
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
    elif d.before > lane.intake_read and d.mark == drained and clock - d.read_at < GATE_S:
        return True
    d.wait = 0
    return False
