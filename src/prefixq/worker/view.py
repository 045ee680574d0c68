"""`WorkerView`: what the worker's helpers and its middleware see of the `Worker` (one protocol).

The reader (reader.py), the reclaimer (reclaim.py), the backlog replay (backlog.py) and the
middleware hooks (middleware.py) reach the worker through it and nothing else: its client and
settings, the shard's queue keys, how much room the in-flight window has, whether an entry is
already held, admitting deliveries (launching picked ones, or handing over entries taken from
dead workers), waiting for room or for one entry, and dead-lettering.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import redis.asyncio as aredis

from prefixq.core.settings import Settings
from prefixq.worker.deliveries import Delivery, Ref
from prefixq.worker.solo import SoloGate

if TYPE_CHECKING:
    from prefixq.worker.lanes import Picked


class WorkerView(Protocol):
    """What `Worker` offers its helpers and middleware."""

    @property
    def r(self) -> aredis.Redis:
        """The worker's own asyncio client."""
        ...

    @property
    def settings(self) -> Settings: ...

    @property
    def stopping(self) -> bool:
        """No more work is to be admitted (SIGTERM, or the engine died)."""
        ...

    @property
    def gate(self) -> SoloGate:
        """The engine's gate: entries on their last allowed delivery run alone."""
        ...

    def room(self) -> int:
        """Requests the in-flight window can take now (finished-but-unwritten ones count)."""
        ...

    def busy(self) -> bool:
        """A request is inside the engine."""
        ...

    def holds(self, ref: Ref) -> bool:
        """The entry is read and waiting, in flight, or its result is being written by this
        worker."""
        ...

    def queue_keys(self) -> list[str]:
        """The streams of the shard: its intakes, then the lanes this worker knows."""
        ...

    async def admit(self, deliveries: list[Delivery]) -> None:
        """Decode the entries and hand each to the engine; bad ones are dead-lettered."""
        ...

    async def launch(self, items: list[Picked], t_read: float) -> None:
        """Hand picked entries (a read round's admissions) to the engine."""
        ...

    async def take_over(self, deliveries: list[Delivery]) -> None:
        """Decode entries claimed from a dead worker; they are admitted before anything else."""
        ...

    async def wait_room(self) -> None:
        """Until room frees up (a request finished, results were written), or stopping."""
        ...

    async def wait_done(self, ref: Ref) -> None:
        """Until the request of entry ``ref`` has left the engine, or stopping."""
        ...

    async def dead_letter(self, delivery: Delivery, reason: str) -> None:
        """Move the entry to the dead-letter stream; its request gets a failed result."""
        ...
