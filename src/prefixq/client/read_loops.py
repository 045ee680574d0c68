"""What each read loop of prefixq.client.results decides, written once for a blocking function
and its event-loop twin (no I/O): the deadline a ``timeout`` gives and how long each blocking read
may wait (`Waits`), the results ready in input order (`leading`), and the indexes one read of
results asks for (`chunk`, `chunks`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

from prefixq.client.stored import BurstStatus
from prefixq.core.errors import BurstTimeout, ValidationError
from prefixq.core.records import Result

#: results one read (HMGET) asks for
FETCH = 512
#: seconds between two reads of the record by a read in input order that waits
RECHECK_S = 1.0


def deadline_of(timeout: float | None) -> float | None:
    """The monotonic time ``timeout`` s from now; None (no limit) for None or infinity."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or math.isnan(timeout):
        raise ValidationError(f"timeout must be a number of seconds or None, not {timeout!r}")
    if timeout == math.inf:
        return None
    return time.monotonic() + timeout


def wait_ms(deadline: float | None) -> int:
    """How long one blocking read may wait: a second, or what is left before ``deadline``
    (monotonic, None: no limit); 0 once it has passed."""
    if deadline is None:
        return 1000
    left = deadline - time.monotonic()
    return 0 if left <= 0 else max(1, min(1000, int(left * 1000)))


class Waits:
    """The waits of one read (`wait`, `iterate` and their twins): the deadline ``timeout`` gives,
    the last entry of the burst's events stream seen, and how long the next blocking read may
    wait (BurstTimeout once the deadline passed, saying how far the read got)."""

    def __init__(self, burst: str, timeout: float | None) -> None:
        self.burst, self.timeout = burst, timeout
        self.deadline = deadline_of(timeout)
        #: the events stream's entry the next blocking read waits after
        self.last = "0-0"
        #: when the record was last read (`check_due`)
        self.checked = time.monotonic()

    def until_finished(
        self, st: BurstStatus, progress: Callable[[BurstStatus], None] | None
    ) -> int | None:
        """After a status read (shown to ``progress``): None once the burst is finished, else how
        long to block for its next result."""
        if progress:
            progress(st)
        if st.finished:
            return None
        ms = wait_ms(self.deadline)
        if not ms:
            raise BurstTimeout(
                f"burst {self.burst}: {st.done + st.failed}/{st.total} results after "
                f"{self.timeout:.0f}s"
            )
        return ms

    def check_due(self) -> bool:
        """Whether a read in input order should read the burst's record again (at most once a
        second while it waits): a record Redis lost (restarted empty, evicted) is BurstNotFound
        then, not a wait for results that will never come."""
        now = time.monotonic()
        if now - self.checked < RECHECK_S:
            return False
        self.checked = now
        return True

    def until_next(self, nxt: int, total: int) -> int:
        """How long to block for result ``nxt`` in input order (of ``total``)."""
        ms = wait_ms(self.deadline)
        if not ms:
            raise BurstTimeout(
                f"burst {self.burst}: {nxt}/{total} results in order after {self.timeout}s"
            )
        return ms


def leading(got: list[Result | None]) -> list[Result]:
    """The results of ``got`` before the first one not recorded yet."""
    ready: list[Result] = []
    for res in got:
        if res is None:
            break
        ready.append(res)
    return ready


def chunk(start: int, total: int) -> range:
    """The indexes one read of results (HMGET) asks for: up to `FETCH` from ``start``, none
    past ``total``."""
    return range(start, min(total, start + FETCH))


def chunks(total: int) -> Iterator[range]:
    """All ``total`` indexes, a `chunk` at a time."""
    for start in range(0, total, FETCH):
        yield chunk(start, total)
