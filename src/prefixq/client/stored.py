"""What Redis keeps of a burst, decoded (no I/O): its record as a `BurstStatus`, and its recorded
results (`read_stored`; `decoded` for a range of them, `unreadable` for those that did not decode).
prefixq.client.results reads them from Redis and re-exports `BurstStatus` and `read_stored`.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixq.core import wire
from prefixq.core.errors import BurstNotFound, BurstRecordLost, WireError
from prefixq.core.records import Result
from prefixq.core.settings import Settings


def read_stored(raw: bytes, index: int, rid: str, limits: wire.Limits) -> Result:
    """A recorded result; one that does not decode (a value written over in Redis) becomes a
    failed result that says so, with code ``internal_error``: one unreadable value costs its own
    line, never the burst's other results."""
    try:
        return Result.from_wire(wire.decode(raw, limits))
    except (WireError, KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        return Result(
            id=rid,
            index=index,
            error=f"its recorded result does not decode: {e}",
            error_code="internal_error",
        )


@dataclass(slots=True)
class BurstStatus:
    """A burst's record and progress."""

    burst: str
    total: int
    done: int
    failed: int
    status: str
    created: float
    finished_at: float
    meta: dict[str, str]

    @property
    def finished(self) -> bool:
        return self.total > 0 and self.done + self.failed >= self.total

    @classmethod
    def from_hash(cls, burst: str, h: dict[bytes, bytes]) -> BurstStatus:
        """The status in a burst record; BurstRecordLost if the record has no valid ``total``
        (a partial record: what is left of one that expired or was evicted)."""
        m = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in h.items()}
        try:
            total = int(m["total"])
            if total <= 0:
                raise ValueError(total)
            return cls(
                burst=burst,
                total=total,
                done=int(m.get("done", 0)),
                failed=int(m.get("failed", 0)),
                status=m.get("status", "?"),
                created=float(m.get("created", 0)),
                finished_at=float(m.get("finished_at", 0)),
                meta=m,
            )
        except (KeyError, ValueError):
            raise BurstRecordLost(
                f"burst {burst!r}: its record is incomplete (fields: {', '.join(sorted(m))}): it "
                "expired or was evicted, and was partly written again; its results cannot be "
                "read as complete or finished. Submit the burst again"
            ) from None


def status_of(burst: str, settings: Settings, h: dict[bytes, bytes]) -> BurstStatus:
    """The status in the burst record ``h`` as read (HGETALL); BurstNotFound if there is none."""
    if not h:
        raise BurstNotFound(
            f"no burst {burst!r} in namespace {settings.namespace!r}: it was never "
            "submitted, or its record expired (result_ttl_s) or was evicted"
        )
    return BurstStatus.from_hash(burst, h)


def decoded(indexes: range, raw: list[bytes | None], limits: wire.Limits) -> list[Result | None]:
    """The results at ``indexes`` as read (HMGET): None for each not recorded yet."""
    return [
        None if v is None else read_stored(v, i, "", limits)
        for i, v in zip(indexes, raw, strict=True)
    ]


def unreadable(results: list[Result | None]) -> list[Result]:
    """Results stored unreadably (read as internal_error without their request id)."""
    return [r for r in results if r is not None and r.error_code == "internal_error" and not r.id]
