"""`prefixq serve`'s batches after a fault, on a real Redis: a batch or a burst a dead server left
is taken over once (its lease gone), a cancel while the input file is checked queues nothing, a
result that does not decode becomes an error line, and a finalizer that takes over removes what
a killed one left half written or published. The lifecycle without faults:
test_openai_batches.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from openai import OpenAI

from openai_server import Server, completion_line, jsonl, wait_batch
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings


def _orphan_batch(settings: Settings, tmp_path: Path, lines: list[dict[str, Any]]) -> str:
    """A batch as a server that died right after creating it leaves it: record written, status
    `validating`, its lease gone (expired). Returns the batch id."""
    from prefixq.openai.batches import BatchStore
    from prefixq.openai.files import new_file_id
    from prefixq.store.connection import async_client

    async def go() -> str:
        r = async_client(settings.replace(files_dir=str(tmp_path / "files")))
        try:
            st = BatchStore(
                r, settings.replace(files_dir=str(tmp_path / "files")), settings.namespace
            )
            st.files.dir.mkdir(parents=True, exist_ok=True)
            fid = new_file_id()
            data = jsonl(lines)
            st.files.path(fid).write_bytes(data)
            await st.files.record(fid, "in.jsonl", "batch", len(data), len(lines))
            obj, _ = await st.create(
                {"input_file_id": fid, "endpoint": "/v1/completions", "completion_window": "24h"}
            )
            await r.delete(st.keys.oai_lease(obj["id"]))
            return str(obj["id"])
        finally:
            await r.aclose()

    return asyncio.run(go())


def test_a_batch_left_validating_by_a_dead_server_is_taken_over(
    settings: Settings, tmp_path: Path, r: redis.Redis, fake_worker: Callable[..., Any]
) -> None:
    """Given a batch whose server died while it was `validating`, another server's sweeper takes it
    over once the lease is gone, queues it once, and it completes."""
    batch_id = _orphan_batch(
        settings, tmp_path, [completion_line(f"o{i}", "x y") for i in range(3)]
    )
    with fake_worker(settings), Server(settings, tmp_path / "files") as srv:
        c = OpenAI(base_url=srv.url, api_key="k", max_retries=0)
        b = wait_batch(c, batch_id, {"completed", "failed"})
    assert b.status == "completed" and b.request_counts is not None
    assert b.request_counts.completed == 3
    assert r.hget(Keys(settings.namespace).burst(batch_id), "total") == b"3"


def test_a_burst_queued_by_a_dead_server_is_not_queued_twice(
    settings: Settings, tmp_path: Path, r: redis.Redis
) -> None:
    """Given a dead server that had queued the whole burst but not recorded it, the server that
    takes the batch over finds the burst complete and moves on without queueing it again."""
    from prefixq.client import Producer

    lines = [completion_line(f"d{i}", "x y") for i in range(3)]
    batch_id = _orphan_batch(settings, tmp_path, lines)
    Producer(settings).submit(lines, burst_id=batch_id)
    keys = Keys(settings.namespace)
    queued = r.xlen(keys.stream(0))
    with Server(settings, tmp_path / "files") as srv:
        c = OpenAI(base_url=srv.url, api_key="k", max_retries=0)
        b = wait_batch(c, batch_id, {"in_progress", "failed"})
        assert b.status == "in_progress" and b.request_counts is not None
        assert b.request_counts.total == 3
        assert r.xlen(keys.stream(0)) == queued == 3
        assert r.hget(keys.oai_batch(batch_id), "burst") == batch_id.encode()


def test_a_cancel_while_the_input_file_is_checked_queues_nothing(
    settings: Settings, tmp_path: Path, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a batch cancelled while its input file is being checked (a big file takes seconds),
    it ends `cancelled` and none of its requests is queued. The cancel used to be applied only
    once the whole burst was queued, and workers ran thousands of its requests meanwhile."""
    from prefixq.openai import lease, runner
    from prefixq.store.connection import async_client

    batch_id = _orphan_batch(
        settings, tmp_path, [completion_line(f"v{i}", "x y") for i in range(5)]
    )
    s = settings.replace(files_dir=str(tmp_path / "files"))
    keys = Keys(settings.namespace)
    check = runner.check_input
    cancelled: list[bool] = []

    def check_then_cancel(*args: Any) -> Any:
        out = check(*args)
        # what POST /v1/batches/{id}/cancel does meanwhile (no burst yet, so nothing to cancel)
        r.hset(keys.oai_batch(batch_id), mapping={"status": "cancelling", "cancelling_at": 1})
        cancelled.append(True)
        return out

    monkeypatch.setattr(runner, "check_input", check_then_cancel)

    async def go() -> dict[str, Any]:
        ar = async_client(s)
        try:
            sweeper = runner.Sweeper(ar, s, [s.namespace])
            store = sweeper.stores[s.namespace]
            token = await lease.acquire(ar, keys.oai_lease(batch_id))
            assert token is not None
            await sweeper.start(store, batch_id, token)
            return await store.get(batch_id)
        finally:
            await ar.aclose()

    b = asyncio.run(go())
    assert cancelled  # the cancel landed while the file was checked
    assert b["status"] == "cancelled" and b["cancelled_at"] is not None
    assert b["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert not r.exists(keys.burst(batch_id))


def test_a_result_that_does_not_decode_becomes_an_error_line(
    client: OpenAI, settings: Settings, r: redis.Redis
) -> None:
    """Given a finished burst whose second result is garbage (anything with write access to Redis
    could put it there), the batch still completes: the good result in the output file, a 500
    internal_error line for the garbage one, instead of a finalizer failing for ever."""
    from prefixq.core import wire
    from prefixq.core.records import Result

    lines = [completion_line("good", "a b"), completion_line("bad", "c d")]
    f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="1h"
    )
    assert wait_batch(client, b.id, {"in_progress"}).status == "in_progress"
    keys = Keys(settings.namespace)
    ok = Result(id="good", index=0, text="b a", finish_reason="stop", output_tokens=2)
    r.hset(keys.results(b.id), mapping={0: wire.encode(ok.to_wire()), 1: b"\x07garbage"})
    r.hset(keys.burst(b.id), mapping={"done": 1, "failed": 1})
    b = wait_batch(client, b.id, {"completed", "failed"})
    assert b.status == "completed"
    (good,) = [
        json.loads(x) for x in client.files.content(b.output_file_id or "").text.splitlines()
    ]
    (bad,) = [json.loads(x) for x in client.files.content(b.error_file_id or "").text.splitlines()]
    assert good["custom_id"] == "good" and good["response"]["body"]["choices"][0]["text"] == "b a"
    assert bad["custom_id"] == "bad" and bad["response"]["status_code"] == 500
    assert "does not decode" in bad["response"]["body"]["error"]["message"]


def test_finalizing_removes_what_a_killed_finalizer_left_half_written(
    client: OpenAI, server: Server, settings: Settings, r: redis.Redis
) -> None:
    """Given the half-written output of a finalizer killed mid-way (its temporary file), the
    finalizer that takes over removes it: nothing but the published files stays in files_dir."""
    from prefixq.core import wire
    from prefixq.core.records import Result

    f = client.files.create(
        file=("in.jsonl", jsonl([completion_line("a", "x y")])), purpose="batch"
    )
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="1h"
    )
    assert wait_batch(client, b.id, {"in_progress"}).status == "in_progress"
    folder = server.files_dir / settings.namespace
    stale = folder / f".final-{b.id}-file-{'0' * 24}"
    stale.write_text('{"custom_id": "a", "half written')
    keys = Keys(settings.namespace)
    ok = Result(id="a", index=0, text="y x", finish_reason="stop", output_tokens=2)
    r.hset(keys.results(b.id), mapping={0: wire.encode(ok.to_wire())})
    r.hset(keys.burst(b.id), mapping={"done": 1})
    b = wait_batch(client, b.id, {"completed", "failed"})
    assert b.status == "completed" and b.request_counts is not None
    assert b.request_counts.completed == 1
    assert sorted(p.name for p in folder.iterdir()) == sorted([f.id, b.output_file_id or ""])


def test_finalizing_removes_files_a_killed_finalizer_published_but_never_gave_the_batch(
    client: OpenAI, server: Server, settings: Settings, r: redis.Redis
) -> None:
    """Given a finalizer killed after it published an output file and before the batch pointed
    at it, the finalizer that takes over removes that file: the batch has one output file, and no
    second `<batch>_output.jsonl` is listed for ever."""
    from prefixq.core import wire
    from prefixq.core.records import Result
    from prefixq.openai.files import new_file_id

    f = client.files.create(
        file=("in.jsonl", jsonl([completion_line("a", "x y")])), purpose="batch"
    )
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="1h"
    )
    assert wait_batch(client, b.id, {"in_progress"}).status == "in_progress"
    keys = Keys(settings.namespace)
    orphan = new_file_id()  # what the killed finalizer had published
    (server.files_dir / settings.namespace / orphan).write_text("{}\n")
    r.hset(
        keys.oai_file(orphan),
        mapping={
            "id": orphan,
            "bytes": 3,
            "lines": 1,
            "created_at": 1,
            "filename": f"{b.id}_output.jsonl",
            "purpose": "batch_output",
        },
    )
    r.zadd(keys.oai_files, {orphan: 1})
    r.hset(keys.oai_batch(b.id), "publishing", orphan)
    assert client.files.retrieve(orphan).filename == f"{b.id}_output.jsonl"
    ok = Result(id="a", index=0, text="y x", finish_reason="stop", output_tokens=2)
    r.hset(keys.results(b.id), mapping={0: wire.encode(ok.to_wire())})
    r.hset(keys.burst(b.id), mapping={"done": 1})
    b = wait_batch(client, b.id, {"completed", "failed"})
    assert b.status == "completed" and b.output_file_id not in (None, orphan)
    outputs = [x.id for x in client.files.list(purpose="batch_output")]
    assert outputs == [b.output_file_id]
    assert not (server.files_dir / settings.namespace / orphan).exists()
