"""`prefixq demo`: the whole pipeline on one machine with the embedded model.

Redis from REDIS_URL if it answers, else a private redis-server; the embedded SmolLM2-135M-Instruct
prepared once; one CPU worker process; a burst of chat questions about a few documents (Python's
own reference pages, bundled with Python) plus one general question; answers and the per-stage
latency summary printed at the end.

On a Redis it found, the demo works in a namespace of its own (``<namespace>-demo-<random>``) and
deletes every key of that namespace when it ends, also on Ctrl-C, SIGTERM or an error, once its
worker has stopped: it leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import redis
from rich.console import Console

from prefixq.cli.redis_server import RedisServer
from prefixq.cli.worker_signals import start_worker
from prefixq.client import results
from prefixq.core.errors import SetupError
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.store.connection import sync_client
from prefixq.store.redis_errors import error_text
from prefixq.store.redis_url import redact
from prefixq.worker.command import worker_command

DOCUMENTS = ("while", "assert", "return", "global")
QUESTIONS = (
    "In one sentence, what does this document describe?",
    "Which Python keyword is this document about? Answer with the keyword only.",
    "Give a one-line example of the statement described in the document.",
)
GENERAL = "What is the capital of France?"


def demo_requests(max_tokens: int) -> list[dict[str, Any]]:
    """The demo burst: each document with each question, then a general question."""
    from pydoc_data.topics import topics

    reqs: list[dict[str, Any]] = []
    for doc in DOCUMENTS:
        system = "Answer briefly, using this document.\n\n" + topics[doc]
        for n, q in enumerate(QUESTIONS):
            reqs.append(
                {
                    "id": f"{doc}-{n}",
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": q},
                    ],
                }
            )
    reqs.append(
        {
            "id": "capital",
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "messages": [{"role": "user", "content": GENERAL}],
        }
    )
    return reqs


def _redis_answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except (redis.RedisError, OSError, ValueError):
        return False


def _wait_engine_up(
    r: redis.Redis, keys: Keys, proc: subprocess.Popen[bytes], log: Path, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise SetupError(f"the worker exited ({proc.returncode}) before serving:\n{tail}")
        for name in r.zrange(keys.workers(0), 0, -1):
            if r.hget(keys.heartbeat(0, name.decode()), "engine_up") == b"1":
                return
        time.sleep(1.0)
    raise SetupError(f"the worker did not come up within {timeout:.0f}s; see {log}")


def run_demo(
    settings: Settings,
    *,
    model: str = "",
    engine_args: list[str] | None = None,
    max_tokens: int = 48,
) -> int:
    """Run the demo; returns the exit code."""
    from prefixq.cli.progress import BurstProgress, render_snapshot
    from prefixq.client import Producer
    from prefixq.engine.embedded_model import default_cache_dir, resolve_model
    from prefixq.ops.stats import snapshot

    con = Console(stderr=True)
    srv: RedisServer | None = None
    with contextlib.ExitStack() as stack:
        if _redis_answers(settings.redis_url):
            con.print(f"[green]redis[/] {redact(settings.redis_url)} answers; using it")
        else:
            srv = stack.enter_context(RedisServer())
            con.print(
                f"[yellow]redis[/] nothing at {redact(settings.redis_url)}; started a "
                f"private redis-server on port {srv.port}"
            )
            settings = settings.replace(redis_url=srv.url)
        settings = settings.replace(
            namespace=f"{settings.namespace}-demo-{secrets.token_hex(3)}", shards=1
        )
        if srv is None:  # registered before the worker starts, so it runs after the worker stopped
            stack.callback(_forget, settings, con)
        stack.enter_context(_interrupts())  # before the worker starts: see `_start_worker`
        con.print("[bold]model[/] preparing the embedded SmolLM2-135M-Instruct (once)...")
        path = resolve_model(model, default_cache_dir(settings.cache_dir))
        con.print(f"[bold]model[/] {path}")

        log = Path(tempfile.mkdtemp(prefix="prefixq-demo-")) / "worker.log"
        cmd = worker_command(settings, 0, path, engine_args=engine_args or ())
        out = stack.enter_context(open(log, "wb"))
        proc = _start_worker(cmd, out)
        stack.callback(_stop, proc)
        con.print(
            f"[bold]worker[/] pid {proc.pid} starting its vLLM engine (about 1-2 min on "
            f"2 CPU cores); log: {log}"
        )
        r = stack.enter_context(sync_client(settings))
        t0 = time.monotonic()
        _wait_engine_up(r, settings.keys, proc, log, timeout=900)
        con.print(f"[bold]worker[/] serving after {time.monotonic() - t0:.0f}s")

        reqs = demo_requests(max_tokens)
        burst = Producer(settings).submit(reqs)
        con.print(f"[bold]burst[/] {burst}: {len(reqs)} chat requests")
        with BurstProgress(burst) as bar:
            results.wait(burst, settings, timeout=1800, progress=bar.update)
        answers = results.collect(burst, settings)
        c = Console(width=None if Console().is_terminal else 120)
        for req, res in zip(reqs, answers, strict=True):
            question = req["messages"][-1]["content"]
            doc = req["id"].rsplit("-", 1)[0] if req["id"] != "capital" else "-"
            text = (
                res.text.strip().replace("\n", " ") if res.error is None else f"ERROR {res.error}"
            )
            c.print(f"[cyan]{doc:>8}[/] {question}\n         [green]->[/] {text}")
        render_snapshot(snapshot(settings, burst=burst, client=r), c)
        failed = sum(1 for a in answers if a.error)
    return 1 if failed else 0


def forget_namespace(r: redis.Redis, namespace: str) -> int:
    """Delete every key of ``namespace`` (the pattern ``<namespace>:*`` matches no other
    namespace's key: core/settings.py); returns how many."""
    n, batch = 0, []
    for key in r.scan_iter(match=f"{namespace}:*", count=1000):
        batch.append(key)
        if len(batch) >= 500:
            n += r.unlink(*batch)
            batch.clear()
    return n + (r.unlink(*batch) if batch else 0)


def _forget(settings: Settings, con: Console) -> None:
    r = sync_client(settings)
    try:
        n = forget_namespace(r, settings.namespace)
        con.print(f"[dim]removed the demo's {n} keys (namespace {settings.namespace})[/]")
    except (redis.RedisError, OSError) as e:
        con.print(
            f"[red]could not remove the demo's keys[/] ({error_text(e)}): remove them with "
            f"redis-cli --scan --pattern '{settings.namespace}:*' | xargs redis-cli unlink"
        )
    finally:
        r.close()


@contextlib.contextmanager
def _interrupts() -> Iterator[None]:
    """While inside, SIGTERM and SIGINT raise KeyboardInterrupt (Ctrl-C's), so the demo stops its
    worker and removes its keys, also when it was started with SIGINT ignored (a background job
    of a non-interactive shell: ``./dev demo &``). Main thread only; elsewhere a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    before = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _start_worker(cmd: list[str], out: IO[bytes]) -> subprocess.Popen[bytes]:
    """Start the demo's worker, its output to ``out``. Inside `_interrupts` the demo handles
    SIGINT itself, so the worker starts with SIGINT's default action (exec resets a handled
    signal), not an ignored SIGINT inherited from the demo's shell."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return start_worker(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
