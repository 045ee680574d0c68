"""Recording a result: the one way to call lua/record_result.lua (`record_call`: the writer's,
`prefixq reclaim`'s and the tests'), and what its replies mean.

Each worker's share of a burst (the record's ``w:<worker>`` counters: `inspect --burst`, the
dashboard, the fleet's figures) is counted once per burst and written group, not per result:
`group_tallies` makes the last call of each burst in a group count the results of the calls
before it (one HINCRBY instead of one per result, ~0.6 us of Redis per request), atomically with
its own record, so the shares are whole when the burst's last result is; `tally_corrections`
names what to correct when some of them were not recorded after all (lua/count_results.lua,
which never creates a record)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from prefixq.core import wire
from prefixq.core.keys import Keys
from prefixq.core.records import Result
from prefixq.core.settings import Settings

__all__ = [
    "BURST_DONE",
    "DUPLICATE",
    "FINISHED_DUPLICATE",
    "OUT_OF_RANGE",
    "RECORDED",
    "RECORD_LOST",
    "group_tallies",
    "record_call",
    "tally_corrections",
]

# replies of lua/record_result.lua
#: recorded
RECORDED = 1
#: recorded, and it was the burst's last outstanding request
BURST_DONE = 2
#: a result for this index existed already (a redelivery): only acknowledge
DUPLICATE = 0
#: a result existed already and the burst has finished (completion hooks may run again: they are
#: idempotent, and a reply lost to a dropped connection must not lose the burst's completion)
FINISHED_DUPLICATE = 3
#: the index is outside the burst (a forged or corrupt entry): nothing written
OUT_OF_RANGE = -1
#: the burst's record does not exist (expired, evicted or never created), or is another burst's
#: of the same id (submitted again after the entry's burst expired): nothing written
RECORD_LOST = -2


def record_call(
    keys: Keys,
    burst: str,
    result: Result,
    settings: Settings,
    now: str,
    enqueued: float = 0.0,
    *,
    others: int | None = 0,
) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of lua/record_result.lua for ``result`` of ``burst`` (the one way to record:
    the writer's, `prefixq reclaim`'s and the tests'). ``enqueued``: the entry's enqueue time,
    which is its burst record's ``created`` (0: unknown, not checked). ``others``: how many
    results of the same burst the calls before this one in the pipeline record, which this call
    counts under ``result.worker`` with its own (`group_tallies`); None: this call counts nothing
    (a later call of its group counts it)."""
    return (
        [keys.results(burst), keys.burst(burst), keys.events(burst), keys.ids(burst)],
        [
            result.index,
            wire.encode_compact(result.to_wire(), settings.codec),
            "" if result.error is None else (result.error_code or "internal_error"),
            settings.result_ttl_s,
            now,
            result.prompt_tokens,
            result.cached_tokens,
            result.predicted_cached_tokens,
            repr(enqueued),
            "" if others is None else result.worker,
            others or 0,
        ],
    )


def group_tallies(bursts: Sequence[str]) -> list[int | None]:
    """For the results of one written group, in order (``bursts``: each one's burst), the
    ``others`` of its `record_call`: the last result of each burst counts the ones before it,
    the others count nothing."""
    n = len(bursts)
    out: list[int | None] = [None] * n
    if n and bursts.count(bursts[0]) == n:  # the usual group: one burst
        out[-1] = n - 1
        return out
    counts = Counter(bursts)
    for i in range(len(bursts) - 1, -1, -1):
        b = bursts[i]
        if counts[b]:
            out[i], counts[b] = counts[b] - 1, 0
    return out


def tally_corrections(
    bursts: Sequence[str], tallies: Sequence[int | None], replies: Sequence[Any]
) -> dict[int, int]:
    """Position of a group's counting call -> by how much its count was off, for the groups whose
    count was wrong: a call before it was not recorded (a duplicate, refused, out of range), or
    the counting call itself did not count (refused, or the record lost)."""
    got = list(replies)
    if got.count(RECORDED) + got.count(BURST_DONE) == len(got):
        return {}  # the usual group: every result recorded, every count right
    recorded: dict[str, int] = {}
    for b, t, reply in zip(bursts, tallies, replies, strict=True):
        if t is None and reply in (RECORDED, BURST_DONE):
            recorded[b] = recorded.get(b, 0) + 1
    out: dict[int, int] = {}
    for i, (b, t, reply) in enumerate(zip(bursts, tallies, replies, strict=True)):
        if t is None:
            continue
        counted = t if isinstance(reply, int) and reply != RECORD_LOST else 0
        if recorded.get(b, 0) != counted:
            out[i] = recorded.get(b, 0) - counted
    return out
