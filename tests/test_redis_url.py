"""A REDIS_URL that cannot work is a ConfigError when the client is made, not a failure at the
first command (docs/delivery.md, "Untrusted peers"): an unknown option, an ``ssl_*`` option on a
``redis://`` URL, a certificate file that does not exist. The CLI exits 2 (configuration)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from helpers import cli
from prefixq.cli.redis_server import RedisServer, free_port
from prefixq.client import Producer, results
from prefixq.core.errors import ConfigError
from prefixq.core.settings import Settings
from prefixq.store.connection import async_client, sync_client
from prefixq.store.redis_url import redact

HOST = "127.0.0.1"


def bad_urls(tmp: Path) -> list[tuple[str, str]]:
    """(url, what the ConfigError says) for each way a URL can be wrong. Nothing listens on the
    port: an error about the URL must come before any attempt to connect."""
    port = free_port()
    missing = tmp / "no-such-ca.crt"
    return [
        (
            f"redis://{HOST}:{port}/0?sokcet_timeout=5",
            "REDIS_URL option 'sokcet_timeout' is unknown",
        ),
        (
            f"redis://{HOST}:{port}/0?ssl_ca_certs={missing}",
            "REDIS_URL option 'ssl_ca_certs' needs a rediss:// (TLS) URL",
        ),
        (
            f"rediss://{HOST}:{port}/0?ssl_ca_certs={missing}",
            f"REDIS_URL option ssl_ca_certs='{missing}': no such file",
        ),
        (
            f"rediss://{HOST}:{port}/0?ssl_certfile={missing}&ssl_keyfile={missing}",
            f"REDIS_URL option ssl_certfile='{missing}': no such file",
        ),
        (f"redis://{HOST}:{port}/prod", "REDIS_URL database 'prod' is not a number"),
    ]


@pytest.mark.parametrize(
    "case", range(5), ids=["unknown", "ssl-on-redis", "no-ca", "no-cert", "db-not-a-number"]
)
def test_a_bad_redis_url_is_a_config_error_when_the_client_is_made(
    case: int, tmp_path: Path
) -> None:
    """Making a client (blocking or asyncio) or submitting through a producer raises
    ConfigError at once, naming the option; `prefixq check` exits 2 with the same words."""
    url, says = bad_urls(tmp_path)[case]
    s = Settings(redis_url=url, namespace="badurl", shards=1)
    makers: list[Callable[[], object]] = [
        lambda: sync_client(s),
        lambda: async_client(s),
        lambda: Producer(s).submit([{"id": "a", "prompt": "hi"}]),
    ]
    for make in makers:
        t0 = time.monotonic()
        with pytest.raises(ConfigError) as err:
            make()
        assert says in str(err.value)
        assert time.monotonic() - t0 < 3.0, "refused at once, not after ~7 s of retries"
    p = cli(s, "check", timeout=60)
    assert p.returncode == 2, p.stderr
    assert says in p.stderr
    assert "cannot reach" not in p.stderr


def test_a_unix_socket_url_works_for_the_cli_and_the_producer(tmp_path: Path) -> None:
    """`unix:///path/redis.sock` (a scheme redis-py takes and our error names) made every client
    fail with a TypeError traceback: the unix connection takes no ``socket_keepalive``."""
    sock = tmp_path / "redis.sock"
    with RedisServer(extra_args=["--unixsocket", str(sock)]) as srv:
        s = Settings(redis_url=f"unix://{sock}?db=0", namespace="unix", shards=1)
        client = sync_client(s)
        assert client.ping()
        client.close()
        burst = Producer(s).submit([{"id": "a", "prompt": "hi"}])
        p = cli(s, "inspect", "--json", "--burst", burst)
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["bursts"][0]["total"] == 1
        assert srv.proc is not None and srv.proc.poll() is None


def test_a_database_the_server_does_not_have_is_a_config_error(
    make_settings: Callable[..., Settings],
) -> None:
    """`redis://host:port/99` on a server with 16 databases: the producer raises ConfigError and
    the CLI exits 2 naming the database, not 1 as if Redis had failed."""
    base = make_settings()
    s = base.replace(redis_url=base.redis_url.rsplit("/", 1)[0] + "/99")
    with pytest.raises(ConfigError, match="has no such database"):
        Producer(s).submit([{"id": "a", "prompt": "hi"}])
    for args in (("inspect",), ("results", "nope"), ("check",)):
        p = cli(s, *args, timeout=60)
        assert p.returncode == 2 and "has no such database" in p.stderr, (args, p.stderr)
        assert "maxmemory-policy" not in p.stderr, p.stderr  # not a refused CONFIG GET


def test_several_seeds_of_a_redis_that_is_not_a_cluster_are_a_config_error(
    settings: Settings,
) -> None:
    """`redis://h:p,h:p/0` on a plain redis-server: the CLI exits 2 saying the Redis there is
    not a cluster (before: redis-py's 'Port could not be cast to integer value as ...')."""
    host = settings.redis_url.split("//", 1)[1].rsplit("/", 1)[0]
    s = settings.replace(redis_url=f"redis://{host},{host}/0")
    p = cli(s, "check", timeout=60)
    assert p.returncode == 2 and "names 2 seeds, but the Redis there is not a" in p.stderr, p


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:secret@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://user:secret@h/0", "redis://user:***@h/0"),
        (
            "rediss://h/0?ssl_keyfile=/k.pem&ssl_password=secret&db=1",
            "rediss://h/0?ssl_keyfile=/k.pem&ssl_password=***&db=1",
        ),
        ("rediss://u:pw@h/0?ssl_password=secret", "rediss://u:***@h/0?ssl_password=***"),
        ("redis://h:6379/0", "redis://h:6379/0"),
    ],
)
def test_a_url_is_shown_without_its_secrets(url: str, shown: str) -> None:
    """The key file's ``ssl_password=`` was shown as is wherever a URL is printed: `run_burst`'s
    summary (kept in RQ's result storage), errors, logs."""
    assert redact(url) == shown


def test_a_database_redis_does_not_have_is_a_config_error(settings: Settings) -> None:
    """redis://host:port/99 on a Redis of 16 databases: the producer raised redis-py's raw
    ResponseError ("DB index is out of range"); it is a ConfigError that says so, as for the
    result readers."""
    s = settings.replace(redis_url=settings.redis_url.rsplit("/", 1)[0] + "/99")
    with pytest.raises(ConfigError, match="Redis has no such database"):
        Producer(s).submit([{"id": "a", "prompt": "hi"}])
    with pytest.raises(ConfigError, match="Redis has no such database"):
        results.status("b", s)
