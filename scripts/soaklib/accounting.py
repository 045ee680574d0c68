"""Lost, duplicated and phantom results, measured through the public API.

Each burst's results are read back through the handle a submit returns (`prefixq.Burst`: its
``status`` and ``collect``, what an upstream job calls) and compared with what the soak
submitted: the request id of each input index and the word its answer must start with
(workload.py). Cancelled, expired and failed
results are results. Per burst:

- **lost**: an input index without a result;
- **duplicated**: an input index with two results, an id on more results than it was submitted
  for, or a record that counts more results (``done + failed``) than there are;
- **phantom**: a result whose id was never submitted in the burst (an id made up, or another
  burst's), or whose id is another index's (a result given to another request);
- **misanswered**: a successful result whose text is not its own request's answer.

`damage` (``--self-check``) breaks a few results in Redis before the accounting, one of each
kind, so that a run proves the accounting can fail.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import redis

from prefixq import Burst
from prefixq.core import wire
from prefixq.core.errors import BurstNotFound
from prefixq.core.keys import Keys
from prefixq.core.records import Result
from prefixq.core.settings import Settings

KINDS = ("lost", "duplicated", "phantom", "misanswered")


@dataclass
class Tally:
    """The accounting of every burst of a run."""

    bursts: int = 0
    requests: int = 0
    results: int = 0
    defects: Counter[str] = field(default_factory=Counter)
    codes: Counter[str] = field(default_factory=Counter)
    #: a few examples of each defect: (burst, index, what)
    examples: list[tuple[str, int, str]] = field(default_factory=list)

    def defect(self, kind: str, burst: str, index: int, what: str, n: int = 1) -> None:
        self.defects[kind] += n
        if len(self.examples) < 40:
            self.examples.append((burst, index, f"{kind}: {what}"))

    @property
    def clean(self) -> bool:
        return not any(self.defects[k] for k in KINDS)


def account(
    tally: Tally,
    settings: Settings,
    burst: str,
    ids: list[str],
    markers: list[str],
    *,
    created: bool,
) -> None:
    """Add burst ``burst`` (``ids`` and answer ``markers`` by input index) to ``tally``.
    ``created``: whether its record must exist (its submit got that far)."""
    with Burst(burst, settings) as handle:
        _account(tally, handle, ids, markers, created=created)


def _account(
    tally: Tally, handle: Burst, ids: list[str], markers: list[str], *, created: bool
) -> None:
    burst = handle.id
    try:
        st = handle.status()
    except BurstNotFound:
        if created:
            tally.bursts += 1
            tally.requests += len(ids)
            tally.defect("lost", burst, -1, "the record of a created burst is gone", len(ids))
        return
    tally.bursts += 1
    tally.requests += len(ids)
    if st.total != len(ids):
        tally.defect("phantom", burst, -1, f"its record says {st.total} requests, not {len(ids)}")
    got = handle.collect()
    tally.results += len(got)
    by_index = Counter(r.index for r in got)
    for i in range(len(ids)):
        if by_index[i] == 0:
            tally.defect("lost", burst, i, f"no result for {ids[i]!r}")
        elif by_index[i] > 1:
            tally.defect("duplicated", burst, i, f"{by_index[i]} results", by_index[i] - 1)
    extra = st.done + st.failed - len(got)
    if extra > 0:
        tally.defect("duplicated", burst, -1, f"done + failed counts {extra} more", extra)
    submitted = Counter(ids)
    seen = Counter(r.id for r in got)
    for rid, n in seen.items():
        if rid in submitted and n > submitted[rid]:
            tally.defect("duplicated", burst, -1, f"id {rid!r} on {n} results", n - submitted[rid])
    for r in got:
        tally.codes[r.error_code or "ok"] += 1
        if not 0 <= r.index < len(ids):
            tally.defect("phantom", burst, r.index, f"a result outside the burst ({r.id!r})")
            continue
        if r.id != ids[r.index]:
            whose = "never submitted" if r.id not in submitted else "another request's"
            tally.defect("phantom", burst, r.index, f"id {r.id!r} ({whose}), not {ids[r.index]!r}")
        elif r.error is None and r.text.split()[:1] != [markers[r.index]]:
            tally.defect("misanswered", burst, r.index, f"{r.text[:40]!r} for {ids[r.index]!r}")


def damage(r: redis.Redis, settings: Settings, burst: str, rng: random.Random) -> list[str]:
    """Break one result of each kind in ``burst`` (at least 8 ok results); what was done."""
    keys = Keys(settings.namespace)
    key = keys.results(burst)
    stored = {int(k): v for k, v in r.hgetall(key).items()}
    ok = sorted(i for i, v in stored.items() if _result(v).error is None)
    if len(ok) < 8:
        raise RuntimeError(f"burst {burst} has {len(ok)} ok results: too few to damage")
    a, b, c, d, e, f = rng.sample(ok, 6)
    done: list[str] = []
    r.hdel(key, str(a))
    done.append(f"lost: deleted the result of index {a}")
    r.hset(key, str(b), stored[c])
    done.append(f"lost + duplicated: the result of index {c} written over index {b}")
    res = _result(stored[d])
    res.id = f"phantom-{rng.randrange(10**6)}"
    r.hset(key, str(d), _encoded(res, settings))
    done.append(f"phantom: index {d} carries id {res.id!r}")
    res = _result(stored[e])
    res.text = "an answer of no request " + res.text
    r.hset(key, str(e), _encoded(res, settings))
    done.append(f"misanswered: index {e} carries another text")
    r.hincrby(keys.burst(burst), "done", 1)
    done.append(f"duplicated: the record counts one more result (index {f} twice)")
    return done


def _result(raw: bytes) -> Result:
    return Result.from_wire(wire.decode(raw))


def _encoded(res: Result, settings: Settings) -> Any:
    return wire.encode(res.to_wire(), settings.codec)
