"""The `prefixq` command on real parts: submit --wait on an OpenAI batch file, inspect --json."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from helpers import cli, cli_argv
from prefixq.client import Producer
from prefixq.core.settings import Settings
from prefixq.store.burst_end import cancel


def openai_line(cid: str, content: str, max_tokens: int = 8) -> dict[str, Any]:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "any",
            "max_tokens": max_tokens,
            "temperature": 0,
            "messages": [{"role": "user", "content": content}],
        },
    }


@pytest.mark.engine
def test_submit_wait_on_openai_batch_file_writes_results_in_order(
    engines: Any, tmp_path: Path
) -> None:
    """Given an OpenAI batch file, `submit --wait --out --format prefixq` prints the burst id last
    and writes one result line per request, in input order, keyed by custom_id."""
    lines = [openai_line(f"req-{i}", f"Say the number {i}.") for i in range(6)]
    src = tmp_path / "batch.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "results.jsonl"
    p = cli(
        engines.settings,
        "submit",
        str(src),
        "--wait",
        "--out",
        str(out),
        "--format",
        "prefixq",
        timeout=900,
    )
    assert p.returncode == 0, p.stderr
    burst = p.stdout.strip().splitlines()[-1]
    assert burst and " " not in burst
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [g["id"] for g in got] == [x["custom_id"] for x in lines]
    assert all(g["error"] is None and g["output_tokens"] > 0 for g in got)
    assert set(got[0]) >= {
        "id",
        "text",
        "finish_reason",
        "error",
        "shard",
        "prompt_tokens",
        "cached_tokens",
        "output_tokens",
        "timings",
    }

    again = cli(engines.settings, "results", burst, "--format", "prefixq")
    assert again.returncode == 0
    assert [json.loads(x)["id"] for x in again.stdout.splitlines()] == [g["id"] for g in got]


@pytest.mark.engine
def test_inspect_json_reports_correct_counts(engines: Any, tmp_path: Path) -> None:
    """After a burst of 5 good and 1 failing request, inspect --json reports those counts, an
    empty queue, and one live worker per shard."""
    lines = [{"id": f"i{i}", "prompt": f"Number {i} is", "max_tokens": 4} for i in range(5)]
    lines.append({"id": "bad", "prompt": "x " * 9000, "max_tokens": 4})
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines))
    p = cli(engines.settings, "submit", str(src), "--wait", timeout=900)
    assert p.returncode == 0, p.stderr
    burst = p.stdout.strip().splitlines()[-1]

    p = cli(engines.settings, "inspect", "--json", "--burst", burst)
    assert p.returncode == 0, p.stderr
    snap = json.loads(p.stdout)
    (b,) = snap["bursts"]
    assert (b["total"], b["done"], b["failed"], b["status"]) == (6, 5, 1, "finished")
    assert sum(b["per_shard"]) == 6
    assert b["ok"] == 5 and b["queue_wait_s"]["p50"] >= 0 and b["end_to_end_s"]["p99"] > 0
    assert len(snap["shards"]) == engines.settings.shards
    for s in snap["shards"]:
        assert (s["stream_length"], s["pending"], s["waiting"]) == (0, 0, 0)
        assert s["workers"] == 1


def test_submit_refuses_a_bad_file_with_the_line_number(settings: Settings, tmp_path: Path) -> None:
    """A malformed line is refused before anything is enqueued, naming the line; exit code 1."""
    src = tmp_path / "bad.jsonl"
    src.write_text('{"id": "a", "prompt": "ok"}\n{"id": "b", "prompt": "x", "temperature": -3}\n')
    p = cli(settings, "submit", str(src))
    assert p.returncode == 1
    assert "line 2" in p.stderr and "temperature" in p.stderr
    assert p.stdout == ""


def test_usage_error_exits_2(settings: Settings) -> None:
    """An unknown flag is a usage error (exit 2)."""
    p = cli(settings, "inspect", "--no-such-flag")
    assert p.returncode == 2


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (("inspect", "--shard", "1"), "--shard"),  # was read as --shards 1
        (("inspect", "--json", "--namesp", "other"), "--namesp"),
        (("reclaim", "--idle", "5"), "--idle"),
    ],
)
def test_an_abbreviated_flag_is_a_usage_error(
    settings: Settings, args: tuple[str, ...], flag: str
) -> None:
    """argparse took a flag's prefix as the flag: `inspect --shard 1` set the shard count to 1
    and printed shard 0 only. A prefix is now an unknown flag (exit 2, named)."""
    p = cli(settings, *args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert f"unrecognized arguments: {flag}" in p.stderr, p.stderr


def _cancelled_burst(settings: Settings, n: int) -> str:
    """A burst of ``n`` requests with a (cancelled) result each, without a worker."""
    burst = Producer(settings).submit([{"id": f"q{i}", "prompt": f"q {i}"} for i in range(n)])
    cancel(burst, settings)
    return burst


def test_results_to_a_directory_is_one_line_not_a_traceback(
    settings: Settings, tmp_path: Path
) -> None:
    """`results B --out DIR` is a usage error (exit 2) in one line naming the path, before the
    results are read (it was an OSError's one line, exit 1, after)."""
    burst = _cancelled_burst(settings, 3)
    p = cli(settings, "results", burst, "--out", str(tmp_path))
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == (
        f"prefixq: error: --out {tmp_path}: the results cannot be written there "
        "(it is a folder, not a file path)"
    )


def test_results_into_a_pipe_closed_early_stops_quietly(settings: Settings) -> None:
    """`prefixq results B | head -1`: the reader goes away; no traceback on stderr."""
    burst = _cancelled_burst(settings, 3000)
    with subprocess.Popen(
        cli_argv(settings, "results", burst), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline()
        proc.stdout.close()  # `head -1` exits
        err = proc.stderr.read().decode()
        rc = proc.wait(timeout=60)
    assert json.loads(first)["id"] == "q0"
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert rc == 1


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("dead", "--limit", "0"), "--limit must be 1 to 1,000,000, not 0"),
        (("reclaim", "--idle-s", "-5"), "--idle-s must be 0 to 31,536,000.0, not -5.0"),
        (("reclaim", "--idle-s", "1e30"), "--idle-s must be 0 to 31,536,000.0, not 1e+30"),
        (
            ("inspect", "--recent", "99999999999999999999"),
            "--recent must be 0 to 1,000,000, not 99999999999999999999",
        ),
        (("workers", "--cpu", "0"), "--cpu needs at least 1 worker, not 0"),
        # an empty --gpus started one CPU worker (read as "no --gpus")
        (("workers", "--gpus", ""), "--gpus needs at least one GPU index"),
        (("workers", "--gpus", " , "), "--gpus needs at least one GPU index"),
        (
            ("workers", "--gpus", "abc"),
            "--gpus: 'abc' is not a GPU index (0, 1, ...) or a GPU-/MIG- UUID",
        ),
        (
            ("workers", "--gpus", "0,-1"),
            "--gpus: '-1' is not a GPU index (0, 1, ...) or a GPU-/MIG- UUID",
        ),
        (
            ("inspect", "--watch", "--interval", "nan"),
            "--interval must be > 0 and --watch-count >= 0",
        ),
    ],
)
def test_bad_option_values_are_usage_errors(
    settings: Settings, args: tuple[str, ...], says: str
) -> None:
    """They used to reach Redis and come back as its error (exit 1), or name the wrong flag."""
    p = cli(settings, *args, "--shards", "1")
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == f"prefixq: error: {says}"


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (("--out", "OUT"), "--out and --timeout go with --wait"),
        (("--timeout", "5"), "--out and --timeout go with --wait"),
        (("--wait", "--format", "openai"), "--format and --token-ids go with --out"),
        (("--wait", "--out", "OUT", "--token-ids"), "--token-ids goes with the prefixq format"),
        (("--wait", "--out", "NODIR"), "is in a folder that does not exist"),
        (("--wait", "--out", "DIR"), "is a folder, not a file path"),
        (("--on-complete-url", "notaurl"), "--on-complete-url must be an http:// or https://"),
        (("--on-complete-url", "http://h:0/x"), "--on-complete-url must be an http://"),
    ],
)
def test_submit_refuses_options_it_would_ignore_before_submitting(
    settings: Settings, r: Any, tmp_path: Path, extra: tuple[str, ...], says: str
) -> None:
    """`submit FILE --out OUT` without --wait wrote nothing and exited 0; `--token-ids` with an
    OpenAI batch file (openai output lines), or an --out in no folder, was refused only after the
    whole burst had run. They are usage errors now, before anything is enqueued."""
    src = tmp_path / "batch.jsonl"
    src.write_text(json.dumps(openai_line("c1", "hi")) + "\n")
    out = tmp_path / "out.jsonl"
    named = {"OUT": out, "NODIR": tmp_path / "no-such-dir" / "out.jsonl", "DIR": tmp_path}
    args = [str(named.get(a, a)) for a in extra]
    p = cli(settings, "submit", str(src), *args, "--shards", "1", timeout=60)
    assert p.returncode == 2, p.stderr
    assert says in p.stderr and not out.exists()
    assert not list(r.scan_iter(match=f"{settings.namespace}:*"))


def test_an_unknown_log_level_is_a_usage_error_and_the_case_does_not_matter(
    settings: Settings,
) -> None:
    """`--log-level FOO` ended in a ValueError traceback from logging (exit 1)."""
    p = cli(settings, "inspect", "--shards", "1", "--log-level", "FOO")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "argument --log-level: invalid choice: 'FOO'" in p.stderr
    p = cli(settings, "inspect", "--shards", "1", "--json", "--log-level", "debug")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["namespace"] == settings.namespace


def test_submit_wait_that_times_out_still_prints_the_burst_id(
    settings: Settings, tmp_path: Path
) -> None:
    """`B=$(prefixq submit F --wait --timeout 1)` with no worker: exit 1, and stdout still has the
    burst id (it was empty), so a script can collect the burst with `prefixq results` later."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "prompt": "hi"}\n')
    p = cli(settings, "submit", str(src), "--shards", "1", "--wait", "--timeout", "1")
    assert p.returncode == 1, p.stderr
    burst = p.stdout.strip()
    assert f"prefixq: error: burst {burst}: 0/1 results after 1s" in p.stderr
    assert cli(settings, "cancel", burst).returncode == 0


@pytest.mark.parametrize(
    "args",
    [
        ("results", "a\udcffb"),  # a byte that is not UTF-8, as a shell passes it
        ("cancel", "a\udcffb"),
        ("inspect", "--burst", "a\udcffb"),
        ("cancel", "{b}"),
        ("submit", "-", "--burst-id", "a b"),
    ],
)
def test_a_burst_id_no_burst_can_have_is_a_usage_error(
    settings: Settings, args: tuple[str, ...]
) -> None:
    """An id with a byte that is not UTF-8 reached Redis and ended in a traceback (results,
    cancel); now every command refuses an id no burst can have, naming the rule."""
    p = cli(settings, *args, stdin='{"prompt": "x"}\n')
    assert p.returncode == 2, p.stderr
    assert "must be 1-200 characters" in p.stderr and "Traceback" not in p.stderr


def test_the_log_flags_environment_twins_are_read(settings: Settings) -> None:
    """`PREFIXQ_LOG_LEVEL` and `PREFIXQ_LOG_FORMAT` set what `--log-level` and `--log-format`
    set (the help lists them among the settings, each also an env var), and a bad value is a
    usage error (before: both were ignored with a warning that they are not settings)."""
    env = {**os.environ, "PREFIXQ_LOG_LEVEL": "debug", "PREFIXQ_LOG_FORMAT": "json"}
    argv = cli_argv(settings, "inspect", "--json", "--shards", "1")
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert p.returncode == 0, p.stderr
    lines = [json.loads(x) for x in p.stderr.splitlines() if x.startswith("{")]
    assert any(x["level"] == "DEBUG" for x in lines), p.stderr
    assert "not a prefixq setting" not in p.stderr
    env["PREFIXQ_LOG_LEVEL"] = "loud"
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert p.returncode == 2 and "PREFIXQ_LOG_LEVEL='loud' must be one of" in p.stderr
