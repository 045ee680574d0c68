"""Deliveries and the names of entries: what `ShardStream` (worker/shard.py) hands out.

An entry is named by its stream's key and its id together (`Ref`): a shard's requests wait in
several streams (intakes and lanes), and two streams may hand out the same id.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from redis.exceptions import ResponseError

from prefixq.core.entries import Entry
from prefixq.core.records import Result

__all__ = [
    "WAIT_INTAKE",
    "WAIT_LANE",
    "Delivery",
    "GroupLost",
    "Pending",
    "Ref",
    "Written",
    "by_key",
    "group_lost",
    "last_allowed",
]

#: an entry: its stream's key and its id
Ref = tuple[str, bytes]
#: `Delivery.wait`: for the lane entries sent before it, or for the intake entries
WAIT_LANE, WAIT_INTAKE = 1, 2

_NO_SUCH_KEY = re.compile(r"No such key '(.*?)' or consumer group")


def last_allowed(deliveries: int, max_attempts: int) -> bool:
    """Whether delivery number ``deliveries`` is an entry's last allowed one (worker/solo.py)."""
    return 1 < max_attempts <= deliveries


def group_lost(err: BaseException) -> bool:
    """A reply saying the consumer group or the stream is gone (Redis restarted empty, the group
    was destroyed, the key deleted or flushed while a read blocked on it)."""
    text = str(err)
    return isinstance(err, ResponseError) and (
        "NOGROUP" in text or "no longer exists" in text or "UNBLOCKED" in text
    )


class GroupLost(Exception):
    """A read found a stream or its group gone: ``key`` names it when Redis said which."""

    def __init__(self, err: ResponseError) -> None:
        super().__init__(str(err))
        m = _NO_SUCH_KEY.search(str(err))
        self.key = m.group(1) if m else None
        #: what the round's other reads delivered (still this consumer's to serve)
        self.got: dict[str, list[Delivery]] = {}


@dataclass(slots=True)
class Delivery:
    """One delivery of an entry (of stream ``key``) to this consumer."""

    key: str
    entry_id: bytes
    #: the entry's fields; empty when the entry was deleted (its result is recorded: only ack)
    fields: dict[bytes, bytes]
    #: which delivery this is, counting deliveries carried over a `prefixq reclaim` move
    deliveries: int = 1
    #: its place in its burst's enqueue order on the shard (`POS`: L + I; -1: not given)
    rank: int = -1
    #: what it waits for before it is admitted (worker/gates.py, `gated`): `WAIT_LANE` (an
    #: intake entry: the first ``before`` entries of its lane read) or `WAIT_INTAKE` (a lane entry:
    #: the first ``before`` intake entries of its burst read, or a read of the intake that came
    #: back short since round ``mark``); 0: nothing
    wait: int = 0
    before: int = 0
    mark: int = 0
    #: when it was read (time.time()), for `WAIT_INTAKE`: that gate holds `GATE_S` at most
    read_at: float = 0.0
    #: (key, entry_id), made once: every held entry is looked up by it several times
    ref: Ref = field(init=False)

    def __post_init__(self) -> None:
        self.ref = (self.key, self.entry_id)


@dataclass(slots=True)
class Pending:
    """One row of a pending entries list."""

    key: str
    entry_id: bytes
    consumer: bytes
    #: deliveries so far (the stream's count plus any carried over a move)
    deliveries: int
    fields: dict[bytes, bytes] = field(default_factory=dict)
    #: ms since it was last delivered or its lease renewed, when it was listed
    idle_ms: int = 0

    @property
    def ref(self) -> Ref:
        return (self.key, self.entry_id)


@dataclass(slots=True)
class Written:
    """A finished request on its way to Redis: its entry, the decoded entry and its result."""

    key: str
    entry_id: bytes
    entry: Entry
    result: Result


def by_key(refs: Iterable[Ref]) -> dict[str, list[bytes]]:
    """Entry ids grouped by their stream."""
    out: dict[str, list[bytes]] = defaultdict(list)
    for key, entry_id in refs:
        out[key].append(entry_id)
    return out
