"""A worker's start under a name another heartbeat holds (worker/startup.py `name_free`), on a
private redis-server: a live worker whose beats are late (a loaded machine) keeps its name, a
heartbeat that expires without a beat gives it up, and a process of this host that is gone gives
it up at once. The end-to-end refusal of a second worker process: tests/test_fleet_edges.py."""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import subprocess
import sys
import time
from typing import Any

import pytest
import redis

from prefixq.core.errors import ConfigError
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.store.connection import async_client
from prefixq.worker.shard import ShardStream
from prefixq.worker.startup import name_free


def _settings(url: str) -> Settings:
    return Settings(
        redis_url=url,
        namespace=f"name{secrets.token_hex(3)}",
        shards=1,
        heartbeat_s=0.3,
        heartbeat_ttl_s=4.0,
    )


def _beat(r: redis.Redis, s: Settings, pid: int, host: str, ttl_s: float) -> None:
    hb = Keys(s.namespace).heartbeat(0, "w0")
    r.hset(hb, mapping={"beat": time.time(), "pid": pid, "host": host, "every_s": 0.3})
    r.pexpire(hb, int(ttl_s * 1000))


def _check(s: Settings, late_beat_s: float | None) -> tuple[float, Any]:
    """`name_free` for ``w0`` on shard 0 while, ``late_beat_s`` after it starts, the holder
    beats once more (None: never); its time and what it raised (None: the name is free)."""

    async def main() -> tuple[float, Any]:
        ar = async_client(s)
        try:
            stream = ShardStream(ar, s, 0, "w0")
            started = time.monotonic()

            async def late() -> None:
                if late_beat_s is not None:
                    await asyncio.sleep(late_beat_s)
                    await ar.hset(Keys(s.namespace).heartbeat(0, "w0"), "beat", time.time())

            beat = asyncio.create_task(late())
            try:
                await name_free(stream, s)
                err: Any = None
            except ConfigError as e:
                err = e
            beat.cancel()
            return time.monotonic() - started, err
        finally:
            await ar.aclose()

    return asyncio.run(main())


def test_a_live_worker_whose_beat_is_late_keeps_its_name(redis_server: Any, r: redis.Redis) -> None:
    """Given w0's heartbeat from another host every 0.3 s, when its next beat comes 1.2 s late
    (four intervals: a loaded machine), then a second start under w0 is refused, naming the
    holder (before: it waited 1.5 intervals, took the beat as a dead predecessor's, deleted it
    and served beside the live worker under one consumer name)."""
    s = _settings(redis_server.url)
    _beat(r, s, 4242, "another-host", s.heartbeat_ttl_s)
    took, err = _check(s, 1.2)
    assert isinstance(err, ConfigError), f"the name was taken after {took:.2f}s"
    assert "worker name 'w0' is in use on shard 0: pid 4242 on host another-host" in str(err)
    assert r.exists(Keys(s.namespace).heartbeat(0, "w0"))  # the holder's heartbeat kept


def test_a_heartbeat_that_expires_without_a_beat_gives_the_name_up(
    redis_server: Any, r: redis.Redis
) -> None:
    """Given w0's heartbeat from another host that never beats again, the start waits for it to
    expire (its TTL, 2 s left) and takes the name; nothing raised."""
    s = _settings(redis_server.url)
    _beat(r, s, 4242, "another-host", 2.0)
    took, err = _check(s, None)
    assert err is None, err
    assert 1.5 <= took <= s.heartbeat_ttl_s + 3, took


def test_a_gone_process_of_this_host_gives_the_name_up_at_once(
    redis_server: Any, r: redis.Redis
) -> None:
    """Given w0's heartbeat written by a process of this host that has exited (a kill -9 and a
    restart on the same machine), the start takes the name without waiting for the TTL and
    drops the dead heartbeat; one of this very process (a container restarted under the same
    pid) likewise."""
    s = _settings(redis_server.url)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    for pid in (dead.pid, os.getpid()):
        _beat(r, s, pid, socket.gethostname(), 60.0)
        took, err = _check(s, None)
        assert err is None, err
        assert took < 1.0, took  # the TTL is 60 s
        assert not r.exists(Keys(s.namespace).heartbeat(0, "w0"))


@pytest.mark.parametrize("pid", ["1", "not-a-pid", "99999999999999999999", "٣"])
def test_a_heartbeat_of_a_live_or_unknown_process_is_waited_for(
    redis_server: Any, r: redis.Redis, pid: str
) -> None:
    """A heartbeat of this host whose process is alive (pid 1) or unreadable (not a number, past
    any pid, a digit that is not ASCII) is not taken at once: the start waits for a beat, and
    one within the TTL refuses it (never a crash of the start)."""
    s = _settings(redis_server.url)
    hb = Keys(s.namespace).heartbeat(0, "w0")
    r.hset(hb, mapping={"beat": time.time(), "pid": pid, "host": socket.gethostname()})
    r.pexpire(hb, 4000)
    took, err = _check(s, 0.8)
    assert isinstance(err, ConfigError), f"the name was taken after {took:.2f}s"
