"""Dead letters as records: what one holds, which request it belongs to, and the failed result.

A dead letter is an entry of the shard's dead-letter stream (`Keys.dead`): the original entry's
payload (``d``) plus ``entry`` (its stream id), ``shard``, ``reason``, ``delivered``, ``at``,
``worker`` and, when the payload identifies its request, ``burst`` and ``index``. Workers write
them through `ShardStream.dead_letter` (worker/shard.py) and so does `prefixq reclaim`
(ops/recovery.py); both build them with `dead_letter_record`. Nothing here does I/O.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from prefixq.core import wire
from prefixq.core.entries import VERSION, Entry
from prefixq.core.errors import PrefixqError, WireError
from prefixq.core.keys import CARRIED, FIELD
from prefixq.core.records import Result

__all__ = ["DeadLetter", "carried", "dead_letter_record", "dead_lettered_result", "identify"]

#: dead letters a shard keeps (the stream is capped, oldest first)
DEAD_MAXLEN = 100_000


def carried(fields: dict[bytes, bytes] | None) -> int:
    """Deliveries an entry had before `prefixq reclaim` moved it (0 for an entry never moved)."""
    raw = (fields or {}).get(CARRIED)
    try:
        return max(0, int(raw)) if raw is not None else 0
    except ValueError:
        return 0


def identify(data: bytes | None, limits: wire.Limits) -> Entry | None:
    """The request an entry's payload belongs to, as far as it can be told: the full `Entry`, or
    one with only burst, index and id when the rest is malformed (so that its request still gets
    a failed result and its burst can finish); None when not even that decodes."""
    if data is None:
        return None
    try:
        obj = wire.decode(data, limits)
    except PrefixqError:
        return None
    try:
        return Entry.from_wire(obj)
    except WireError:
        pass
    if not isinstance(obj, dict) or obj.get("v") != VERSION:  # another version: not ours to fail
        return None
    burst, index, rid = obj.get("b"), obj.get("i"), obj.get("id")
    if not (
        isinstance(burst, str)
        and isinstance(rid, str)
        and isinstance(index, int)
        and not isinstance(index, bool)
        and 0 <= index < 1 << 40
    ):
        return None
    return Entry(
        burst=burst,
        index=index,
        id=rid,
        own={},
        prefix=None,
        prefix_ref=None,
        sampling={},
        enqueued=0.0,
        shard=0,
        work=0,
        predicted_cached=0,
    )


def dead_letter_record(
    entry_id: bytes,
    shard: int,
    fields: dict[bytes, bytes],
    reason: str,
    delivered: int,
    worker: str,
    limits: wire.Limits,
) -> tuple[dict[Any, Any], Entry | None]:
    """The fields of one dead letter, and the request it belongs to (None if unidentifiable)."""
    record: dict[Any, Any] = {
        "entry": entry_id,
        "shard": shard,
        "reason": reason[:2000],
        "delivered": delivered,
        "at": time.time(),
        "worker": worker,
    }
    data = fields.get(FIELD)
    if data is not None:
        record[FIELD] = data
    entry = identify(data, limits)
    if entry is not None:
        record["burst"], record["index"] = entry.burst, entry.index
    return record, entry


def dead_lettered_result(entry: Entry, shard: int, worker: str, reason: str) -> Result:
    """The failed result a dead-lettered request gets (`Entry.failed`)."""
    return entry.failed(shard, worker, "dead_lettered", f"dead-lettered: {reason}", time.time())


@dataclass(slots=True)
class DeadLetter:
    """One dead letter, as `prefixq dead` lists it."""

    id: str
    shard: int
    entry: str
    reason: str
    delivered: int
    burst: str | None
    index: int | None
    at: float
    worker: str
    has_payload: bool

    @classmethod
    def from_fields(cls, shard: int, dead_id: bytes, f: dict[bytes, bytes]) -> DeadLetter:
        def text(key: bytes) -> str:
            return f.get(key, b"").decode(errors="replace")

        def number(key: bytes, kind: type[int] | type[float]) -> Any:
            try:  # anything with write access may have written the stream: never fail a listing
                value = kind(text(key) or 0)
            except ValueError:
                return kind(0)
            return value if math.isfinite(value) else kind(0)

        index = text(b"index")
        return cls(
            id=dead_id.decode(),
            shard=shard,
            entry=text(b"entry"),
            reason=text(b"reason"),
            delivered=number(b"delivered", int),
            burst=text(b"burst") or None,
            index=int(index) if index.isascii() and index.lstrip("-").isdigit() else None,
            at=number(b"at", float),
            worker=text(b"worker"),
            has_payload=FIELD in f,
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
