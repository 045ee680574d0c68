"""A burst's priority and tenant from every way in: the Python API, the CLI, RQ's
`run_burst`, OpenAI batch metadata; the settings that weigh and cap tenants; bad values refused
with the field named. The scheduling itself: test_scheduler.py, test_fairness.py."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from openai import OpenAI

from helpers import FakeWorker, cli, queued_entries, wait_burst, wait_until
from openai_server import Server, chat_line
from prefixq.client import Producer
from prefixq.core import wire
from prefixq.core.entries import Entry
from prefixq.core.errors import ConfigError, ValidationError
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.core.sharing import LaneInfo
from prefixq.ops import stats


def record(r: redis.Redis, s: Settings, burst: str) -> tuple[str, str]:
    m = r.hgetall(Keys(s.namespace).burst(burst))
    return m[b"priority"].decode(), m[b"tenant"].decode()


def entries(r: redis.Redis, s: Settings) -> list[Entry]:
    return [Entry.from_wire(wire.decode(f[b"d"])) for _, f in queued_entries(r, s)]


def test_a_burst_has_priority_normal_and_tenant_default_and_its_entries_carry_no_extra_byte(
    settings: Settings, r: redis.Redis
) -> None:
    """Without a priority or tenant, the record says normal/default and the entries omit both
    fields (the default path's entries are as small as before)."""
    burst = Producer(settings).submit([{"id": f"q{i}", "prompt": "hi"} for i in range(20)])
    assert record(r, settings, burst) == ("normal", "default")
    for _, f in queued_entries(r, settings):
        d = wire.decode(f[b"d"])
        assert "pr" not in d and "tn" not in d
    info = LaneInfo.decode(r.hget(Keys(settings.namespace).lanes(0), burst) or b"")
    assert info == LaneInfo("normal", "default", sealed=True)


def test_priority_and_tenant_from_the_api_reach_the_record_the_entries_and_the_lanes(
    settings: Settings, r: redis.Redis
) -> None:
    """`submit(priority=, tenant=)`: the burst's record, each entry and its lane say them; its
    head and doorbells go to the intake of its priority."""
    keys = Keys(settings.namespace)
    burst = Producer(settings).submit(
        [{"id": f"q{i}", "prompt": "hi"} for i in range(20)], priority="high", tenant="team-a"
    )
    assert record(r, settings, burst) == ("high", "team-a")
    assert {(e.priority, e.tenant) for e in entries(r, settings)} == {("high", "team-a")}
    assert r.xlen(keys.intake(0, "high")) >= 4 and r.xlen(keys.stream(0)) == 0
    assert LaneInfo.decode(r.hget(keys.lanes(0), burst) or b"") == LaneInfo("high", "team-a", True)


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"priority": "urgent"}, "priority must be one of high, normal, low"),
        ({"tenant": "a b"}, "tenant must be 1 to 64"),
        ({"tenant": "x" * 65}, "tenant must be 1 to 64"),
    ],
)
def test_a_bad_priority_or_tenant_is_refused_before_anything_is_enqueued(
    settings: Settings, r: redis.Redis, options: dict[str, Any], says: str
) -> None:
    with pytest.raises(ValidationError, match=says):
        Producer(settings).submit([{"id": "q", "prompt": "hi"}], **options)
    assert not list(r.scan_iter(match=f"{settings.namespace}:*"))


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("priority", "urgent", "priority must be one of"),
        ("tenant", "a:b", "tenant must be"),
        ("tenant_weights", "a=0", "weight of 'a' must be a number from 1e-06 to 1e\\+06"),
        ("tenant_weights", "a=1e-308", "weight of 'a' must be a number from"),
        ("tenant_weights", "a=1e300", "weight of 'a' must be a number from"),
        ("tenant_weights", "a=nan", "weight of 'a' must be a number from"),
        ("tenant_weights", "a", "not TENANT=VALUE"),
        ("tenant_weights", "a=2,a=0.5", "tenant 'a' is listed twice"),
        ("tenant_caps", "a=1,a=5", "tenant 'a' is listed twice"),
        ("tenant_caps", "a=1.5", "cap of 'a' must be an integer"),
    ],
)
def test_bad_sharing_settings_are_config_errors(field: str, value: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        Settings.from_env({f"PREFIXQ_{field.upper()}": value})


def test_cli_submit_takes_priority_and_tenant_flags(
    settings: Settings, r: redis.Redis, tmp_path: Path
) -> None:
    """`prefixq submit --priority low --tenant t1` queues the burst so; a bad value exits 2."""
    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps({"id": f"q{i}", "prompt": "hi"}) + "\n" for i in range(3)))
    r.hset(Keys(settings.namespace).config, "shards", 1)
    p = cli(settings, "submit", str(f), "--priority", "low", "--tenant", "t1")
    assert p.returncode == 0, p.stderr
    burst = p.stdout.strip().splitlines()[-1]
    assert record(r, settings, burst) == ("low", "t1")
    p = cli(settings, "submit", str(f), "--priority", "urgent")
    assert p.returncode == 2 and "priority must be one of" in p.stderr


def test_rq_run_burst_takes_priority_and_tenant(
    settings: Settings, r: redis.Redis, fake_worker: Callable[..., FakeWorker]
) -> None:
    """`rq_jobs.run_burst(..., priority=, tenant=)` (the RQ job function) submits so."""
    from prefixq.integrations.rq_jobs import run_burst

    fake_worker(settings)
    out = run_burst(
        [{"id": "q0", "prompt": "hi"}],
        redis_url=settings.redis_url,
        namespace=settings.namespace,
        priority="high",
        tenant="etl",
        timeout=60,
    )
    assert record(r, settings, out["burst"]) == ("high", "etl")


@pytest.fixture
def server(settings: Settings, tmp_path: Path) -> Iterator[Server]:
    with Server(settings, tmp_path / "files") as srv:
        yield srv


def test_openai_batch_metadata_sets_the_bursts_priority_and_tenant(
    server: Server, settings: Settings, r: redis.Redis
) -> None:
    """A batch created with metadata priority/tenant queues its burst so; another value of them
    is a 400 naming `metadata`, and no batch is made."""
    c = OpenAI(base_url=server.url, api_key="k", max_retries=0)
    body = "".join(json.dumps(chat_line(f"c{i}", "hi")) + "\n" for i in range(3)).encode()
    f = c.files.create(file=("a.jsonl", body), purpose="batch")
    args: dict[str, Any] = {
        "input_file_id": f.id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    for bad in ({"priority": "urgent"}, {"tenant": "no spaces"}):
        with pytest.raises(openai.BadRequestError) as e:
            c.batches.create(**args, metadata=bad)
        assert e.value.body["param"] == "metadata"  # type: ignore[index]
    assert c.batches.list().data == []
    b = c.batches.create(**args, metadata={"priority": "low", "tenant": "team-b"})
    keys = Keys(settings.namespace)
    deadline = time.monotonic() + 30
    while not r.exists(keys.burst(b.id)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert record(r, settings, b.id) == ("low", "team-b")
    assert c.batches.retrieve(b.id).metadata == {"priority": "low", "tenant": "team-b"}


def test_results_come_back_whatever_the_priority(
    settings: Settings, r: redis.Redis, fake_worker: Callable[..., FakeWorker]
) -> None:
    """A burst of each priority completes on one worker with one result per request."""
    fake_worker(settings)
    ids = [
        Producer(settings).submit([{"id": f"{p}{i}", "prompt": p} for i in range(30)], priority=p)
        for p in ("low", "normal", "high")
    ]
    for burst in ids:
        assert [x.error for x in wait_burst(r, settings, burst, 60)] == [None] * 30


def test_inspect_shows_queued_in_flight_and_queue_wait_per_priority_and_tenant(
    settings: Settings, r: redis.Redis, fake_worker: Callable[..., FakeWorker]
) -> None:
    """`prefixq inspect --json`: ``sharing`` lists each priority and tenant with its queued
    requests (intake heads and lane entries alike) before a worker runs; after a worker served
    them, nothing queued or in flight, every request admitted and a mean queue wait; the table
    is in the human form too."""
    r.hset(Keys(settings.namespace).config, "shards", 1)
    hi = Producer(settings).submit(
        [{"id": f"h{i}", "prompt": "hi"} for i in range(30)], priority="high", tenant="team-a"
    )
    lo = Producer(settings).submit(
        [{"id": f"l{i}", "prompt": "hi"} for i in range(7)], priority="low", tenant="team-b"
    )
    p = cli(settings, "inspect", "--json")
    assert p.returncode == 0, p.stderr
    rows = {(x["priority"], x["tenant"]): x for x in json.loads(p.stdout)["sharing"]}
    assert {k: (x["waiting"], x["in_flight"], x["bursts"]) for k, x in rows.items()} == {
        ("high", "team-a"): (30, 0, 1),
        ("low", "team-b"): (7, 0, 1),
    }
    assert rows[("high", "team-a")]["oldest_waiting_s"] >= 0
    time.sleep(0.3)
    fake_worker(settings)
    wait_burst(r, settings, hi, 30)
    wait_burst(r, settings, lo, 30)

    def sharing() -> dict[tuple[str, str], Any]:
        p = cli(settings, "inspect", "--json")
        assert p.returncode == 0, p.stderr
        return {(x["priority"], x["tenant"]): x for x in json.loads(p.stdout)["sharing"]}

    def counted() -> dict[tuple[str, str], Any] | None:  # workers add them at their heartbeat
        rows = sharing()
        done = tuple(
            rows.get(k, {}).get("admitted") for k in (("high", "team-a"), ("low", "team-b"))
        )
        return rows if done == (30, 7) else None

    rows = wait_until(counted, 20, "the admissions counted")
    assert all(x["waiting"] == x["in_flight"] == 0 for x in rows.values())
    assert rows[("low", "team-b")]["mean_queue_wait_s"] >= 0.3
    p = cli(settings, "inspect", "--json")
    bursts = {b["burst"]: b for b in json.loads(p.stdout)["bursts"]}
    assert (bursts[hi]["priority"], bursts[hi]["tenant"]) == ("high", "team-a")
    text = cli(settings, "inspect").stdout
    assert "priorities and tenants" in text and "team-b" in text


def test_inspect_counts_a_burst_with_lanes_on_two_shards_once(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """`sharing`'s ``bursts`` summed the shards' lane counts: one burst spread over two shards
    showed as 2 bursts. Each shard still counts its own lane."""
    s = make_settings(shards=2)
    burst = Producer(s).submit(
        [{"id": f"q{i}", "prompt": f"question {i}"} for i in range(40)],
        placement="round-robin",
        tenant="team-a",
    )
    snap = stats.snapshot(s, burst=burst, client=r)
    assert [[q["bursts"] for q in sh["queues"]] for sh in snap["shards"]] == [[1], [1]]
    (row,) = snap["sharing"]
    assert (row["tenant"], row["waiting"], row["bursts"]) == ("team-a", 40, 1)
