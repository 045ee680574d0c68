"""The file a burst's results are written to (client/out_file.py), through `results.write_jsonl`
and `prefixq results --out` on a burst a real Worker loop served (fake engine): written whole or
not at all, devices and pipes written in place, links followed, a path that cannot be written
refused before waiting."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import threading
from pathlib import Path

import pytest
import redis

from helpers import FakeWorker, cli, cli_argv
from prefixq.client import Producer, results
from prefixq.client.out_file import out_path_problem
from prefixq.core.records import Result
from prefixq.core.settings import Settings


@pytest.fixture
def burst(settings: Settings, r: redis.Redis) -> str:
    with FakeWorker(settings, name="out0"):
        b = Producer(settings).submit([{"id": f"q{i}", "prompt": f"hi {i}"} for i in range(6)])
        results.wait(b, settings, timeout=30)
    return b


def test_a_write_that_fails_midway_leaves_the_previous_file_and_no_partial(
    settings: Settings, burst: str, tmp_path: Path
) -> None:
    """Given an existing out file (mode 0640), a write whose third line fails leaves that file
    byte for byte and nothing beside it; the next write replaces it whole, keeping its mode."""
    out = tmp_path / "out.jsonl"
    out.write_text("previous\n")
    out.chmod(0o640)
    seen = []

    def line(res: Result) -> str:
        seen.append(res.id)
        if len(seen) == 3:
            raise OSError("disk full")
        return res.id + "\n"

    with pytest.raises(OSError, match="disk full"):
        results.write_lines(burst, out, line, settings, timeout=10)
    assert out.read_text() == "previous\n" and os.listdir(tmp_path) == ["out.jsonl"]
    assert results.write_jsonl(burst, str(out), settings, timeout=10) == 6
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == [
        f"q{i}" for i in range(6)
    ]
    assert stat.S_IMODE(out.stat().st_mode) == 0o640 and os.listdir(tmp_path) == ["out.jsonl"]


def test_a_fifo_is_written_in_place_and_a_link_keeps_pointing_at_the_new_file(
    settings: Settings, burst: str, tmp_path: Path
) -> None:
    """Given a FIFO, the lines go into it (a rename would have put a file in its place); given a
    symbolic link to a file, the file is replaced and the link still leads to it."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.extend(fifo.read_text().splitlines()))
    reader.start()
    assert results.write_jsonl(burst, fifo, settings, timeout=10) == 6
    reader.join(10)
    assert len(got) == 6 and stat.S_ISFIFO(fifo.lstat().st_mode)
    target = tmp_path / "real.jsonl"
    target.write_text("old\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    assert results.write_jsonl(burst, link, settings, timeout=10) == 6
    assert link.is_symlink() and len(target.read_text().splitlines()) == 6


def test_results_out_in_a_missing_folder_is_refused_before_waiting(
    settings: Settings, burst: str, tmp_path: Path
) -> None:
    """`prefixq results B --out` into a folder that does not exist is a usage error (exit 2)
    naming the folder, not an OSError after the wait; a folder path is refused the same way."""
    p = cli(settings, "results", burst, "--out", str(tmp_path / "nope" / "o.jsonl"), timeout=60)
    assert p.returncode == 2 and "is in a folder that does not exist" in p.stderr, p.stderr
    p = cli(settings, "results", burst, "--out", str(tmp_path), timeout=60)
    assert p.returncode == 2 and "is a folder, not a file path" in p.stderr, p.stderr
    assert out_path_problem(tmp_path / "fine.jsonl") is None
    assert out_path_problem("/dev/null") is None


def test_out_dev_stdout_appends_through_the_processs_own_output(
    settings: Settings, burst: str, tmp_path: Path
) -> None:
    """`results B --out /dev/stdout >> log` keeps what the log held (a rename replaced the file
    the redirection named), and `submit --wait --out /dev/stdout > res` keeps the burst id that
    submit prints after the lines (a second file position wrote over it)."""
    log = tmp_path / "all.jsonl"
    log.write_text("earlier\n")
    with open(log, "a") as out:
        p = subprocess.run(
            cli_argv(settings, "results", burst, "--out", "/dev/stdout"),
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    assert p.returncode == 0, p.stderr
    lines = log.read_text().splitlines()
    assert lines[0] == "earlier" and len(lines) == 7
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "prompt": "hello"}\n')
    res = tmp_path / "res.txt"
    with FakeWorker(settings, name="out1"), open(res, "w") as out:
        p = subprocess.run(
            cli_argv(settings, "submit", str(src), "--wait", "--out", "/dev/stdout"),
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    assert p.returncode == 0, p.stderr
    first, last = res.read_text().splitlines()
    assert json.loads(first)["id"] == "a" and last.strip() and "{" not in last


def test_two_writers_of_one_path_never_share_a_temporary_file(
    settings: Settings, burst: str, tmp_path: Path
) -> None:
    """Given 4 threads writing the same burst's results to one path at once, each write is
    whole: the file ends as one complete copy and nothing is left beside it (one temporary name
    per process was written by all of them)."""
    out = tmp_path / "out.jsonl"
    errors: list[BaseException] = []

    def write() -> None:
        try:
            for _ in range(5):
                results.write_jsonl(burst, out, settings, timeout=10)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == [
        f"q{i}" for i in range(6)
    ]
    assert os.listdir(tmp_path) == ["out.jsonl"]


def test_a_loop_of_symbolic_links_is_refused_before_the_burst(tmp_path: Path) -> None:
    """An --out that is a loop of links was let through and failed after the burst ran."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert out_path_problem(loop) == "is a loop of symbolic links"
