"""What a worker measures about itself, and the control commands that act on it: GC pauses and
the GC policy (gcwatch.py, gc_policy.py), event-loop lag and read-to-engine time (loopwatch.py).
`prefixq bench` reads them through the control stream (``stats``, ``reset_stats``, ``gc_freeze``,
``gc_unfreeze``: worker/control.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from prefixq.worker.gc_policy import GcPolicy
from prefixq.worker.gcwatch import GcWatch
from prefixq.worker.loopwatch import Latency, LoopWatch

if TYPE_CHECKING:
    from prefixq.worker.kv_budget import KvBudget


class Probes:
    """One worker's measurements."""

    def __init__(self, *, gc_freeze: bool) -> None:
        self.gc = GcWatch()
        #: the GC policy (gc_policy.py); the control stream turns freezing off and on
        self.gc_policy = GcPolicy(self.gc, enabled=gc_freeze)
        self.loop = LoopWatch()
        #: from a stream read returning to a request being handed to the engine
        self.read_to_engine = Latency()
        #: the KV budget of the requests in the engine (kv_budget.py; admission.py sets it)
        self.budget: KvBudget | None = None

    def stats(self) -> dict[str, Any]:
        """The control stream's ``stats`` answer (milliseconds)."""
        return {
            **self.gc.stats(),
            **self.gc_policy.stats(),
            **self.loop.stats(),
            **self.read_to_engine.stats("read_to_engine"),
            **(self.budget.stats() if self.budget is not None else {}),
            # the engine's KV cache (vLLM sizes it): `prefixq bench --standalone none` sizes its
            # workloads from it
            "kv_tokens": self.budget.kv_tokens if self.budget is not None else 0,
        }

    def commands(self) -> dict[str, Callable[[], Awaitable[None]]]:
        """Control commands on these measurements."""

        async def reset_stats() -> None:
            self.gc.reset()
            self.loop.lag.reset()
            self.read_to_engine.reset()
            if self.budget is not None:
                self.budget.reset()

        async def gc_freeze() -> None:
            self.gc_policy.freeze()

        async def gc_unfreeze() -> None:
            self.gc_policy.unfreeze()

        return {"gc_freeze": gc_freeze, "gc_unfreeze": gc_unfreeze, "reset_stats": reset_stats}
