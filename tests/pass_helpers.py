"""What the shared pass's tests share (tests/test_shared_pass.py, tests/test_shared_pass_lone.py):
a burst's entries in enqueue order, the workers' windows as a worker publishes them and reads
back, and the pass keys and content order of documents, computed here as the producer does."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import redis

from fake_engine import FakeEngine
from helpers import queued_entries, wait_until
from prefixq.client import results
from prefixq.client.encoding import _fingerprint, pass_key
from prefixq.client.order import peek
from prefixq.core import wire
from prefixq.core.entries import Entry
from prefixq.core.keys import POS, Keys
from prefixq.core.settings import Settings


def enqueued(r: redis.Redis, s: Settings, burst: str, shard: int = 0) -> list[Entry]:
    """``burst``'s queued entries on ``shard``, in their enqueue order."""
    placed = []
    for _, f in queued_entries(r, s, shard):
        e = Entry.from_wire(wire.decode(f[b"d"]))
        if e.burst == burst:
            lanes, intakes = (int(x) for x in f[POS].split(b":"))
            placed.append((lanes + intakes, e.index, e))
    return [e for *_, e in sorted(placed)]


def publish_window(
    r: redis.Redis, keys: Keys, shard: int, window: bytes, worker: str = "w"
) -> None:
    """``window`` published as worker ``worker`` of ``shard`` publishes it (registered in the
    shard's workers, its window under its own key: worker/shared_pass.py)."""
    r.zadd(keys.workers(shard), {worker: time.time()})
    r.set(keys.pass_marks(shard, worker), window)


def published(r: redis.Redis, keys: Keys, shards: int) -> set[int]:
    """Every pass key the registered workers of ``shards`` shards publish now."""
    out: set[int] = set()
    for k in range(shards):
        for name in r.zrange(keys.workers(k), 0, -1):
            raw = r.get(keys.pass_marks(k, name.decode()))
            if raw:
                out.update(wire.unpack(raw))
    return out


def key_of(text: str) -> int:
    """The pass key of a prefix ``text``."""
    k = pass_key(_fingerprint(text))
    assert k is not None
    return k


def content_order(texts: Sequence[str], docs: Iterable[int]) -> list[int]:
    """``docs`` (indexes into ``texts``) in their content order: first block's hash, then pass
    key (the order of a lone burst's documents and of a burst's new groups)."""
    lead = {d: peek({"prefix": texts[d], "prompt": "?"}, "grouped").lead for d in docs}
    return sorted(lead, key=lambda d: (lead[d], key_of(texts[d])))


def engine_for_window(r: redis.Redis, s: Settings, burst: str, docs: int) -> FakeEngine:
    """A fake engine whose KV cache makes a window (``pass_window`` 0.5) of ``docs`` of
    ``burst``'s documents (its largest one's tokens each)."""
    tokens = max(e.work + e.predicted_cached for e in enqueued(r, s, burst))
    engine = FakeEngine()
    engine.kv_tokens = 2 * docs * tokens  # type: ignore[attr-defined]
    return engine


def window_after(r: redis.Redis, s: Settings, burst: str) -> list[int]:
    """Once ``burst`` completed with nothing failed, the window fake worker ``fw`` of shard 0
    publishes (as soon as there is one)."""
    assert results.wait(burst, s, timeout=60).failed == 0
    keys = Keys(s.namespace)
    raw = wait_until(lambda: r.get(keys.pass_marks(0, "fw")), 10, "the published window")
    window = wire.unpack(raw)
    assert isinstance(window, list)
    return window
