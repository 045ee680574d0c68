"""The fault suite's ledger: faults injected, requests lost or duplicated, summed over the session.

Every fault test counts a fault (`Ledger.fault`) only after it has checked that the fault landed
where it claims (a process killed with work in flight, Redis gone mid-burst, a hostile entry
handled); refused input is not a fault. It measures each burst it ran (`account`); conftest.py
prints one line from the ledger at the end of the session:
``faults injected: N, requests lost: L, duplicated: D``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import redis

from prefixq.core import wire
from prefixq.core.keys import Keys
from prefixq.core.records import Result
from prefixq.core.settings import Settings


@dataclass
class Ledger:
    """Faults injected and requests lost or duplicated, summed over the module's tests."""

    faults: int = 0
    lost: int = 0
    duplicated: int = 0
    requests: int = 0

    def fault(self, what: str, n: int = 1) -> None:
        self.faults += n
        print(f"  fault injected: {what}")


LEDGER = Ledger()


@dataclass
class Outcome:
    """What a burst ended with, measured in Redis."""

    total: int
    results: dict[int, Result]
    done: int
    failed: int
    lost: int
    duplicated: int


def account(
    r: redis.Redis, s: Settings, burst: str, total: int, *, taken_back: int = 0, what: str = ""
) -> Outcome:
    """Measure a burst's results and add its lost and duplicated requests to the ledger.

    ``taken_back``: failed results that `prefixq dead --requeue` took back (each leaves one
    extra event for its index, which is not a duplicate)."""
    keys = Keys(s.namespace)
    res = {
        int(k): Result.from_wire(wire.decode(v)) for k, v in r.hgetall(keys.results(burst)).items()
    }
    events = Counter(int(f[b"i"]) for _, f in r.xrange(keys.events(burst)))
    meta = r.hgetall(keys.burst(burst))
    done, failed = int(meta.get(b"done", 0)), int(meta.get(b"failed", 0))
    for i, x in res.items():
        assert x.index == i, f"result under index {i} says index {x.index}"
    lost = sum(1 for i in range(total) if i not in res)
    extra_events = sum(n - 1 for n in events.values()) - taken_back
    duplicated = max(0, extra_events, done + failed - len(res))
    LEDGER.lost += lost
    LEDGER.duplicated += duplicated
    LEDGER.requests += total
    print(
        f"  {what or 'burst'} {burst}: {total} requests -> {len(res)} results "
        f"({done} ok, {failed} failed); lost {lost}, duplicated {duplicated}"
    )
    return Outcome(total, res, done, failed, lost, duplicated)
