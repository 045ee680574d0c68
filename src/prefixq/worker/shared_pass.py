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
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
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
    """The prefix groups the engine finished last, within ``window`` (a share) of ``kv_tokens``."""

    def __init__(self, key: str, window: float, kv_tokens: int = 0) -> None:
        self.key = key
        self.window = window
        self.capacity = 0
        self.kv_tokens = 0
        self.size(kv_tokens)
        self._lru: OrderedDict[int, int] = OrderedDict()
        self._tokens = 0
        self._dirty = False

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
            if not self._dirty and not (self._lru and loop.time() - last >= REFRESH_S):
                continue
            self._dirty = False
            last = loop.time()
            try:
                if self._lru:
                    await r.set(self.key, wire.pack(list(self._lru)), ex=TTL_S)
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
