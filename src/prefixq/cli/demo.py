"""`prefixq demo`: the whole pipeline on one machine with the embedded model.

Redis from REDIS_URL if it answers, else a private redis-server; the embedded SmolLM2-135M-Instruct
prepared once; two CPU worker processes, one generating (shard 0) and one embedding (shard 1,
`--task embed`: the same model through vLLM's pooling runner); a burst of chat questions about a
few documents (Python's own reference pages, bundled with Python) plus one general question, and a
burst of embeddings of those documents and of a search query; answers, the document nearest the
query and the per-stage latency summary printed at the end.

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
#: the embeddings burst's search query: the document nearest it is printed
QUERY = "How do I repeat a block of code while a condition holds?"


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


def embed_requests() -> list[dict[str, Any]]:
    """The demo's embeddings burst: the query, then each document's first 2,000 characters."""
    from pydoc_data.topics import topics

    docs = [{"id": doc, "input": topics[doc][:2000]} for doc in DOCUMENTS]
    return [{"id": "query", "input": QUERY}, *docs]


def nearest(vectors: dict[str, list[float]]) -> list[tuple[str, float]]:
    """Each document's cosine similarity to the query (vectors are normalized), nearest first."""
    q = vectors["query"]
    sims = [(k, sum(a * b for a, b in zip(q, v, strict=True))) for k, v in vectors.items()]
    return sorted(((k, s) for k, s in sims if k != "query"), key=lambda x: -x[1])


def _redis_answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except (redis.RedisError, OSError, ValueError):
        return False


def _wait_engine_up(
    r: redis.Redis, keys: Keys, procs: list[subprocess.Popen[bytes]], log: Path, timeout: float
) -> None:
    """Until the worker of each shard (``procs[k]`` serves shard k) has its engine up."""
    deadline = time.monotonic() + timeout
    waiting = set(range(len(procs)))
    while time.monotonic() < deadline:
        for k in sorted(waiting):
            proc = procs[k]
            if proc.poll() is not None:
                tail = (log.parent / f"worker-{k}.log").read_text(errors="replace")[-3000:]
                raise SetupError(f"worker {k} exited ({proc.returncode}) before serving:\n{tail}")
            for name in r.zrange(keys.workers(k), 0, -1):
                if r.hget(keys.heartbeat(k, name.decode()), "engine_up") == b"1":
                    waiting.discard(k)
        if not waiting:
            return
        time.sleep(1.0)
    raise SetupError(f"the workers did not come up within {timeout:.0f}s; see {log.parent}")


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
        # first: a stop during the redis-server start (or at any later moment) unwinds the demo
        stack.enter_context(_interrupts())
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
            namespace=f"{settings.namespace}-demo-{secrets.token_hex(3)}", shards=2
        )
        if srv is None:  # registered before the worker starts, so it runs after the worker stopped
            stack.callback(_forget, settings, con)
        con.print("[bold]model[/] preparing the embedded SmolLM2-135M-Instruct (once)...")
        path = resolve_model(model, default_cache_dir(settings.cache_dir))
        con.print(f"[bold]model[/] {path}")

        logs = Path(tempfile.mkdtemp(prefix="prefixq-demo-"))
        procs = []
        for k, task in enumerate(("generate", "embed")):
            cmd = worker_command(
                settings.replace(task=task),
                k,
                path,
                engine_args=engine_args or (),
                fields=("redis_url", "namespace", "shards", "task"),
            )
            out = stack.enter_context(open(logs / f"worker-{k}.log", "wb"))
            procs.append(_start_worker(cmd, out))
            stack.callback(_stop, procs[-1])
        con.print(
            f"[bold]workers[/] pids {procs[0].pid} (generate) and {procs[1].pid} (embed) starting "
            f"their vLLM engines (about 1-3 min on 2 CPU cores); logs: {logs}"
        )
        r = stack.enter_context(sync_client(settings))
        t0 = time.monotonic()
        _wait_engine_up(r, settings.keys, procs, logs / "worker-0.log", timeout=900)
        con.print(f"[bold]workers[/] serving after {time.monotonic() - t0:.0f}s")

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
        failed = sum(1 for a in answers if a.error)
        failed += _embeddings(settings, c)
        render_snapshot(snapshot(settings, burst=burst, client=r), c)
    return 1 if failed else 0


def _embeddings(settings: Settings, c: Console) -> int:
    """The embeddings burst on the embed shard: the documents nearest the query, printed; the
    number of requests that failed."""
    from prefixq.client import Producer
    from prefixq.core.embeddings import unpack_vector

    reqs = embed_requests()
    burst = Producer(settings).submit(reqs)
    c.print(f"[bold]burst[/] {burst}: {len(reqs)} embeddings requests (shard 1, --task embed)")
    results.wait(burst, settings, timeout=900)
    got = results.collect(burst, settings)
    bad = [x for x in got if x.error or not x.embeddings]
    for x in bad:
        c.print(f"[red]embedding {x.id} failed[/]: {x.error}")
    if bad:
        return len(bad)
    vectors = {x.id: unpack_vector(x.embeddings[0]) for x in got if x.embeddings}
    c.print(f"[cyan]   query[/] {QUERY!r} ({len(vectors['query'])} dimensions)")
    for doc, sim in nearest(vectors):
        c.print(f"         [green]->[/] {doc:<8} cosine {sim:.3f}")
    return 0


def forget_namespace(r: redis.Redis, namespace: str) -> int:
    """Delete every key of ``namespace`` (the pattern ``<namespace>:*`` matches no other
    namespace's key: core/settings_checks.py); returns how many."""
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
