"""Where this worker's pass is: the prefix groups its engine most likely holds, for producers.

`PassMarks` follows the requests the engine finishes, as its prefix cache does: a least recently
used list of their groups' pass keys (`prefixq.core.entries.Entry.group`; a lone request's
long prefix's, `Entry.lone_key`, as a group of one), each with the tokens
its requests' prompts take, cut to ``pass_window`` of the engine's KV cache (the newest groups
only: what a burst that starts among them finds still there once it gets to them). Finished, not
admitted: the worker hands up to twice ``max_num_seqs`` requests to the engine at once (on an
H200 a whole burst of hundreds), so the groups it admitted last are the end of what the engine
has queued, not where its pass is; the groups it finished last are where the engine's own queue
is served from (worker/engine_order.py: a burst that joins starts at the completion front), and
their prefixes are the newest in its cache. The
worker publishes it every `PUBLISH_S` when it changed, and every `REFRESH_S` to renew its TTL
(a msgpack array, oldest first, with a TTL of `TTL_S`: a dead worker's window goes with it;
Keys.pass_marks, one key per worker: several workers of a shard each keep theirs, and a producer
reads them together), and a producer starts a burst over the same documents there
(client/shared_pass.py): a pass moves tens of documents a second on a GPU, so not only with the
heartbeat. An engine that says nothing of its KV cache (a test engine) counts `COUNT_WINDOW`
groups instead. A reset of the engine's prefix cache empties it.

With ``pass_running`` (the default since an H100 measured it: docs/BENCHMARKS.md) the published
window follows what the engine holds, not only what it finished: the prefixes of the requests it
most likely runs now (of those handed to it, in the order it serves them: engine priority, then
arrival, as many distinct prefixes as its cache holds), after the prefixes it finished last, cut
to what the running ones leave of the cache. vLLM evicts the blocks freed first when a running
request needs room, so on an engine whose running batch fills its cache what it finished last is
what it evicts next, and a burst that starts there walks behind its own evictions; it starts at
the oldest prefix still held instead (the trace of docs/BENCHMARKS.md 2026-12-06).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from typing import Any

from prefixq.core import wire
from prefixq.core.entries import Entry
from prefixq.store.redis_errors import TRANSIENT

__all__ = ["COUNT_WINDOW", "PassMarks", "resetting"]

log = logging.getLogger(__name__)

#: groups in the window of an engine of unknown KV capacity
COUNT_WINDOW = 64
#: seconds the published window outlives its worker's last publication: a worker that died or
#: restarted (its engine's cache empty) stops pointing bursts at what it held within this
TTL_S = 60
#: seconds between two publications of a changed window
PUBLISH_S = 0.2
#: seconds between two publications of a window that did not change (its TTL renewed)
REFRESH_S = 20


class PassMarks:
    """The prefix groups the engine finished last, within ``window`` (a share) of ``kv_tokens``;
    with ``running``, those it runs now too (`published`)."""

    def __init__(self, key: str, window: float, kv_tokens: int = 0, running: bool = False) -> None:
        self.key = key
        self.window = window
        self.capacity = 0
        self.kv_tokens = 0
        self.size(kv_tokens)
        self._lru: OrderedDict[int, int] = OrderedDict()
        self._tokens = 0
        self._dirty = False
        #: whether the published window follows the requests inside the engine
        self.running = running
        #: the requests inside the engine: (engine priority, arrival, pass key, prompt tokens)
        self._inside: dict[Hashable, tuple[int, int, int, int]] = {}
        self._arrivals = itertools.count()

    def size(self, kv_tokens: int) -> None:
        """The engine's KV cache, in tokens (0: unknown). A known cache is a window of at least
        one token (the newest group), never the unknown cache's `COUNT_WINDOW` groups."""
        self.kv_tokens = kv_tokens
        self.capacity = max(1, int(kv_tokens * self.window)) if kv_tokens > 0 else 0

    def resize(self, window: float) -> None:
        """A new window (a share of the same cache; worker/kv_budget.py's budget sets it)."""
        self.window = window
        self.size(self.kv_tokens)

    def note(self, e: Entry) -> None:
        """``e``'s request finished in the engine: its group is the newest."""
        g = e.group if e.group is not None else e.lone_key
        if g is None:
            return
        lru = self._lru
        tokens = e.work + e.predicted_cached
        old = lru.pop(g, None)
        if old is not None:
            self._tokens -= old
            tokens = max(tokens, old)
        lru[g] = tokens
        self._tokens += tokens
        cap = self.capacity
        while len(lru) > 1 and (self._tokens > cap if cap else len(lru) > COUNT_WINDOW):
            _, gone = lru.popitem(last=False)
            self._tokens -= gone
        self._dirty = True

    def enter(self, ref: Hashable, e: Entry, priority: int) -> None:
        """``e``'s request (``ref``) was handed to the engine with engine ``priority``."""
        g = e.group if e.group is not None else e.lone_key
        if self.running and g is not None:
            self._inside[ref] = (priority, next(self._arrivals), g, e.work + e.predicted_cached)
            self._dirty = True

    def leave(self, ref: Hashable) -> None:
        """The request ``ref`` left the engine (finished, failed or aborted)."""
        if self._inside.pop(ref, None) is not None:
            self._dirty = True

    def held(self) -> dict[int, int]:
        """The pass keys (and tokens) of the prefixes the engine most likely runs now: of the
        requests inside it, in the order it serves them (priority, then arrival), each prefix
        once, as many as its KV cache holds (nothing while its cache is unknown)."""
        out: dict[int, int] = {}
        if not self.kv_tokens:
            return out
        room = self.kv_tokens
        for _, _, g, tokens in sorted(self._inside.values()):
            if g in out:
                continue
            if tokens > room:
                break
            out[g] = tokens
            room -= tokens
        return out

    def published(self) -> list[int]:
        """The window producers read, oldest first: the groups finished last; with ``running``,
        only as many as fit what the running prefixes leave of the cache, then those."""
        if not self.running or not self.kv_tokens:
            return list(self._lru)
        held = self.held()
        room = min(self.capacity, self.kv_tokens - sum(held.values()))
        kept: list[int] = []
        for g in reversed(self._lru):
            if g in held:
                continue
            tokens = self._lru[g]
            if tokens > room:
                break
            room -= tokens
            kept.append(g)
        return kept[::-1] + list(held)

    def clear(self) -> None:
        """The engine's prefix cache was reset: it holds nothing."""
        self._lru.clear()
        self._tokens = 0
        self._dirty = True

    def __contains__(self, group: object) -> bool:
        """Whether ``group`` is in the window (finished last: most likely still cached)."""
        return group in self._lru

    def keys(self) -> list[int]:
        """The window's pass keys, oldest first."""
        return list(self._lru)

    async def run(self, r: Any) -> None:
        """Publish the window every `PUBLISH_S` while it changes, and every `REFRESH_S` while
        it holds something, so that it lives as long as its worker (a task of the worker's)."""
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(PUBLISH_S)
            kept = self._lru or self._inside
            if not self._dirty and not (kept and loop.time() - last >= REFRESH_S):
                continue
            self._dirty = False
            last = loop.time()
            try:
                window = self.published()
                if window:
                    await r.set(self.key, wire.pack(window), ex=TTL_S)
                else:
                    await r.delete(self.key)
            except TRANSIENT as e:  # a hint: the next change publishes it again
                self._dirty = True
                log.debug("shared pass: window not published: %s", e)


def resetting(
    reset: Callable[[], Awaitable[object]], marks: PassMarks
) -> Callable[[], Awaitable[None]]:
    """The control command ``reset_prefix_cache``: ``reset`` (the engine's), then `clear`."""

    async def run() -> None:
        await reset()
        marks.clear()

    return run
