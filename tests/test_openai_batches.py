"""`prefixq serve`'s Batch API as a process, driven by the official `openai` client, on a real
Redis: batch parameters, input-file validation, list pagination, and — with a FakeEngine worker —
the batch lifecycle across restarts and two servers, its completion window and cancel. What a
dead server or a killed finalizer leaves: test_openai_recovery.py; the real engine's end to end
runs: test_openai_engine.py."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from openai import OpenAI
from openai.types import FileObject

from helpers import cli, wait_until
from openai_server import Server, chat_line, completion_line, jsonl, wait_batch
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"endpoint": "/v1/moderations"}, "endpoint"),
        ({"completion_window": "1 day"}, "completion_window"),
        ({"completion_window": "0h"}, "completion_window"),
        ({"completion_window": "9" * 5000 + "s"}, "completion_window"),  # was a plain-text 500
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"input_file_id": "file-missing"}, "input_file_id"),
    ],
)
def test_bad_batch_parameters_are_400s_naming_the_param(
    client: OpenAI, change: dict[str, Any], param: str
) -> None:
    f = client.files.create(file=("a.jsonl", jsonl([chat_line("a", "hi")])), purpose="batch")
    args: dict[str, Any] = {
        "input_file_id": f.id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    } | change
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(**args)
    assert e.value.body["param"] == param  # type: ignore[index]
    assert client.batches.list().data == []


def test_malformed_input_file_fails_the_batch_with_line_errors(client: OpenAI) -> None:
    """Given a file with a bad line 2 and a duplicate id on line 3, the batch ends `failed` with
    one error per bad line (code, line, param) and runs nothing."""
    lines = [
        json.dumps(chat_line("a", "hi")),
        "not json",
        json.dumps(chat_line("a", "again")),
        json.dumps(completion_line("c", "x")),
    ]
    f = client.files.create(file=("bad.jsonl", "\n".join(lines).encode()), purpose="batch")
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert b.status == "validating" and b.request_counts is not None
    b = wait_batch(client, b.id, {"failed"})
    assert b.status == "failed" and b.failed_at is not None and b.in_progress_at is None
    assert b.errors is not None and b.errors.data is not None
    got = [(e.line, e.code, e.param) for e in b.errors.data]
    assert got == [
        (2, "invalid_json_line", None),
        (3, "duplicate_custom_id", "custom_id"),
        (4, "url_mismatch", "url"),
    ]
    assert b.output_file_id is None and b.error_file_id is None


def test_batches_list_pages_newest_first_with_cursors(client: OpenAI) -> None:
    """Five batches, pages of two: first_id/last_id/has_more as OpenAI pages, and the client's
    auto-pagination walks all five newest first."""
    f = client.files.create(file=("e.jsonl", b"\n"), purpose="batch")
    ids = []
    for _ in range(5):
        b = client.batches.create(
            input_file_id=f.id, endpoint="/v1/completions", completion_window="1h"
        )
        ids.append(b.id)
        time.sleep(0.002)
    newest = ids[::-1]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == newest[:2] and first.has_more is True
    raw = httpx.get(f"{client.base_url}batches", params={"limit": 2, "after": newest[1]}).json()
    assert raw["object"] == "list" and raw["first_id"] == newest[2]
    assert raw["last_id"] == newest[3] and raw["has_more"] is True
    last = client.batches.list(limit=2, after=newest[3])
    assert [b.id for b in last.data] == newest[4:] and last.has_more is False
    assert [b.id for b in client.batches.list(limit=2)] == newest  # follows the cursors
    with pytest.raises(openai.BadRequestError):
        client.batches.list(limit=101)
    with pytest.raises(openai.BadRequestError):
        client.batches.list(after="batch_unknown")


# ---- the lifecycle with a FakeEngine worker ------------------------------------------------------
def test_batch_survives_a_server_restart_and_finalizes_without_polling(
    settings: Settings, tmp_path: Path, r: redis.Redis, fake_worker: Callable[..., Any]
) -> None:
    """Given a batch created while no worker runs, when the server is killed (SIGKILL) and started
    again and a worker appears, the batch completes and its files are written although no client
    asks for it in the meantime; output and error lines follow the input order."""
    lines = [completion_line(f"r{i}", f"one two three {i}") for i in range(6)]
    lines[3] = completion_line("r3", "fail: on purpose")
    with Server(settings, tmp_path / "files") as srv:
        c = OpenAI(base_url=srv.url, api_key="k", max_retries=0)
        f = c.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        b = c.batches.create(
            input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
        )
        b = wait_batch(c, b.id, {"in_progress"})
        assert b.status == "in_progress" and b.request_counts.total == 6  # type: ignore[union-attr]
        srv.restart()
        assert c.batches.retrieve(b.id).status == "in_progress"
        with fake_worker(settings):
            key = Keys(settings.namespace).oai_batch(b.id)
            deadline = time.monotonic() + 60
            while r.hget(key, "status") != b"completed" and time.monotonic() < deadline:
                time.sleep(0.2)  # Redis only: no client polls the server
            done = c.batches.retrieve(b.id)
    assert done.status == "completed", srv.tail()
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (6, 5)
    assert done.request_counts.failed == 1
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    assert done.usage is not None and done.usage.output_tokens > 0
    with Server(settings, tmp_path / "files") as srv:
        c = OpenAI(base_url=srv.url, api_key="k", max_retries=0)
        out = [json.loads(x) for x in c.files.content(done.output_file_id or "").text.splitlines()]
        err = [json.loads(x) for x in c.files.content(done.error_file_id or "").text.splitlines()]
        assert [x["custom_id"] for x in out] == ["r0", "r1", "r2", "r4", "r5"]
        assert out[0]["response"]["body"]["choices"][0]["text"] == "0 three two one"
        assert [x["custom_id"] for x in err] == ["r3"]
        assert err[0]["response"]["status_code"] == 500 and err[0]["error"] is None
        names = {x.filename for x in c.files.list(purpose="batch_output")}
        assert names == {f"{b.id}_output.jsonl", f"{b.id}_error.jsonl"}


def test_two_servers_finalize_each_batch_once(
    settings: Settings, tmp_path: Path, fake_worker: Callable[..., Any]
) -> None:
    """Given two servers on one Redis and one files directory, every batch gets exactly one output
    file: each step runs under a lease."""
    files = tmp_path / "files"
    with Server(settings, files) as one, Server(settings, files) as two:
        with fake_worker(settings):
            c1 = OpenAI(base_url=one.url, api_key="k", max_retries=0)
            c2 = OpenAI(base_url=two.url, api_key="k", max_retries=0)
            ids = []
            for i in range(6):
                c = (c1, c2)[i % 2]
                f = c.files.create(
                    file=(
                        "in.jsonl",
                        jsonl([completion_line(f"q{j}", f"a b {i} {j}") for j in range(3)]),
                    ),
                    purpose="batch",
                )
                ids.append(
                    c.batches.create(
                        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
                    ).id
                )
            done = [wait_batch((c2, c1)[i % 2], b, {"completed"}) for i, b in enumerate(ids)]
        assert [b.status for b in done] == ["completed"] * 6
        outputs = list(c1.files.list(purpose="batch_output"))
        assert sorted(f.id for f in outputs) == sorted(b.output_file_id or "" for b in done)
        assert len({f.filename for f in outputs}) == 6
        on_disk = [p.name for p in (files / settings.namespace).iterdir()]
        assert len(on_disk) == 12 and not [n for n in on_disk if n.startswith(".")]


def test_short_completion_window_expires_what_had_no_result(
    settings: Settings, tmp_path: Path, fake_worker: Callable[..., Any]
) -> None:
    """Given a 3 s window, two quick requests and ten that take 8 s each (eight of them in the
    engine, two queued), the batch ends `expired` at the deadline, without waiting for the slow
    ones: the quick ones are in the output file, the ten have batch_expired lines, in order."""
    quick = [completion_line(f"q{i}", "a b c") for i in range(2)]
    slow = [completion_line(f"s{i}", "sleep:8 a b") for i in range(10)]
    with Server(settings, tmp_path / "files") as srv, fake_worker(settings):
        c = OpenAI(base_url=srv.url, api_key="k", max_retries=0)
        f = c.files.create(file=("in.jsonl", jsonl(quick + slow)), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="3s")
        assert b.expires_at == b.created_at + 3
        b = wait_batch(c, b.id, {"expired", "completed", "failed", "cancelled"}, timeout=15)
        assert b.status == "expired" and b.expired_at is not None, srv.tail()
        assert b.expired_at - b.created_at < 10
        assert b.request_counts is not None
        assert (b.request_counts.completed, b.request_counts.failed) == (2, 10)
        out = [json.loads(x) for x in c.files.content(b.output_file_id or "").text.splitlines()]
        err = [json.loads(x) for x in c.files.content(b.error_file_id or "").text.splitlines()]
    assert [x["custom_id"] for x in out] == ["q0", "q1"]
    assert [x["custom_id"] for x in err] == [f"s{i}" for i in range(10)]
    assert all(x["error"]["code"] == "batch_expired" and x["response"] is None for x in err)


def test_cancel_mid_way_keeps_finished_lines_and_cancels_the_rest(
    settings: Settings, tmp_path: Path, fake_worker: Callable[..., Any]
) -> None:
    """Given two quick requests and ten slow ones, a cancel once the quick ones are done ends
    `cancelled` without waiting for the slow ones: output has the quick ones, every other request
    a batch_cancelled line; a second cancel returns the batch unchanged."""
    quick = [completion_line(f"q{i}", "a b c") for i in range(2)]
    slow = [completion_line(f"s{i}", "sleep:8 a b") for i in range(10)]
    with Server(settings, tmp_path / "files") as srv, fake_worker(settings):
        c = OpenAI(base_url=srv.url, api_key="k", max_retries=0)
        f = c.files.create(file=("in.jsonl", jsonl(quick + slow)), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="1h")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            counts = c.batches.retrieve(b.id).request_counts
            if counts is not None and counts.completed >= 2:
                break
            time.sleep(0.1)
        cancelling = c.batches.cancel(b.id)
        assert cancelling.status in ("cancelling", "cancelled")
        assert cancelling.cancelling_at is not None
        b = wait_batch(c, b.id, {"cancelled", "completed", "failed", "expired"}, timeout=15)
        assert b.status == "cancelled" and b.cancelled_at is not None, srv.tail()
        assert c.batches.cancel(b.id).status == "cancelled"
        out = [json.loads(x) for x in c.files.content(b.output_file_id or "").text.splitlines()]
        err = [json.loads(x) for x in c.files.content(b.error_file_id or "").text.splitlines()]
    assert [x["custom_id"] for x in out] == ["q0", "q1"]
    assert [x["custom_id"] for x in err] == [f"s{i}" for i in range(10)]
    assert all(x["error"]["code"] == "batch_cancelled" and x["response"] is None for x in err)


@pytest.mark.parametrize("how", ["cli", "dashboard"])
def test_a_batch_whose_burst_is_cancelled_outside_the_batch_api_ends_cancelled(
    settings: Settings, tmp_path: Path, fake_worker: Callable[..., Any], how: str
) -> None:
    """Given a batch of slow requests, when its burst is cancelled as a burst (`prefixq cancel`,
    the dashboard's cancel), then the batch ends `cancelled` with cancelled_at (and
    cancelling_at) set, every request a batch_cancelled line, as a cancel through the Batch API
    ends (before: `completed`, 0 of 12 completed, with a batch.completed webhook)."""
    slow = [completion_line(f"s{i}", "sleep:8 a b") for i in range(12)]
    with Server(settings, tmp_path / "files") as srv, fake_worker(settings):
        c = OpenAI(base_url=srv.url, api_key="k", max_retries=0)
        f = c.files.create(file=("in.jsonl", jsonl(slow)), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="1h")
        b = wait_batch(c, b.id, {"in_progress"}, timeout=15)
        if how == "cli":
            p = cli(settings, "cancel", b.id)
            assert p.returncode == 0, p.stderr
        else:
            resp = httpx.post(
                f"{srv.root}api/bursts/{b.id}/cancel", headers={"X-Prefixq-Action": "1"}, timeout=30
            )
            assert resp.status_code == 200, resp.text
        b = wait_batch(c, b.id, {"cancelled", "completed", "failed", "expired"}, timeout=15)
        assert b.status == "cancelled", srv.tail()
        assert b.cancelled_at is not None and b.cancelling_at is not None
        assert b.completed_at is None and b.output_file_id is None
        err = [json.loads(x) for x in c.files.content(b.error_file_id or "").text.splitlines()]
    assert sorted(x["custom_id"] for x in err) == sorted(f"s{i}" for i in range(12))
    assert all(x["error"]["code"] == "batch_cancelled" for x in err)


def test_cancel_of_a_finished_batch_is_a_409(client: OpenAI) -> None:
    f = client.files.create(file=("bad.jsonl", b"not json\n"), purpose="batch")
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="1h"
    )
    assert wait_batch(client, b.id, {"failed"}).status == "failed"
    with pytest.raises(openai.ConflictError) as e:
        client.batches.cancel(b.id)
    assert "failed" in e.value.message


def _client_and_file(srv: Server) -> tuple[OpenAI, FileObject]:
    """A client of ``srv`` and an uploaded batch file of one chat request."""
    c = OpenAI(base_url=srv.url, api_key="anything", max_retries=0)
    line = json.dumps(chat_line("a", "hi")).encode()
    return c, c.files.create(file=("a.jsonl", line), purpose="batch")


def test_a_batch_in_a_namespace_with_no_shard_count_waits_without_tracebacks(
    settings: Settings, tmp_path: Path
) -> None:
    """Given `serve` on a namespace no worker or producer has recorded a shard count in, when a
    batch is created, then it stays `validating` (a worker's start will let it run) and the
    server logs why in one WARNING line per try (before: a traceback at every retry)."""
    with Server(settings.replace(shards=0), tmp_path / "files") as srv:
        c, f = _client_and_file(srv)
        b = c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 30
        while "no shard count" not in srv.tail() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.batches.retrieve(b.id).status == "validating"
        log = srv.tail(20_000)
        assert "WARNING" in log and "no shard count" in log and "Traceback" not in log, log


def test_a_batch_that_cannot_be_queued_expires_at_its_window_and_cancels_at_once(
    settings: Settings, tmp_path: Path
) -> None:
    """Given `serve` on a namespace with no shard count (its batches cannot be queued; each try
    backs off up to a minute): a batch with a 3 s window ends `expired` soon after its window
    (it stayed `validating` for ever), and a batch cancelled while its try backs off is
    `cancelled` within seconds (it waited out the backoff), with 20 cancels at once all
    answered 200 (a cancel that lost the race to another got a 409)."""
    from concurrent.futures import ThreadPoolExecutor

    with Server(settings.replace(shards=0), tmp_path / "files") as srv:
        c, f = _client_and_file(srv)
        short = c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="3s"
        )
        long = c.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        wait_until(lambda: f"batch {long.id}: " in srv.tail(20_000), 30, "a failed try")
        b = wait_batch(c, short.id, {"expired", "failed", "cancelled", "completed"}, timeout=20)
        assert b.status == "expired" and b.expired_at is not None
        assert b.expired_at >= b.expires_at  # type: ignore[operator]
        wait_until(lambda: "retried in 8 s" in srv.tail(20_000), 30, "a backoff of 8 s")
        t0 = time.monotonic()
        with ThreadPoolExecutor(20) as pool:
            got = list(pool.map(lambda _: c.batches.cancel(long.id).status, range(20)))
        assert set(got) <= {"cancelling", "cancelled"}, got
        assert wait_batch(c, long.id, {"cancelled"}, timeout=20).status == "cancelled"
        assert time.monotonic() - t0 < 5.0
