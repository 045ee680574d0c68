"""The soak's bursts: what is submitted, how, and what each request's answer must start with.

A seeded plan of bursts whose sizes add up to the requests asked for: plain prompts, prompts on a
shared document (a ``prefix`` long enough to be stored once), chats on a shared system prompt,
and token-id prompts; string ids and numeric ids (an id made up from an input index is then
either never submitted or another request's id); priorities and tenants mixed; submitted through
the Python API or the ``prefixq submit`` command, some with a deadline.

tests/fake_engine.py answers with the prompt's words reversed, so every request's prompt ends
with a word of its own (its `marker`): an answer that does not start with it is another
request's answer. ``sleep:S`` as a prompt's first word makes the fake engine take S seconds, so
that faults find requests in flight.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PRIORITIES = ("high", "normal", "low")
TENANTS = ("ta", "tb", "tc")
#: a token id marker is this plus the request's number in the run (FakeEngine prints token ids)
_TOKEN_BASE = 70_000_000


@dataclass
class Planned:
    """One burst the soak submits, and what became of its submit."""

    no: int
    burst_id: str
    via: str  # "api" or "cli"
    priority: str
    tenant: str
    requests: list[dict[str, Any]]
    #: the first word each request's answer must have, by input index
    markers: list[str]
    #: seconds after the run's start at which it is submitted
    at: float
    #: a deadline this many seconds after the submit (API only), or None
    deadline_in: float | None = None
    #: filled in as it runs: the submit's exit code and error text
    rc: int | None = None
    error: str = ""
    #: the submit was killed on purpose mid-way (fault ``producer_kill``)
    killed: bool = False
    #: 0 for a burst of the plan; n for its n-th submit again after a failed one
    attempt: int = 0

    @property
    def ids(self) -> list[str]:
        return [str(q["id"]) for q in self.requests]

    def write(self, folder: Path) -> Path:
        path = folder / f"{self.burst_id}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for q in self.requests:
                f.write(json.dumps(q) + "\n")
        return path


class Plan:
    """Bursts for ``total`` requests, submitted over ``span_s`` seconds; deterministic per seed."""

    def __init__(self, rng: random.Random, run: str, total: int, span_s: float) -> None:
        self.rng, self.run = rng, run
        self.serial = 0
        self.bursts: list[Planned] = []
        sizes = self._sizes(total)
        n = len(sizes)
        times = [0.0] + [span_s * (i + rng.random()) / n for i in range(1, n)]
        for size, at in zip(sizes, times, strict=True):
            self.bursts.append(self.burst(size, at))

    def _sizes(self, total: int) -> list[int]:
        """Planned sizes adding up to ``total``: about one burst per 1,300 requests (the issue's
        20,000 requests in 14-17 bursts), at least 8, a fifth of them small (3-40)."""
        rng, sizes, left = self.rng, [], total
        mean = total / max(8, round(total / 1300))
        while left > 0:
            small = rng.random() < 0.2
            size = rng.randint(3, 40) if small else max(1, round(mean * rng.uniform(0.3, 1.7)))
            size = min(size, left)
            if 0 < left - size < 3:
                size = left
            sizes.append(size)
            left -= size
        return sizes

    def burst(self, size: int, at: float, *, no: int = 0, via: str = "") -> Planned:
        """A new burst of ``size`` requests of one random kind mix (``no``: its number, default
        the next; ``via``: api or cli, default either)."""
        rng = self.rng
        no = no or len(self.bursts) + 1
        bid = f"{self.run}-b{no:03d}"
        numeric = rng.random() < 0.3
        doc_count = rng.randint(1, 4)
        docs = [self._doc(d) for d in range(doc_count)]
        system = f"You answer briefly. Context {no}. " * 20  # stored once, as a prefix
        reqs, markers = [], []
        for i in range(size):
            self.serial += 1
            rid: str | int = (i + 1) if numeric else f"{bid}-q{i}"
            marker = f"m{no}x{i}"
            sleep = rng.choice(("sleep:0.05", "sleep:0.15", "sleep:0.3", "sleep:0.5"))
            kind = rng.random()
            q: dict[str, Any] = {"id": rid, "max_tokens": rng.randint(4, 16)}
            if kind < 0.35:
                q["prompt"] = f"{sleep} plain question {i} of burst {no} {marker}"
            elif kind < 0.7:
                q["prefix"] = docs[i % doc_count]
                q["prompt"] = f"\n\nQuestion {i}: what does it say? {marker}"
            elif kind < 0.9:
                q["messages"] = [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"Question {i} of burst {no} {marker}"},
                ]
            else:
                token = _TOKEN_BASE + self.serial
                marker = str(token)
                q["prompt_token_ids"] = [11, 12, 13, i % 1000, token]
            if rng.random() < 0.05:
                q["temperature"] = 0.7
            reqs.append(q)
            markers.append(marker)
        via = via or rng.choice(("api", "cli"))
        deadline = rng.uniform(5.0, 20.0) if via == "api" and rng.random() < 0.1 else None
        return Planned(
            no=no,
            burst_id=bid,
            via=via,
            priority=rng.choice(PRIORITIES),
            tenant=rng.choice(TENANTS),
            requests=reqs,
            markers=markers,
            at=at,
            deadline_in=deadline,
        )

    def _doc(self, d: int) -> str:
        """A shared document (stored once: over prefix_store_min_chars); its first word makes
        the fake engine take a moment."""
        pause = self.rng.choice(("sleep:0.1", "sleep:0.3"))
        return f"{pause} Document {d}. " + " ".join(
            f"clause-{d}-{k} says the parties agree on item {k}." for k in range(40)
        )

    def resubmission(self, of: Planned) -> Planned:
        """The same requests under a new burst id, after a failed submit (docs/delivery.md)."""
        root = of.burst_id.rsplit("-r", 1)[0] if of.attempt else of.burst_id
        return Planned(
            no=of.no,
            burst_id=f"{root}-r{of.attempt + 1}",
            via=of.via,
            priority=of.priority,
            tenant=of.tenant,
            requests=of.requests,
            markers=of.markers,
            at=of.at,
            attempt=of.attempt + 1,
        )
