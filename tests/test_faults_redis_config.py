"""Faults in Redis's own configuration: an evicting maxmemory-policy, Redis at maxmemory (OOM), ACL
users per namespace (docs/delivery.md, "Redis settings prefixq
requires and checks" and "One ACL user per namespace").

Each test starts its own private redis-server configured with the fault (an eviction policy, a
maxmemory below used memory, ACL users), checks that the fault is really there before it counts
it in the ledger, and drives real parts: the CLI as a process, the `Producer`, and a real `Worker`
loop over the deterministic fake engine.
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aredis

from helpers import FakeWorker, cli, requests
from ledger import LEDGER, account
from prefixq.cli.redis_server import RedisServer
from prefixq.client import Producer, results
from prefixq.core.errors import ConfigError, RedisOutOfMemory
from prefixq.core.settings import Settings
from prefixq.store.connection import lua
from prefixq.store.policy import acheck_policy, check_policy
from prefixq.store.redis_errors import describe, error_text

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
#: the ACL rule docs/delivery.md gives for one namespace (nsA), run here as written
DOC_RULE = next(
    line.split()
    for line in (ROOT / "docs/delivery.md").read_text().splitlines()
    if line.startswith("ACL SETUSER team-a ")
)
PASSWORD = "change-me"


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A private redis-server for one test (its configuration is the test's fault)."""
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def admin(server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(server.url)
    yield client
    client.close()


def user_url(srv: RedisServer, user: str, password: str = PASSWORD) -> str:
    return f"redis://{user}:{password}@127.0.0.1:{srv.port}/0"


def printable(text: str) -> bool:
    """No control characters, replacement characters or escaped bytes (a binary payload)."""
    return all(c.isprintable() or c == "\n" for c in text) and not re.search(
        r"\ufffd|\\x[0-9a-f]{2}", text
    )


# ---- maxmemory-policy ------------------------------------------------------------------------
def test_check_refuses_an_evicting_redis_with_how_to_fix_it(
    server: RedisServer, admin: redis.Redis
) -> None:
    """Given a Redis whose maxmemory-policy is allkeys-lru, `prefixq check` exits 2 and says what
    is wrong and how to fix it (CONFIG SET maxmemory-policy noeviction)."""
    admin.config_set("maxmemory-policy", "allkeys-lru")
    assert admin.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"
    LEDGER.fault("Redis evicts keys (allkeys-lru)")
    p = cli(Settings(redis_url=server.url, namespace="evict"), "check", "--shards", "1")
    print(f"  prefixq check: exit {p.returncode}: {p.stderr.strip()}")
    assert p.returncode == 2
    assert "maxmemory-policy allkeys-lru" in p.stderr
    assert "CONFIG SET maxmemory-policy noeviction" in p.stderr


def test_allow_eviction_accepts_an_evicting_redis_with_a_warning_at_every_check(
    server: RedisServer, admin: redis.Redis
) -> None:
    """With allow_eviction, `prefixq check` against a volatile-lru Redis passes (a worker serves)
    and logs a WARNING naming the policy, at every run."""
    admin.config_set("maxmemory-policy", "volatile-lru")
    assert admin.config_get("maxmemory-policy")["maxmemory-policy"] == "volatile-lru"
    LEDGER.fault("Redis evicts keys (volatile-lru), allowed")
    s = Settings(redis_url=server.url, namespace="allowed", shards=1, allow_eviction=True)
    with FakeWorker(s, name="ev0"):
        for _ in range(2):
            p = cli(s, "check", "--allow-eviction")
            assert p.returncode == 0, p.stderr
            assert "WARNING" in p.stderr and "maxmemory-policy volatile-lru" in p.stderr


def test_policy_is_read_from_info_when_the_acl_refuses_config(
    server: RedisServer, admin: redis.Redis
) -> None:
    """A user whose ACL refuses CONFIG is still checked (INFO memory): an evicting policy is
    refused through the blocking and the asyncio client alike."""
    admin.config_set("maxmemory-policy", "allkeys-random")
    admin.execute_command("ACL", "SETUSER", "noconfig", "on", f">{PASSWORD}", "~*", "+@all")
    admin.execute_command("ACL", "SETUSER", "noconfig", "-config")
    s = Settings(redis_url=user_url(server, "noconfig"), namespace="info")
    r = redis.Redis.from_url(s.redis_url)
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.config_get("maxmemory-policy")
        with pytest.raises(ConfigError, match="maxmemory-policy allkeys-random"):
            check_policy(r, s)
    finally:
        r.close()

    async def main() -> None:
        ar = aredis.Redis.from_url(s.redis_url)
        try:
            with pytest.raises(ConfigError, match="maxmemory-policy allkeys-random"):
                await acheck_policy(ar, s)
        finally:
            await ar.aclose()

    asyncio.run(main())


def test_policy_that_cannot_be_read_is_a_warning_not_an_error(
    server: RedisServer, admin: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A user refused both CONFIG and INFO gets a warning that the policy could not be checked,
    and the check goes on."""
    admin.execute_command(
        "ACL", "SETUSER", "blind", "on", f">{PASSWORD}", "~*", "+@all", "-config", "-info"
    )
    s = Settings(redis_url=user_url(server, "blind"), namespace="blind")
    r = redis.Redis.from_url(s.redis_url)
    try:
        with caplog.at_level(logging.WARNING, logger="prefixq.store.policy"):
            check_policy(r, s)
    finally:
        r.close()
    assert any("could not check the maxmemory-policy" in m for m in caplog.messages)


# ---- out of memory -----------------------------------------------------------------------------
def at_maxmemory(admin: redis.Redis) -> None:
    """maxmemory below used memory (noeviction): every write that adds memory is refused; the
    fault is counted once Redis has refused a write."""
    admin.set("ballast", "x" * 200_000)
    admin.config_set("maxmemory", "100000")
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        admin.set("probe", "y")
    LEDGER.fault("Redis at maxmemory refuses writes (OOM)")


def test_submit_at_maxmemory_says_out_of_memory_with_figures_and_no_payload(
    server: RedisServer, admin: redis.Redis, tmp_path: Path
) -> None:
    """`prefixq submit` against a Redis at maxmemory exits 1 with "Redis at … is out of memory
    (used … of maxmemory …, policy noeviction)": printable, one line, never "cannot reach"."""
    s = Settings(redis_url=server.url, namespace="oom", shards=1)
    at_maxmemory(admin)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"id": "q{i}", "prompt": "{"é" * 2000} {i}"}}\n' for i in range(20)))
    p = cli(s, "submit", str(src), "--shards", "1")
    print(f"  prefixq submit: exit {p.returncode}: {p.stderr.strip()[-400:]}")
    assert p.returncode == 1
    last = p.stderr.strip().splitlines()[-1]
    assert re.search(
        r"Redis at redis://127\.0\.0\.1:\d+/0 is out of memory \(used \S+ of maxmemory "
        r"\S+, policy noeviction\): OOM command not allowed",
        last,
    ), last
    assert "cannot reach" not in p.stderr and "redis-server running" not in p.stderr
    assert "Traceback" not in p.stderr and printable(p.stderr)
    assert len(last) < 600


def test_error_text_of_a_pipeline_oom_is_one_printable_line_without_the_arguments(
    server: RedisServer, admin: redis.Redis
) -> None:
    """The OOM of a pipelined EVALSHA with a compressed argument (what the result writer sends)
    reads, through `error_text`, as one printable line naming the command but not its
    arguments, from the blocking and the asyncio client alike; `describe` makes it a
    RedisOutOfMemory with Redis's memory figures."""
    payload = zlib.compress(bytes(range(256)) * 8, 1)
    sha = admin.script_load(lua("record_result"))
    admin.hset("oom:{b1}:meta", "total", 1)  # a running burst: the script goes on to write
    at_maxmemory(admin)
    keys = ("oom:{b1}:results", "oom:{b1}:meta", "oom:{b1}:events", "oom:{b1}:ids")
    args = (*keys, 60, 1, "", 0, payload, "", 1, 0, 0, "0")
    pipe = admin.pipeline(transaction=False)
    pipe.get("ballast")
    pipe.evalsha(sha, 4, *args)
    with pytest.raises(redis.exceptions.OutOfMemoryError) as sync_err:
        pipe.execute()

    async def fail_async() -> BaseException:
        ar = aredis.Redis.from_url(server.url)
        try:
            apipe = ar.pipeline(transaction=False)
            apipe.evalsha(sha, 4, *args)
            try:
                await apipe.execute()
            except redis.exceptions.OutOfMemoryError as e:
                return e
            raise AssertionError("the asyncio pipeline was not refused")
        finally:
            await ar.aclose()

    async_err = asyncio.run(fail_async())
    for err, n in ((sync_err.value, 2), (async_err, 1)):
        assert "of pipeline caused error" in str(err) and "{b1}" in str(err)  # redis-py
        text = error_text(err)
        print(f"  {type(err).__name__}: {text}")
        assert text.startswith("OOM command not allowed when used memory > 'maxmemory'")
        assert text.endswith(f"(pipeline command {n}, EVALSHA)")
        assert printable(text) and "\n" not in text and "{b1}" not in text
    s = Settings(redis_url=server.url, namespace="oom")
    err = describe(s, sync_err.value, admin)
    assert isinstance(err, RedisOutOfMemory)
    assert re.search(
        r"is out of memory \(used \S+ of maxmemory 97\.66K, policy noeviction\)", str(err)
    )


# ---- ACL users, one per namespace --------------------------------------------------------------
@pytest.fixture
def team_a(admin: redis.Redis, server: RedisServer) -> Settings:
    """The user team-a, made with the rule of docs/delivery.md, and its namespace nsA."""
    assert DOC_RULE[:3] == ["ACL", "SETUSER", "team-a"] and "~nsA:*" in DOC_RULE
    admin.execute_command(*DOC_RULE)
    return Settings(redis_url=user_url(server, "team-a"), namespace="nsA", shards=1)


def test_acl_user_of_one_namespace_runs_a_burst_end_to_end_and_writes_only_its_keys(
    team_a: Settings, admin: redis.Redis, tmp_path: Path
) -> None:
    """As the user the documented ACL rule makes, a producer, a worker and the CLI (submit,
    results, inspect, check, dead, reclaim) serve a burst of namespace nsA; every key written
    starts with "nsA:"."""
    s = team_a
    with FakeWorker(s, name="acl0"):
        burst = Producer(s).submit(requests(12))
        results.wait(burst, s, timeout=30)
        src = tmp_path / "in.jsonl"
        src.write_text("".join(f'{{"id": "f{i}", "prompt": "file {i}"}}\n' for i in range(5)))
        sub = cli(s, "submit", str(src), "--wait")
        assert sub.returncode == 0, sub.stderr
        for args in (
            ("results", burst),
            ("inspect", "--json"),
            ("check",),
            ("dead",),
            ("reclaim",),
        ):
            p = cli(s, *args)
            assert p.returncode == 0, f"{args}: {p.stderr}"
    out = account(admin, s, burst, 12, what="ACL user's burst")
    assert (out.lost, out.duplicated, out.done) == (0, 0, 12)
    keys = sorted(k.decode() for k in admin.scan_iter(count=1000))
    print(f"  keys written: {keys}")
    assert keys and all(k.startswith("nsA:") for k in keys), keys


def test_acl_user_of_nsA_is_refused_on_every_key_of_nsAB(
    team_a: Settings, admin: redis.Redis, server: RedisServer
) -> None:
    """Every key of namespace nsAB (a burst served there by another user) is refused to the user
    of nsA, for reading and for writing, and so is nsAB through prefixq's own API."""
    other = Settings(redis_url=server.url, namespace="nsAB", shards=1)
    with FakeWorker(other, name="ab0"):
        burst = Producer(other).submit(requests(6))
        results.wait(burst, other, timeout=30)
    keys = [k.decode() for k in admin.scan_iter(match="nsAB:*", count=1000)]
    assert len(keys) >= 6, keys
    user = redis.Redis.from_url(team_a.redis_url)
    try:
        for key in keys:
            for cmd in (("TYPE", key), ("DUMP", key), ("DEL", key), ("EXPIRE", key, 1)):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    user.execute_command(*cmd)
    finally:
        user.close()
    LEDGER.fault(f"user of nsA reached for {len(keys)} keys of nsAB: each refused (NOPERM)")
    assert admin.exists(*keys) == len(keys) and all(admin.ttl(k) != 1 for k in keys)
    as_a = team_a.replace(namespace="nsAB")
    with pytest.raises(ConfigError, match="refused the credentials or command"):
        results.status(burst, as_a)


def test_check_exits_2_when_the_acl_refuses_the_namespace(
    admin: redis.Redis, server: RedisServer
) -> None:
    """`prefixq check` as a user whose ACL does not cover the namespace exits 2 (a configuration
    error, as for every command), not 1 (unhealthy), with the hint."""
    admin.execute_command("ACL", "SETUSER", "elsewhere", "on", f">{PASSWORD}", "~other:*", "+@all")
    s = Settings(redis_url=user_url(server, "elsewhere"), namespace="nsA")
    probe = redis.Redis.from_url(s.redis_url)
    with pytest.raises(redis.exceptions.NoPermissionError):
        probe.hget("nsA:config", "shards")
    probe.close()
    LEDGER.fault("ACL refuses the namespace's keys")
    p = cli(s, "check", "--shards", "1")
    print(f"  prefixq check: exit {p.returncode}: {p.stderr.strip()}")
    assert p.returncode == 2
    assert "refused the credentials or command" in p.stderr and PASSWORD not in p.stderr


def test_commands_fail_in_bounded_time_on_a_redis_that_never_answers(tmp_path: Path) -> None:
    """Given a redis-server stopped with SIGSTOP (it accepts connections and never answers),
    when `check`, `inspect` and `results` run against it, then each fails with an error naming
    the timeout within a minute (before: each waited for ever, `check` included, the documented
    health check)."""
    with RedisServer() as srv:
        s = Settings(redis_url=srv.url, namespace="hung", shards=1)
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGSTOP)
        try:
            for args in (("check",), ("inspect", "--json"), ("results", "20261205T000000Z-0")):
                t0 = time.monotonic()
                p = cli(s, *args, timeout=120)
                took = time.monotonic() - t0
                assert p.returncode != 0 and "Timeout reading" in p.stdout + p.stderr, p
                assert took < 60, (args, took)
        finally:
            srv.proc.send_signal(signal.SIGCONT)
