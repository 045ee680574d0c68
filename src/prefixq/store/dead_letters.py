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

import msgpack

from prefixq.core import wire
from prefixq.core.entries import VERSION, Entry
from prefixq.core.errors import LimitExceeded, PrefixqError, WireError
from prefixq.core.keys import CARRIED, FIELD
from prefixq.core.records import Result

__all__ = [
    "DeadLetter",
    "carried",
    "dead_letter_record",
    "dead_lettered_result",
    "envelope",
    "identify",
]

#: dead letters a shard keeps (the stream is capped, oldest first)
DEAD_MAXLEN = 100_000
#: msgpack bytes of an entry over a limit read to identify it (`envelope`): its leading fields
#: take a few hundred (an id is at most 512 characters)
ENVELOPE_BYTES = 4096


def carried(fields: dict[bytes, bytes] | None) -> int:
    """Deliveries an entry had before `prefixq reclaim` moved it (0 for an entry never moved)."""
    raw = (fields or {}).get(CARRIED)
    try:
        return max(0, int(raw)) if raw is not None else 0
    except ValueError:
        return 0


def identify(data: bytes | None, limits: wire.Limits) -> Entry | None:
    """The request an entry's payload belongs to, as far as it can be told: the full `Entry`, or
    one with only burst, index, id (and enqueue time) when the rest is malformed, or when the
    entry is over a decoding limit and those fields are read from its first bytes (`envelope`);
    so that its request still gets a failed result and its burst can finish. None when not even
    they decode (a corrupt payload is never read in part)."""
    if data is None:
        return None
    try:
        obj = wire.decode(data, limits)
    except LimitExceeded:  # well-formed but too large, too long or too deep: its start tells
        obj = envelope(data)
    except PrefixqError:
        return None
    else:
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
    e = obj.get("e")  # the burst's incarnation (record_result.lua); 0: not checked
    if not (isinstance(e, int | float) and not isinstance(e, bool)):
        e = 0.0
    ok = math.isfinite(e) and e >= 0
    return Entry(
        burst=burst,
        index=index,
        id=rid,
        own={},
        prefix=None,
        prefix_ref=None,
        sampling={},
        enqueued=float(e) if ok else 0.0,
        shard=0,
        work=0,
        predicted_cached=0,
    )


def envelope(data: bytes) -> dict[str, Any]:
    """The leading pairs of an entry's map read from its first `ENVELOPE_BYTES` of msgpack alone
    (entries.to_wire puts version, burst, index, id and enqueue time first), up to the first
    value that does not fit there; empty if those bytes do not start a map."""
    try:
        head = wire.decompress_head(data, ENVELOPE_BYTES)
    except WireError:
        return {}
    u = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=ENVELOPE_BYTES)
    u.feed(head)
    out: dict[str, Any] = {}
    try:
        for _ in range(u.read_map_header()):
            key = u.unpack()
            if not isinstance(key, str):
                break
            out[key] = u.unpack()
    except (msgpack.UnpackException, ValueError, TypeError):
        pass  # the rest is the part over the limit (or garbage): what came before stands
    return out


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
