"""The running soak as its faults see it: `SoakRun`, what a fault may use of it (scripts/soak.py's
`Soak` is the one), and `Landed`, what a fault reports back. Faults import this, never soak.py:
the soak's library stays below its command.
"""

from __future__ import annotations

import random
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import redis

from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from soaklib.deployment import Redis, Workers
from soaklib.workload import Planned


@dataclass
class Landed:
    """A fault that landed, and how that was seen."""

    kind: str
    how: str


class SoakRun(Protocol):
    """One run, as a fault uses it: the deployment, the fault schedule's random numbers, and
    the run's own steps (submits, ``prefixq`` commands, problems, observations for later)."""

    rng: random.Random
    settings: Settings
    keys: Keys
    #: a client of the deployment's Redis
    r: redis.Redis
    redis: Redis
    workers: Workers

    def problem(self, what: str) -> None:
        """Note a problem of the run (it fails the soak)."""
        ...

    def later(self, look: Callable[[], Landed | None], what: str) -> None:
        """Observe a fault's landing once the run has drained (``look`` returns it, or None)."""
        ...

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``prefixq ARGS`` against the soak's namespace."""
        ...

    def created_bursts(self) -> list[str]:
        """The bursts whose submit was started so far."""
        ...

    def extra_burst(self, size: int) -> Planned:
        """A burst outside the plan (a submit to kill)."""
        ...

    def launch(self, b: Planned) -> subprocess.Popen[bytes]:
        """Start ``b``'s submit process."""
        ...

    def settle_submit(self, b: Planned, proc: subprocess.Popen[bytes]) -> Planned | None:
        """Note how ``b``'s submit ended (after a failure: the resubmission to launch)."""
        ...
