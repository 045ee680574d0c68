"""Submitting from a file without holding it (client/request_file.py): the file is checked once,
each line read again when its chunk is encoded, and the streams get what the same requests
submitted as a list get; a submit's memory stays far below the file's size."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from helpers import cli, cli_argv, queued_entries
from prefixq.client import Producer
from prefixq.client.request_file import RequestFile, read_request_file
from prefixq.core import wire
from prefixq.core.entries import Entry
from prefixq.core.errors import ValidationError
from prefixq.core.inputs import read_requests
from prefixq.core.settings import Settings


def _lines(n: int, docs: int, doc_chars: int) -> list[dict[str, Any]]:
    texts = [f"document {d} " + "x" * doc_chars for d in range(docs)]
    return [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": [
                    {"role": "user", "content": texts[(i * 7) % docs]},
                    {"role": "user", "content": f"question {i}"},
                ],
                "max_tokens": 4,
            },
        }
        for i in range(n)
    ]


def _write(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _entries(r: redis.Redis, s: Settings) -> list[tuple[Any, ...]]:
    out = []
    for _, f in queued_entries(r, s):
        e = Entry.from_wire(wire.decode(f[b"d"]))
        out.append((e.index, e.id, e.prefix_ref, json.dumps(e.prefix), json.dumps(e.own)))
    return sorted(out)


def test_a_file_enqueues_exactly_what_its_requests_as_a_list_enqueue(
    make_settings: Callable[..., Settings], r: redis.Redis, tmp_path: Path
) -> None:
    """The same 300 lines submitted as a checked file and as a list of requests: the same
    entries (indexes, ids, prefixes by reference or inline), ids list and byte counts (not the
    compressed entries: they hold the enqueue time)."""
    path = _write(tmp_path / "in.jsonl", _lines(300, 20, 600))
    got = []
    for source in ("file", "list"):
        s = make_settings()
        reqs: Any = read_requests(str(path))
        if source == "file":
            reqs = read_request_file(str(path), s)
        burst = Producer(s).submit(reqs)
        meta = r.hgetall(s.keys.burst(burst))
        ids = r.lrange(s.keys.ids(burst), 0, -1)
        sizes = {k: meta[k] for k in (b"raw_bytes", b"prefixes", b"prefix_bytes")}  # not times
        got.append((_entries(r, s), ids, sizes))
    assert got[0] == got[1]
    assert int(got[0][2][b"prefixes"]) == 20  # each document stored once


def test_each_line_is_read_again_once_as_it_is_enqueued(
    make_settings: Callable[..., Settings], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the check, a submit reads each line exactly once more (its chunk's turn), never
    the whole file at once."""
    path = _write(tmp_path / "in.jsonl", _lines(200, 10, 100))
    s = make_settings()
    reads: list[int] = []
    original = RequestFile.__getitem__

    def counted(self: RequestFile, i: Any) -> Any:
        reads.append(i)
        return original(self, i)

    monkeypatch.setattr(RequestFile, "__getitem__", counted)
    Producer(s).submit(read_request_file(str(path), s))
    assert sorted(reads) == list(range(200))


def _peak(s: Settings, path: Path) -> int:
    tracemalloc.start()
    try:
        Producer(s).submit(read_request_file(str(path), s))
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_submit_from_a_file_grows_by_a_few_hundred_bytes_a_request(
    make_settings: Callable[..., Settings], tmp_path: Path
) -> None:
    """Files of 1,500 and 6,000 lines of ~2.2 KB: the check and the submit together peak at a
    few hundred bytes more per extra line (an offset, an id, a fingerprint), not at the lines'
    size; one chunk of parsed lines is all a submit holds of them. (Parsed whole, the lines
    alone took more than twice their size.)"""
    small = _write(tmp_path / "small.jsonl", _lines(1500, 100, 2000))
    big = _write(tmp_path / "big.jsonl", _lines(6000, 100, 2000))
    line = big.stat().st_size / 6000
    grown = (_peak(make_settings(), big) - _peak(make_settings(), small)) / 4500
    assert grown < 0.3 * line, (grown, line)


def test_a_bad_line_is_refused_by_its_number_before_anything_is_enqueued(
    make_settings: Callable[..., Settings], r: redis.Redis, tmp_path: Path
) -> None:
    """A duplicate id names both lines (the file's, blank lines counted); nothing is written."""
    lines = [json.dumps(x) for x in _lines(5, 2, 10)]
    lines.insert(3, "")
    lines.append(lines[1])
    path = tmp_path / "dup.jsonl"
    path.write_text("\n".join(lines) + "\n")
    s = make_settings()
    with pytest.raises(ValidationError, match=r"line 7 and line 2"):
        read_request_file(str(path), s)
    assert not list(r.scan_iter(match=f"{s.namespace}:*"))


def test_submit_from_stdin_reads_a_copy_of_it(
    make_settings: Callable[..., Settings], r: redis.Redis, tmp_path: Path
) -> None:
    """`prefixq submit -` spools stdin to a temporary file and enqueues every line of it."""
    s = make_settings()
    text = "".join(json.dumps(x) + "\n" for x in _lines(40, 3, 50))
    p = cli(s, "submit", "-", "--shards", "1", stdin=text)
    assert p.returncode == 0, p.stderr
    assert len(queued_entries(r, s)) == 40


def test_a_line_longer_than_any_request_is_refused_without_reading_it_whole(
    tmp_path: Path,
) -> None:
    """Given a file whose second line has no end (10 MB of one byte, no newline) and settings
    whose longest line is 2.4 MB, when it is read, then ValidationError names line 2 and the
    bound, and the read never held the line whole (before: `prefixq submit /dev/zero` grew to
    10 GB in 20 s)."""
    s = Settings(max_decoded_bytes=1 << 20, max_prompt_chars=20_000, max_entry_bytes=1 << 20)
    f = tmp_path / "endless.jsonl"
    with open(f, "wb") as out:
        out.write(b'{"id": "a", "prompt": "hi"}\n')
        out.write(b"x" * (10 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(ValidationError, match=r"line 2 is longer than 2,337,152 bytes"):
            read_request_file(str(f), s)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 5 << 20, peak


def test_submit_from_an_endless_stdin_stops_at_its_first_bad_line(
    make_settings: Callable[..., Settings], r: redis.Redis, tmp_path: Path
) -> None:
    """Given `prefixq submit -` whose stdin never ends (a writer that keeps writing, pipe open)
    and whose second line is not JSON, then it exits 1 naming stdin's line 2 while the writer is
    still writing, enqueues nothing and leaves no temporary file (before, stdin was copied whole
    before any line was checked: it filled the disk)."""
    s = make_settings()
    p = subprocess.Popen(
        cli_argv(s, "submit", "-", "--shards", "1"),
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    pipe = p.stdin
    assert pipe is not None and p.stderr is not None

    def write() -> None:
        line = (json.dumps({"id": "x", "prompt": "hello " * 100}) + "\n").encode()
        with contextlib.suppress(OSError, ValueError):  # until the reader goes away
            pipe.write(b'{"id": "a", "prompt": "hi"}\n{"id": "b", "prompt": \n')
            while True:
                pipe.write(line)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        code = p.wait(timeout=60)
        err = p.stderr.read().decode()
    finally:
        p.kill()
        p.wait()
        writer.join(timeout=10)
        for f in (pipe, p.stderr):
            with contextlib.suppress(OSError):
                f.close()
    assert code == 1, err
    assert "stdin: line 2" in err, err
    assert not list(r.scan_iter(match=f"{s.namespace}:*"))
    assert not list(tmp_path.glob("prefixq-stdin-*")), list(tmp_path.iterdir())
