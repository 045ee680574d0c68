"""The narrow interface the worker's helpers admit work through (`Admission`).

The reclaimer (reclaim.py) and the backlog replay (backlog.py) hand entries to the worker's
engine through this protocol and nothing else of the `Worker`: how much room the in-flight window
has, whether an entry is already held, admitting deliveries, waiting for room or for one entry,
and dead-lettering.
"""

from __future__ import annotations

from typing import Protocol

from prefixq.consumers.shard import Delivery
from prefixq.consumers.solo import SoloGate


class Admission(Protocol):
    """What `Worker` offers its helpers."""

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

    def holds(self, entry_id: bytes) -> bool:
        """The entry is in flight or its result is being written by this worker."""
        ...

    async def admit(self, deliveries: list[Delivery]) -> None:
        """Decode the entries and hand each to the engine; bad ones are dead-lettered."""
        ...

    async def wait_room(self) -> None:
        """Until room frees up (a request finished, results were written), or stopping."""
        ...

    async def wait_done(self, entry_id: bytes) -> None:
        """Until the request of ``entry_id`` has left the engine, or stopping."""
        ...

    async def dead_letter(self, delivery: Delivery, reason: str) -> None:
        """Move the entry to the dead-letter stream; its request gets a failed result."""
        ...
