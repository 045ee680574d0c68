"""`SoloGate`: an entry on its last allowed delivery runs with nothing else in the engine.

When a request kills the engine, every request in flight dies with it and is charged a delivery;
run together again, an engine-killing ("poison") entry would take its neighbours past
``max_attempts`` into the dead-letter stream. So an entry whose delivery is its last allowed one
(``max_attempts`` >= 2) runs alone: it waits until no engine call is in progress, and no other
call starts until it is done; if it kills the engine, only it is charged again. The backlog
replay and the reclaimer keep their side of this (deliveries charged one by one, last-chance
entries one per round). docs/delivery.md, "Stuck work" ("Poison entries do not take their
neighbours with them"), has the argument.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class SoloGate:
    """Counts engine calls; `call(solo=True)` gets the engine to itself. Ordinary calls pay one
    comparison while no solo entry waits or runs."""

    def __init__(self) -> None:
        #: engine calls in progress
        self.calls = 0
        #: solo calls waiting for the engine to empty
        self.waiting = 0
        #: a solo call is in progress
        self.solo = False
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def call(self, solo: bool = False) -> AsyncIterator[None]:
        """Hold the engine for one call (alone, if ``solo``)."""
        if solo or self.solo or self.waiting:
            async with self._changed:
                if solo:
                    self.waiting += 1
                    try:
                        await self._changed.wait_for(lambda: self.calls == 0 and not self.solo)
                    finally:
                        self.waiting -= 1
                        self._changed.notify_all()
                    self.solo = True
                else:
                    await self._changed.wait_for(lambda: not self.solo and not self.waiting)
                self.calls += 1
        else:
            self.calls += 1
        try:
            yield
        finally:
            self.calls -= 1
            if solo:
                self.solo = False
            if solo or self.waiting:
                async with self._changed:
                    self._changed.notify_all()
