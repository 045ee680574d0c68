"""What vLLM's scheduler runs now, read from its own per-step statistics.

vLLM's engine core sends `SchedulerStats` with every step's outputs (with ``log_stats`` on, as
prefixq starts it); ``num_running_reqs`` is how many requests that step scheduled, the rest of
those handed in wait. `AsyncLLM.from_engine_args(stat_loggers=[...])` takes extra loggers, a
public hook since vLLM's V1 engine (its own ``StatLoggerBase``: "API users may define custom
loggers"). `running_logger` makes one that keeps the last count in a `Running`; the worker's
fair shares start a newly arriving burst behind what runs and ahead of what waits
(worker/engine_order.py). The statistics classes are not a stable interface across releases:
anything unexpected leaves the count unknown (None), never fails the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Running", "running_logger"]


@dataclass(slots=True)
class Running:
    """The requests vLLM's latest step scheduled (``count``; None until a step reported)."""

    count: int | None = None

    def record(self, stats: Any) -> None:
        n = getattr(stats, "num_running_reqs", None)
        if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
            self.count = n


def running_logger(sink: Running) -> Any:
    """A vLLM stat-logger factory (a ``StatLoggerBase`` subclass, called with the config and
    the engine's index) that records each step's running count into ``sink``; None when this
    vLLM has no such base class."""
    try:
        from vllm.v1.metrics.loggers import StatLoggerBase
    except ImportError:
        return None

    class RunningLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        # the signature grew across releases (mm_cache_stats, engine_idx): take any of them
        def record(self, scheduler_stats: Any, iteration_stats: Any, *_: Any, **__: Any) -> None:
            if scheduler_stats is not None:
                sink.record(scheduler_stats)

        def log_engine_initialized(self) -> None:
            pass

    return RunningLogger
