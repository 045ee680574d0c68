"""Files that expire, through the official `openai` client against a real `prefixq serve` and a
real Redis: ``expires_after`` on uploads and ``output_expires_after`` on batches, validated with
OpenAI's error shape, shown as ``expires_at`` and honoured to the second. Time is moved with the
server's test-only ``clock_shift_file`` setting, so the expiry code under test is the server's own
with OpenAI's real bounds (an hour at least). A batch's output files expiring: in
test_openai_responses.py, on real workers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from openai import OpenAI

from helpers import wait_until
from openai_server import Server, chat_line, jsonl
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings

HOUR = 3600


class ShiftedServer:
    """A `prefixq serve` whose expiry clock runs ``shift`` seconds ahead (`move_to`)."""

    def __init__(self, srv: Server, shift_file: Path) -> None:
        self.srv, self.shift_file = srv, shift_file

    def move_to(self, epoch: float) -> None:
        """Set the server's expiry clock to ``epoch`` (as of now; it keeps running)."""
        self.shift_file.write_text(str(epoch - time.time()))


@pytest.fixture
def shifted(settings: Settings, tmp_path: Path) -> Iterator[ShiftedServer]:
    shift = tmp_path / "clock-shift"
    shift.write_text("0")
    with Server(settings, tmp_path / "files", extra=["--clock-shift-file", str(shift)]) as srv:
        yield ShiftedServer(srv, shift)


@pytest.fixture
def oai(shifted: ShiftedServer) -> OpenAI:
    return OpenAI(base_url=shifted.srv.url, api_key="k", max_retries=0)


def upload(c: OpenAI, seconds: int | None = None) -> Any:
    extra: dict[str, Any] = {}
    if seconds is not None:
        extra["expires_after"] = {"anchor": "created_at", "seconds": seconds}
    return c.files.create(
        file=("in.jsonl", jsonl([chat_line("a", "hi")])), purpose="batch", **extra
    )


def test_an_upload_expires_exactly_at_created_at_plus_its_seconds(
    oai: OpenAI, shifted: ShiftedServer, settings: Settings, r: redis.Redis, tmp_path: Path
) -> None:
    """Given a file uploaded with expires_after of an hour, its object shows expires_at =
    created_at + 3600; a second before, it is there; at expires_at, retrieve, content, delete
    and list answer as if it never was, and its bytes and keys are gone."""
    f = upload(oai, HOUR)
    assert f.expires_at == f.created_at + HOUR
    assert oai.files.retrieve(f.id).expires_at == f.expires_at
    shifted.move_to(f.expires_at - 2)  # type: ignore[operator]
    assert oai.files.content(f.id).text and [x.id for x in oai.files.list()] == [f.id]
    shifted.move_to(f.expires_at)  # type: ignore[arg-type]
    assert [x.id for x in oai.files.list()] == []
    for call in (oai.files.retrieve, oai.files.content, oai.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(f.id)
    keys = Keys(settings.namespace)
    assert not r.exists(keys.oai_file(f.id)) and r.zscore(keys.oai_files, f.id) is None
    assert r.zscore(keys.oai_expiring, f.id) is None
    assert not (tmp_path / "files" / settings.namespace / f.id).exists()


def test_the_sweeper_removes_expired_files_nobody_asks_for(
    oai: OpenAI, shifted: ShiftedServer, settings: Settings, r: redis.Redis, tmp_path: Path
) -> None:
    """An expired file that no client touches loses its bytes and keys all the same; a file
    without expires_after and one expiring later stay."""
    soon, later, never = upload(oai, HOUR), upload(oai, 2 * HOUR), upload(oai)
    assert never.expires_at is None
    folder = tmp_path / "files" / settings.namespace
    shifted.move_to(soon.expires_at + 1)
    keys = Keys(settings.namespace)
    wait_until(lambda: not r.exists(keys.oai_file(soon.id)), 10, "the sweep of the expired file")
    assert not (folder / soon.id).exists() and r.zscore(keys.oai_expiring, soon.id) is None
    assert (folder / later.id).exists() and (folder / never.id).exists()
    assert {x.id for x in oai.files.list()} == {later.id, never.id}


@pytest.mark.parametrize(
    "value",
    [
        {"anchor": "created_at", "seconds": HOUR - 1},
        {"anchor": "created_at", "seconds": 30 * 86400 + 1},
        {"anchor": "last_active_at", "seconds": HOUR},
    ],
)
def test_bad_expiry_policies_are_400s_naming_the_param_and_store_nothing(
    oai: OpenAI, value: dict[str, Any], settings: Settings, tmp_path: Path
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        oai.files.create(
            file=("in.jsonl", jsonl([chat_line("a", "hi")])),
            purpose="batch",
            expires_after=value,  # type: ignore[arg-type]
        )
    assert e.value.body["param"] == "expires_after"  # type: ignore[index]
    assert e.value.body["code"] == "invalid_value"  # type: ignore[index]
    assert oai.files.list().data == []
    assert list((tmp_path / "files" / settings.namespace).iterdir()) == []
    f = upload(oai)
    with pytest.raises(openai.BadRequestError) as e:
        oai.batches.create(
            input_file_id=f.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            output_expires_after=value,  # type: ignore[arg-type]
        )
    assert e.value.body["param"] == "output_expires_after"  # type: ignore[index]
    assert oai.batches.list().data == []


def test_a_batch_cannot_start_from_an_expired_input_file(
    oai: OpenAI, shifted: ShiftedServer
) -> None:
    f = upload(oai, HOUR)
    shifted.move_to(f.expires_at)
    with pytest.raises(openai.BadRequestError) as e:
        oai.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert e.value.body["param"] == "input_file_id"  # type: ignore[index]


def test_expires_after_as_one_json_form_field_is_taken_and_a_stray_one_refused(
    shifted: ShiftedServer, settings: Settings, tmp_path: Path
) -> None:
    """Given a multipart upload (as curl -F sends it) with ``expires_after`` as one field
    holding its JSON object, the file expires as with the client's bracketed fields; a field the
    policy has not (``expires_after[when]``), not JSON, or both forms at once are 400s that store
    nothing: no upload is kept that silently never expires."""
    url = f"{shifted.srv.url}/files"
    body = jsonl([chat_line("a", "hi")])

    def post(fields: dict[str, str]) -> httpx.Response:
        files = {"file": ("in.jsonl", body)}
        return httpx.post(url, data={"purpose": "batch", **fields}, files=files, timeout=10)

    ok = post({"expires_after": '{"anchor": "created_at", "seconds": 7200}'})
    assert ok.status_code == 200, ok.text
    assert ok.json()["expires_at"] == ok.json()["created_at"] + 7200
    for fields in (
        {"expires_after[when]": "created_at", "expires_after[seconds]": "7200"},
        {"expires_after": "7200"},
        {"expires_after": "{not json"},
        {
            "expires_after": '{"anchor": "created_at", "seconds": 7200}',
            "expires_after[anchor]": "created_at",
        },
    ):
        bad = post(fields)
        assert bad.status_code == 400, (fields, bad.text)
        assert bad.json()["error"]["param"] == "expires_after"
    names = sorted(p.name for p in (tmp_path / "files" / settings.namespace).iterdir())
    assert names == [ok.json()["id"]]
