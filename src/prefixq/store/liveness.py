"""Which shards have a live worker, in one hash every producer and worker reads (`Keys.live`).

Every heartbeat of a worker writes its shard's field with the time (`beat_commands`); a shard is
live while its field is younger than ``heartbeat_ttl_s`` (the same bound as a worker's health key).
Placement puts no new prefix on a shard that is not live, and a shard whose last heartbeat is
``orphan_after_s`` old (and at least ``heartbeat_ttl_s``) is orphaned: the live workers move its
queue away (worker/handover.py). A shard that never had a worker has no field; the first live worker
that looks records when it saw it so (`Keys.orphans`), and its age counts from then.

Each worker also records what its shard serves (`Keys.tasks`: generate or embed) as it starts and
beats; `tasks_of` reads it for placement, and work moves (worker/handover.py, worker/fleet.py) go
only between shards that serve the same task.

Times are the hosts' wall clocks, as for the workers' heartbeats: hosts whose clocks differ by a
good part of ``heartbeat_ttl_s`` see each other's shards as dead too early or too late.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import ResponseError

from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.store.connection import lua

log = logging.getLogger(__name__)

__all__ = [
    "FUTURE_S",
    "Liveness",
    "alive_mask",
    "beat_commands",
    "consumers_gone",
    "read_liveness",
    "read_load",
    "read_tasks",
    "tasks_of",
]


#: seconds ahead of a reader's clock past which a recorded time is not one (hosts' clocks differ
#: by far less; a time further ahead would hold a shard live, or held, or not orphaned, for good)
FUTURE_S = 3600.0

#: what a replaced key of placement's hints (`placement_types`) is rebuilt by, as logged
PLACEMENT_REBUILT = "a hint: heartbeats, submits and workers rebuild it"
LOAD_REBUILT = "an estimate: submits and workers rebuild it"


@dataclass(slots=True)
class Liveness:
    """What one read of the live hash says about shards ``0 .. shards-1``."""

    #: shard -> its last heartbeat (epoch s), for shards that ever had one
    last: dict[int, float]
    #: shard -> when a live worker first saw it without a live worker
    seen_dead: dict[int, float]
    shards: int
    ttl: float
    now: float
    #: shard -> what it serves (`tasks_of`: generate where none is recorded)
    tasks: list[str] | None = None

    @classmethod
    def of(
        cls,
        live: dict[Any, Any],
        orphans: dict[Any, Any],
        settings: Settings,
        shards: int,
        now: float,
        tasks: dict[Any, Any] | None = None,
    ) -> Liveness:
        """From a read of the live and orphans hashes (any client: `read_liveness` is the
        asyncio one's), and of the tasks hash when given."""
        return cls(
            times_of(live, shards, now),
            times_of(orphans, shards, now),
            shards,
            settings.heartbeat_ttl_s,
            now,
            None if tasks is None else tasks_of(tasks, shards),
        )

    def task(self, shard: int) -> str:
        """What ``shard`` serves (generate when the tasks hash was not read)."""
        return "generate" if self.tasks is None else self.tasks[shard]

    def alive(self, shard: int) -> bool:
        return self.now - self.last.get(shard, float("-inf")) <= self.ttl

    def live_shards(self) -> list[int]:
        return [k for k in range(self.shards) if self.alive(k)]

    def dead_for(self, shard: int) -> float:
        """Seconds shard ``shard`` has been without a live worker: since its last heartbeat, or
        since a live worker first saw it without one when it never had one (0: live, or not seen
        yet). At least ``ttl`` once it is dead: a worker is dead ``ttl`` after its last beat."""
        if self.alive(shard):
            return 0.0
        if shard in self.last:
            return self.now - self.last[shard]
        if shard in self.seen_dead:
            return max(0.0, self.now - self.seen_dead[shard])
        return 0.0


def _by_shard(raw: dict[Any, Any]) -> Iterator[tuple[int, Any]]:
    """(shard, value) of a read of a hash keyed by shard; a field that is not a shard is none."""
    for k, v in raw.items():
        try:
            yield int(k), v
        except (TypeError, ValueError):
            continue


def _numbers(raw: dict[Any, Any]) -> dict[int, float]:
    """Shard -> number of a read of a hash keyed by shard; a value that is not a number is none."""
    out: dict[int, float] = {}
    for shard, v in _by_shard(raw):
        try:
            out[shard] = float(v)
        except (TypeError, ValueError):
            continue
    return out


def times_of(raw: dict[Any, Any], shards: int, now: float) -> dict[int, float]:
    """Shard -> time of a read of a hash of times (live, orphans); a value that is not a time
    (not a number, not finite, more than `FUTURE_S` ahead of ``now``: a hand edit, a restore)
    is none, so no such value holds a shard live, or keeps it from being orphaned, for good."""
    return {
        k: v
        for k, v in _numbers(raw).items()
        if 0 <= k < shards and math.isfinite(v) and v <= now + FUTURE_S
    }


async def read_liveness(r: aredis.Redis, settings: Settings, shards: int) -> Liveness:
    """Both hashes in one round trip."""
    keys = Keys(settings.namespace)
    pipe = r.pipeline(transaction=False)
    pipe.hgetall(keys.live)
    pipe.hgetall(keys.orphans)
    pipe.hgetall(keys.tasks)
    live, orphans, tasks = await pipe.execute()
    return Liveness.of(live, orphans, settings, shards, time.time(), tasks)


async def consumers_gone(
    r: aredis.Redis, keys: Keys, shard: int, consumers: Iterable[bytes]
) -> set[bytes]:
    """Those of ``consumers`` (workers of ``shard``, by consumer name) that have no heartbeat
    key: they died (the key lapsed ``heartbeat_ttl_s`` after their last beat) or stopped. The
    entries pending on them are free to take (worker/queued.py for a move, worker/reclaim.py for
    a claim). One EXISTS per heartbeat key in one round trip (a pipeline; the keys share the
    shard's hash tag, so on a Cluster they are one slot, one node)."""
    names = list(dict.fromkeys(consumers))
    if not names:
        return set()
    pipe = r.pipeline(transaction=False)
    for c in names:
        pipe.exists(keys.heartbeat(shard, c.decode(errors="replace")))
    return {c for c, there in zip(names, await pipe.execute(), strict=True) if not there}


def tasks_of(raw: dict[Any, Any], shards: int) -> list[str]:
    """What each of ``shards`` serves by a read of the tasks hash: generate where none is
    recorded (a deployment older than the field, or a shard no worker has started on)."""
    out = ["generate"] * shards
    for shard, v in _by_shard(raw):
        if 0 <= shard < shards:
            out[shard] = v.decode() if isinstance(v, bytes) else str(v)
    return out


async def read_tasks(r: aredis.Redis, keys: Keys, shards: int) -> list[str]:
    """What each of ``shards`` serves (`tasks_of`)."""
    return tasks_of(await r.hgetall(keys.tasks), shards)


async def read_load(r: aredis.Redis, keys: Keys, shards: Iterable[int]) -> dict[int, float]:
    """The estimated outstanding prefill tokens of ``shards`` (`Keys.load`; 0 where none). A key
    of another type is replaced (`repair_types`) and read as none: an estimate never stops a
    submit, a move or a fleet look."""
    try:
        raw = await r.hgetall(keys.load)
    except ResponseError as err:
        if not await repaired(r, err, {keys.load: "hash"}, LOAD_REBUILT):
            raise
        raw = {}
    return load_of(raw, shards)


def add_load(pipe: Any, keys: Keys, shard: int, tokens: int) -> Any:
    """Raise (lower: negative ``tokens``) ``shard``'s outstanding prefill tokens on ``pipe`` (a
    client or a pipeline, sync or async): lua/add_load.lua, an HINCRBY that a value other than
    an integer in the hash cannot fail."""
    return pipe.eval(lua("add_load"), 1, keys.load, str(shard), int(tokens))


def load_of(raw: dict[Any, Any], shards: Iterable[int]) -> dict[int, float]:
    """``shards``' outstanding prefill tokens in a read of `Keys.load` (0 where none). An
    estimate: a field that is not a shard or a value that is not a finite number counts as
    none, never an error (placement, moves and steals all read it)."""
    load = dict.fromkeys(shards, 0.0)
    for shard, tokens in _numbers(raw).items():
        if shard in load and math.isfinite(tokens):
            load[shard] = max(0.0, tokens)
    return load


def alive_mask(
    raw: dict[Any, Any], shards: int, ttl: float, now: float, among: list[int] | None = None
) -> list[bool]:
    """Which of ``shards`` are live by a read of the live hash (``raw``); every shard when none
    is (no worker is up yet: work waits for the first one, wherever it goes). With ``among``,
    only those shards count (the ones that serve the burst's task), and all of them when none
    of them is live."""
    last = times_of(raw, shards, now)
    pool = set(range(shards) if among is None else among)
    mask = [k in pool and now - last.get(k, float("-inf")) <= ttl for k in range(shards)]
    return mask if any(mask) else [k in pool for k in range(shards)]


def beat_commands(pipe: Any, keys: Keys, shard: int, now: float, task: str = "generate") -> None:
    """Add a heartbeat's liveness writes to ``pipe``: the shard is live now, not orphaned, no
    longer held for a joining worker (`Keys.joins`: once its worker beats, the hold has done its
    job, and a joiner that dies later leaves the shard to the next one), and serves ``task``
    (`Keys.tasks`)."""
    pipe.hset(keys.live, str(shard), repr(now))
    pipe.hdel(keys.orphans, str(shard))
    pipe.hdel(keys.joins, str(shard))
    pipe.hset(keys.tasks, str(shard), task)


def beat_types(keys: Keys, shard: int, heartbeat: str) -> dict[str, str]:
    """The type of each key a heartbeat writes (`beat_commands`, the worker's own heartbeat hash
    and its shard's worker set): all rebuilt by heartbeats, so one of another type (written by
    something else) is replaced (`repair_types`)."""
    hashes = (heartbeat, keys.live, keys.orphans, keys.joins, keys.tasks)
    return {**dict.fromkeys(hashes, "hash"), keys.workers(shard): "zset"}


def placement_types(keys: Keys) -> dict[str, str]:
    """The type of each key a producer reads to place a burst that holds hints rebuilt by use:
    what each shard serves and whether it is live (heartbeats), the load estimate and the prefix
    map (submits and workers). One of another type is replaced (`repaired`), not a failed
    submit."""
    hints = (keys.live, keys.tasks, keys.load, keys.prefix_map, keys.prefix_map_old)
    return dict.fromkeys(hints, "hash")


async def repaired(
    r: aredis.Redis, err: Exception, expected: dict[str, str], rebuilt: str = PLACEMENT_REBUILT
) -> bool:
    """``err`` is Redis's WRONGTYPE and one of ``expected``'s keys held another type, now
    replaced (`repair_types`): whether to try again."""
    if not isinstance(err, ResponseError) or "WRONGTYPE" not in str(err):
        return False
    return bool(await repair_types(r, expected, rebuilt))


async def repair_types(
    r: aredis.Redis, expected: dict[str, str], rebuilt: str = "heartbeats rebuild it"
) -> list[str]:
    """Delete each of ``expected``'s keys that holds another type than it names (a WRONGTYPE for
    every reader and writer until then: submits, inspect and every heartbeat failed for good);
    the keys deleted, each logged once (saying what ``rebuilt`` them), to be written anew."""
    pipe = r.pipeline(transaction=False)
    for key in expected:
        pipe.type(key)
    found = await pipe.execute()
    wrong = []
    for (key, want), got in zip(expected.items(), found, strict=True):
        kind = got.decode() if isinstance(got, bytes) else str(got)
        if kind not in (want, "none"):
            log.warning("%s held a %s, not a %s: replaced (%s)", key, kind, want, rebuilt)
            wrong.append(key)
    if wrong:  # one DEL each: on a cluster they are in different slots
        pipe = r.pipeline(transaction=False)
        for key in wrong:
            pipe.delete(key)
        await pipe.execute()
    return wrong
