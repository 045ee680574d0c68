"""Two `prefixq serve` processes on one Redis and one files directory behave as one (several
replicas behind one Service: docs/operations.md, "Several serve replicas"), driven by the
official `openai` client with a FakeEngine worker; the same on the real engine:
test_openai_engine.py. What a dead server leaves: test_openai_recovery.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from openai import OpenAI

from helpers import cli
from openai_server import Server, completion_line, jsonl, wait_batch
from prefixq.cli.redis_server import free_port
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings

FINAL = {"completed", "failed", "expired", "cancelled"}


def clients(*servers: Server) -> list[OpenAI]:
    return [OpenAI(base_url=s.url, api_key="k", max_retries=0) for s in servers]


def served(seen: list[str]) -> list[str]:
    """The requests an engine was handed, as burst:index (its request ids are
    ``<burst>:<index>:<stream entry>``; the worker's own warm-up request left out)."""
    return [x.rsplit(":", 1)[0] for x in seen if not x.startswith("warmup-")]


def test_a_file_uploaded_through_one_server_runs_once_through_the_other(
    settings: Settings, tmp_path: Path, r: redis.Redis, fake_worker: Callable[..., Any]
) -> None:
    """Given servers A and B: a file uploaded through A is listed, described and read alike
    through B; a batch created through B from it and retrieved through A completes with one burst
    and each request served once; its output reads the same through both, and both list the same
    files."""
    keys = Keys(settings.namespace)
    lines = [completion_line(f"q{i}", f"a b c {i}") for i in range(5)]
    files = tmp_path / "files"
    with Server(settings, files) as a, Server(settings, files) as b:
        ca, cb = clients(a, b)
        f = ca.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        assert cb.files.retrieve(f.id) == f
        assert cb.files.content(f.id).content == jsonl(lines)
        assert [x.id for x in cb.files.list()] == [f.id]

        bursts = r.zcard(keys.bursts)
        fw = fake_worker(settings)
        batch = cb.batches.create(
            input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
        )
        assert ca.batches.retrieve(batch.id).id == batch.id
        done = wait_batch(ca, batch.id, FINAL)
        assert done.status == "completed", a.tail() + b.tail()
        assert done.request_counts is not None and done.request_counts.completed == 5
        assert cb.batches.retrieve(batch.id) == done
        # run exactly once: one burst, each request handed to the engine once
        assert r.zcard(keys.bursts) == bursts + 1
        assert sorted(served(fw.engine.seen)) == [f"{done.id}:{i}" for i in range(5)]

        out = ca.files.content(done.output_file_id or "").content
        assert cb.files.content(done.output_file_id or "").content == out
        assert [json.loads(x)["custom_id"] for x in out.splitlines()] == [f"q{i}" for i in range(5)]
        listed_a = [x.model_dump() for x in ca.files.list()]
        assert listed_a == [x.model_dump() for x in cb.files.list()]
        assert {x["id"] for x in listed_a} == {f.id, done.output_file_id}
        assert ca.batches.list().data == cb.batches.list().data


def test_a_batch_created_through_one_server_is_cancelled_through_the_other(
    settings: Settings, tmp_path: Path, fake_worker: Callable[..., Any]
) -> None:
    """Given a batch of slow requests created through B and running, a cancel through A ends it
    `cancelled` as both see it; its error file (every request batch_cancelled) reads the same
    through both, and no request reached the engine twice."""
    slow = [completion_line(f"s{i}", "sleep:8 a b") for i in range(6)]
    files = tmp_path / "files"
    with Server(settings, files) as a, Server(settings, files) as b, fake_worker(settings) as fw:
        ca, cb = clients(a, b)
        f = cb.files.create(file=("slow.jsonl", jsonl(slow)), purpose="batch")
        batch = cb.batches.create(
            input_file_id=f.id, endpoint="/v1/completions", completion_window="1h"
        )
        wait_batch(ca, batch.id, {"in_progress"})
        cancelling = ca.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        done = wait_batch(cb, batch.id, FINAL, timeout=20)
        assert done.status == "cancelled", a.tail() + b.tail()
        assert ca.batches.retrieve(batch.id).status == "cancelled"
        err = ca.files.content(done.error_file_id or "").content
        assert cb.files.content(done.error_file_id or "").content == err
        codes = [json.loads(x)["error"]["code"] for x in err.splitlines()]
        assert codes == ["batch_cancelled"] * 6
        got = served(fw.engine.seen)
        assert got and len(got) == len(set(got))


def test_a_server_whose_files_directory_is_not_the_shared_one_refuses_to_start(
    settings: Settings, tmp_path: Path, r: redis.Redis
) -> None:
    """Given server A on directory X: a server given another directory Y exits 2 saying so (it
    would answer 404 for A's files) and A serves on; another server on X starts; once the
    operator deletes the key the message names (X lost for good), a server on Y starts."""
    shared, own = tmp_path / "shared", tmp_path / "own"
    with Server(settings, shared) as a:
        (ca,) = clients(a)
        f = ca.files.create(
            file=("in.jsonl", jsonl([completion_line("x", "a b")])), purpose="batch"
        )
        p = cli(settings, "serve", "--port", str(free_port()), "--files-dir", str(own))
        assert p.returncode == 2, p.stderr
        key = Keys(settings.namespace).oai_files_volume
        assert f"files_dir {str(own)!r} is not the files directory the other servers" in p.stderr
        assert key in p.stderr
        assert ca.files.retrieve(f.id).id == f.id
        with Server(settings, shared) as b:
            assert clients(b)[0].files.content(f.id).content == ca.files.content(f.id).content
    r.delete(key)
    with Server(settings, own) as c:
        assert [x.id for x in clients(c)[0].files.list()] == [f.id]  # its object, not its bytes
