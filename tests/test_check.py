"""The operator's commands on real Redis: `prefixq check` (healthchecks) against the real Worker
loop with the deterministic FakeEngine, `inspect --watch`, and ``--log-format json``."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pty
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from fake_engine import FakeEngine
from helpers import FakeWorker, cli, cli_argv
from prefixq.cli.logs import JsonFormatter
from prefixq.cli.redis_server import free_port
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.ops.health import check
from prefixq.worker.worker import EXIT_OK, Worker

MakeWorker = Callable[..., FakeWorker]


# ---- prefixq check --------------------------------------------------------------------------


def test_check_exits_0_with_a_live_worker_and_1_once_it_stopped(
    settings: Settings, fake_worker: MakeWorker
) -> None:
    """`prefixq check` exits 0 and names the worker while one serves the shard; after the worker
    stopped (its heartbeat removed) it exits 1 and says why in one line."""
    s = settings
    w = fake_worker(s, name="hc0")
    up = cli(s, "check")
    assert up.returncode == 0, up.stderr
    assert up.stdout.strip() == "ok: shard 0: hc0"
    assert w.stop() == EXIT_OK
    down = cli(s, "check")
    assert down.returncode == 1
    assert down.stdout == ""
    assert down.stderr.strip() == "shard 0: no healthy worker (no worker registered)"


def test_a_fractional_heartbeat_ttl_never_lets_a_live_workers_heartbeat_lapse(
    settings: Settings, fake_worker: MakeWorker
) -> None:
    """With heartbeat_s 1.5 and heartbeat_ttl_s 1.9 (valid: the beat comes before the TTL), the
    health key's TTL was cut to 1 s, so a live worker's key was gone a third of the time and
    `check` (a pod's health probe) failed on it. Polled for 4 s, the check passes every time
    and the key's TTL is never above the setting."""
    s = settings.replace(heartbeat_s=1.5, heartbeat_ttl_s=1.9)
    fake_worker(s, name="frac0")
    r = redis.Redis.from_url(s.redis_url)
    hb = s.keys.heartbeat(0, "frac0")
    end, polls = time.monotonic() + 4.0, 0
    while time.monotonic() < end:
        assert check(s, client=r).ok, f"check failed after {polls} polls"
        assert 0 < r.pttl(hb) <= 1900
        polls += 1
        time.sleep(0.05)
    r.close()


def test_check_of_one_shard_ignores_the_others(
    make_settings: Callable[..., Settings], fake_worker: MakeWorker
) -> None:
    """With 2 shards and a worker on shard 0 only: `--shard 0` passes, `--shard 1` and the
    all-shards check fail naming shard 1."""
    s = make_settings(shards=2)
    fake_worker(s, shard=0, name="only0")
    assert check(s, shard=0).ok
    one = check(s, shard=1)
    assert not one.ok and one.reason.startswith("shard 1: no healthy worker")
    every = cli(s, "check")
    assert every.returncode == 1
    assert every.stderr.strip() == "shard 1: no healthy worker (no worker registered)"
    assert check(s).healthy == {0: ["only0"], 1: []}


def test_check_of_a_shard_outside_the_deployment_is_a_usage_error(
    make_settings: Callable[..., Settings], fake_worker: MakeWorker
) -> None:
    """`check --shard 5` of a 1-shard deployment said "no healthy worker" (exit 1), as if a
    worker could come; it is a configuration error (exit 2), as for `dead` and `reclaim`."""
    s = make_settings(shards=1)
    fake_worker(s, shard=0, name="w0")
    p = cli(s, "check", "--shard", "5")
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == (
        f"prefixq: error: shard 5 does not exist (namespace '{s.namespace}' has shards 0..0)"
    )
    assert cli(s, "check", "--shard", "0").returncode == 0


def test_a_worker_whose_engine_is_not_up_or_whose_heartbeat_expired_is_not_healthy(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """A heartbeat saying engine_up 0 (still loading) fails the check, as does a registered name
    whose heartbeat expired (a dead worker); the reason names both."""
    s = make_settings()
    keys = Keys(s.namespace)

    async def beat() -> None:
        w = Worker(s, 0, FakeEngine(), name="loading")
        r.hset(keys.heartbeat(0, w.name), mapping=w.heartbeat.health(time.time()))
        r.expire(keys.heartbeat(0, w.name), 15)
        r.zadd(keys.workers(0), {w.name: time.time(), "crashed": time.time() - 60})
        await w.r.aclose()

    asyncio.run(beat())
    h = check(s, client=r)
    assert not h.ok
    assert h.reason == "shard 0: no healthy worker (loading engine not up; 1 heartbeat(s) expired)"


def _beat(r: redis.Redis, s: Settings, shard: int, name: str, **fields: object) -> None:
    """A worker's heartbeat hash as `Heartbeat.beat` writes it, with ``fields`` changed."""
    keys = Keys(s.namespace)

    async def write() -> None:
        w = Worker(s, shard, FakeEngine(), name=name)
        health = {**w.heartbeat.health(time.time()), **fields}
        r.hset(keys.heartbeat(shard, name), mapping=health)  # type: ignore[arg-type]
        r.expire(keys.heartbeat(shard, name), 15)
        r.zadd(keys.workers(shard), {name: time.time()})
        await w.r.aclose()

    asyncio.run(write())


def test_local_check_passes_on_this_hosts_worker_whatever_its_shard(
    make_settings: Callable[..., Settings], fake_worker: MakeWorker, r: redis.Redis
) -> None:
    """`check --local` (a pod's probe under `worker --join`, whose shard is not known in advance):
    this host's worker serving shard 1 of 2 passes, though shard 0 has no healthy worker; a
    healthy worker of another host counts for nothing."""
    s = make_settings(shards=2)
    r.hset(Keys(s.namespace).config, "shards", 2)  # as the deployment's first worker records it
    _beat(r, s, 0, "elsewhere-s0", host="other-host", engine_up=1)
    assert check(s, shard=0).ok  # healthy, but not on this host
    p = cli(s, "check", "--local")
    assert p.returncode == 1
    assert p.stderr.strip() == f"no healthy worker on host {socket.gethostname()!r}"
    fake_worker(s, shard=1, name="mine-s1")
    p = cli(s, "check", "--local")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "ok: shard 1: mine-s1"
    assert not check(s, local=True, host="third-host").ok


def test_alive_check_counts_a_loading_or_stopping_worker_but_not_an_expired_one(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """`check --local --alive` (liveness): a heartbeat saying engine not up, or stopping, is a
    live process (restarting it helps nothing), so it passes where `--local` fails; without any
    heartbeat of this host it fails too."""
    s = make_settings(shards=1)
    r.hset(Keys(s.namespace).config, "shards", 1)
    assert not check(s, local=True, alive=True).ok
    _beat(r, s, 0, "loading", engine_up=0)
    assert not check(s, local=True).ok
    assert check(s, local=True, alive=True).ok
    r.delete(Keys(s.namespace).heartbeat(0, "loading"))
    _beat(r, s, 0, "stopping", engine_up=1, stopping=1)
    p = cli(s, "check", "--local")
    assert p.returncode == 1 and "no healthy worker on host" in p.stderr
    p = cli(s, "check", "--local", "--alive")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "ok: shard 0: stopping"


def test_check_without_a_deployment_or_redis_fails_and_says_why(
    make_settings: Callable[..., Settings],
) -> None:
    """No shard count anywhere, or no Redis at all: unhealthy with a reason, never a traceback."""
    fresh = make_settings(shards=0)
    h = check(fresh)
    assert not h.ok and "no shard count" in h.reason
    gone = make_settings(redis_url=f"redis://127.0.0.1:{free_port()}/0")
    client = redis.Redis.from_url(gone.redis_url, retry=Retry(NoBackoff(), 0))
    h = check(gone, client=client)
    client.close()
    assert not h.ok and h.reason.startswith(f"redis at {gone.redis_url}:")


# ---- inspect --watch --------------------------------------------------------------------------


def test_inspect_watch_stops_after_watch_count_views(
    make_settings: Callable[..., Settings],
) -> None:
    """Off a terminal, `inspect --watch --watch-count 3` refreshes 3 times, prints the final
    view (the shards table) and exits 0."""
    s = make_settings()
    t0 = time.monotonic()
    p = cli(s, "inspect", "--watch", "--interval", "0.2", "--watch-count", "3", "--shards", "1")
    assert p.returncode == 0, p.stderr
    assert time.monotonic() - t0 >= 0.4  # two sleeps between three views
    assert f"shards of {s.namespace}" in p.stdout
    assert "prefixq inspect --watch" in p.stdout


def test_inspect_watch_redraws_in_a_terminal_until_ctrl_c(
    make_settings: Callable[..., Settings],
) -> None:
    """Under a pseudo-terminal the view is redrawn in place; Ctrl-C (SIGINT) ends it with 0."""
    s = make_settings()
    master, slave = pty.openpty()
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "160", "LINES": "60"}
    p = subprocess.Popen(
        cli_argv(s, "inspect", "--watch", "--interval", "0.1", "--shards", "1"),
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        close_fds=True,
    )
    os.close(slave)
    out = b""

    def read(until: Callable[[], bool], timeout: float) -> None:
        nonlocal out
        deadline = time.monotonic() + timeout
        while not until() and time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    return
                if not chunk:
                    return
                out += chunk

    try:
        read(lambda: out.count(b"shards of") >= 3, 30)
        assert out.count(b"shards of") >= 3, out[-2000:]
        assert b"\x1b[" in out  # cursor control: redrawn in place, not appended
        p.send_signal(signal.SIGINT)
        read(lambda: p.poll() is not None, 30)
        assert p.wait(timeout=30) == 0, out[-2000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(master)


def test_inspect_watch_and_json_do_not_mix(make_settings: Callable[..., Settings]) -> None:
    """`--watch --json` is a usage error (exit 2)."""
    p = cli(make_settings(), "inspect", "--watch", "--json")
    assert p.returncode == 2
    assert "--watch" in p.stderr


# ---- log format -----------------------------------------------------------------------------


def test_json_log_format_writes_one_parseable_object_per_line(
    make_settings: Callable[..., Settings],
) -> None:
    """`--log-format json` turns every log record into one JSON line with ts, level, logger
    and msg (here the check's debug lines); the command's own output line stays plain."""
    s = make_settings()
    p = cli(s, "check", "--shards", "1", "--log-level", "DEBUG", "--log-format", "json")
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert lines[-1] == "shard 0: no healthy worker (no worker registered)"
    records = [json.loads(line) for line in lines[:-1]]
    mine = [x for x in records if x["logger"] == "prefixq.ops.health"]
    assert mine, p.stderr
    assert mine[0]["level"] == "DEBUG"
    assert mine[0]["msg"] == "shard 0: healthy [], down [], expired 0"
    assert mine[0]["ts"].endswith("Z")


def test_json_formatter_keeps_tracebacks_and_extra_fields() -> None:
    """An exception's traceback goes into exc_info and ``extra`` fields ride along."""
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord(
            "prefixq.x", logging.ERROR, __file__, 1, "failed %s", ("b1",), sys.exc_info()
        )
    record.burst = "b1"
    out = json.loads(JsonFormatter().format(record))
    assert out["msg"] == "failed b1" and out["level"] == "ERROR" and out["logger"] == "prefixq.x"
    assert out["burst"] == "b1"
    assert "ValueError: boom" in out["exc_info"] and "Traceback" in out["exc_info"]
    assert "\n" not in JsonFormatter().format(record)


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_log_format_flag_is_on_every_command(fmt: str) -> None:
    """--log-format is a common flag, like --log-level (text is the default)."""
    from prefixq.cli.main import build_parser

    for argv in (["check"], ["inspect"], ["worker", "--shard", "0"]):
        assert build_parser().parse_args([*argv, "--log-format", fmt]).log_format == fmt
    # unset: text, unless PREFIXQ_LOG_FORMAT says otherwise (cli/main.py)
    assert build_parser().parse_args(["check"]).log_format is None
