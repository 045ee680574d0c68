"""`prefixq demo` on a Redis it finds leaves none of its keys there: at the end
of a run, and when it is interrupted. The real engine (the demo's own worker process)."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis

from helpers import cli_argv, wait_until
from prefixq.cli.redis_server import RedisServer

pytestmark = pytest.mark.engine


@pytest.fixture
def found() -> Iterator[tuple[RedisServer, redis.Redis]]:
    """A Redis at the URL the demo is given (so it uses it rather than start its own), with one
    key of somebody else's that must survive."""
    with RedisServer() as srv:
        r = redis.Redis.from_url(srv.url)
        r.set("other:keep", "1")
        yield srv, r
        r.close()


def test_a_demo_run_leaves_no_keys_in_the_redis_it_found(
    found: tuple[RedisServer, redis.Redis],
) -> None:
    """A whole demo run (2 output tokens per answer) against a Redis it found deletes every key it
    wrote there when it ends; other keys stay. Its embeddings leg (a worker with --task embed)
    printed each document's cosine to the query, nearest first, from 576-dimension vectors."""
    srv, r = found
    p = subprocess.run(
        [*cli_argv(None, "demo", "--max-tokens", "2", url=srv.url)],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "answers; using it" in p.stderr and "removed the demo's" in p.stderr
    assert sorted(r.keys("*")) == [b"other:keep"]
    assert "(576 dimensions)" in p.stdout, p.stdout[-3000:]
    cosines = [float(x) for x in re.findall(r"cosine (-?[0-9.]+)", p.stdout)]
    assert len(cosines) == 4 and cosines == sorted(cosines, reverse=True), p.stdout[-3000:]
    assert all(-1.0 <= x <= 1.0 for x in cosines)


def test_an_interrupted_demo_leaves_no_keys_in_the_redis_it_found(
    found: tuple[RedisServer, redis.Redis],
) -> None:
    """Ctrl-C (SIGINT to the demo) once its worker has written its first keys: the demo stops
    the worker, deletes every key of its namespace, and exits 130. Its answers take up to 48
    tokens (the demo's default), so that the run is still going when the signal comes (with 2
    it was seen to end within the half second after its first keys, under load)."""
    srv, r = found
    p = subprocess.Popen(
        cli_argv(None, "demo", "--max-tokens", "48", url=srv.url),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # as from a terminal: a suite started in the background by a shell inherits SIGINT
        # ignored, and Python then never raises KeyboardInterrupt for it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        wait_until(lambda: r.dbsize() > 1 or p.poll() is not None, 600, "the demo's first keys")
        written = sorted(k.decode() for k in r.keys("*") if k != b"other:keep")
        assert written and all("-demo-" in k.split(":")[0] for k in written), written
        time.sleep(0.5)
        assert p.poll() is None, f"the demo ended (exit {p.returncode}) before it was interrupted"
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    print(f"  the demo had written {written}")
    assert p.returncode == 130, err[-3000:]
    assert sorted(r.keys("*")) == [b"other:keep"]
