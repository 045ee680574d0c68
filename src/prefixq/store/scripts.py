"""Recording results: the one way to call lua/record_result.lua (`record_call`: the writer's,
`prefixq reclaim`'s and the tests'), and what its replies mean.

One call records a written group's results of one burst: the burst's counters (done, failed,
tokens, and each worker's share of the burst, the record's ``w:<worker>``: `inspect --burst`,
the dashboard, the fleet's figures) move once per call, by what it recorded, not once per
result, atomically with the results themselves."""

from __future__ import annotations

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
    "record_call",
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
    results: Sequence[tuple[Result, float]],
    settings: Settings,
    now: str,
    worker: str = "",
) -> tuple[list[str], list[Any]]:
    """KEYS and ARGV of lua/record_result.lua for ``results`` of ``burst``, each with its entry's
    enqueue time, which is its burst record's ``created`` (0: unknown, not checked): the one way
    to record (the writer's, `prefixq reclaim`'s and the tests'). The script replies one code per
    result, in order; ``worker``: whose share the recorded ones count in (``""``: nobody's)."""
    args: list[Any] = [settings.result_ttl_s, now, worker]
    for result, enqueued in results:
        args += [
            result.index,
            wire.encode_compact(result.to_wire(), settings.codec),
            "" if result.error is None else (result.error_code or "internal_error"),
            result.prompt_tokens,
            result.cached_tokens,
            result.predicted_cached_tokens,
            repr(enqueued),
        ]
    return [keys.results(burst), keys.burst(burst), keys.events(burst), keys.ids(burst)], args
