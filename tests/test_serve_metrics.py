"""`prefixq serve`'s ``/metrics`` (prefixq.integrations.serve_metrics): the outstanding work of each
namespace over all its shards, what the Kubernetes autoscaler (deploy/k8s) scales the workers on.
A real server process on a real Redis, bursts from the real Producer, a FakeEngine worker."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from prometheus_client.parser import text_string_to_metric_families

from helpers import cli, wait_burst
from openai_server import Server
from prefixq.client import Producer
from prefixq.core.settings import Settings

Figures = dict[tuple[str, str], float]


def scrape(srv: Server) -> Figures:
    """Every sample, keyed by (name, namespace); no API key sent (the endpoint needs none)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {
        (s.name, s.labels["prefixq_namespace"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape_until(srv: Server, ready: Callable[[Figures], bool], within: float = 20) -> Figures:
    deadline = time.monotonic() + within
    while True:
        m = scrape(srv)
        if ready(m):
            return m
        assert time.monotonic() < deadline, f"the figures never got there: {m}"
        time.sleep(0.05)


def test_outstanding_work_is_summed_over_every_shard_per_namespace(
    make_settings: Callable[..., Settings],
    tmp_path: Path,
    r: redis.Redis,
    fake_worker: Callable[..., Any],
) -> None:
    """Given a server for two namespaces (one API key each) and no worker: 7 requests spread over
    3 shards of the first and 2 on the second count as outstanding and queued, each in its own
    namespace; a worker that takes requests into its engine moves them from queued to in flight,
    still outstanding; a burst served to its end leaves 0."""
    a = make_settings(shards=3, placement="round-robin", grace_s=0.5)
    b = make_settings(shards=1)
    Producer(a).submit([{"id": f"a{i}", "prompt": f"sleep:30 x {i}"} for i in range(7)])
    served_b = Producer(b).submit([{"id": f"b{i}", "prompt": f"one two {i}"} for i in range(2)])
    keys = f"ka={a.namespace},kb={b.namespace}"
    with Server(a, tmp_path / "files", api_keys=keys) as srv:
        m = scrape(srv)
        assert m[("prefixq_shards", a.namespace)] == 3
        assert m[("prefixq_outstanding_requests", a.namespace)] == 7
        assert m[("prefixq_queued_requests", a.namespace)] == 7
        assert m[("prefixq_oldest_queued_age_seconds", a.namespace)] > 0
        assert m[("prefixq_outstanding_requests", b.namespace)] == 2
        assert m[("prefixq_shards", b.namespace)] == 1

        # shard 0's requests sleep in its worker's engine: in flight; shards 1 and 2 have none
        fake_worker(a, shard=0, name="a0")
        m = scrape_until(srv, lambda m: m[("prefixq_queued_requests", a.namespace)] < 7)
        assert m[("prefixq_queued_requests", a.namespace)] > 0
        assert m[("prefixq_outstanding_requests", a.namespace)] == 7

        fake_worker(b, shard=0, name="b0")
        assert len(wait_burst(r, b, served_b, 30)) == 2
        m = scrape_until(srv, lambda m: m[("prefixq_outstanding_requests", b.namespace)] == 0)
        assert m[("prefixq_queued_requests", b.namespace)] == 0
        assert m[("prefixq_oldest_queued_age_seconds", b.namespace)] == 0


def test_a_namespace_without_workers_yet_reads_as_zero(settings: Settings, tmp_path: Path) -> None:
    """Before any worker or producer recorded a shard count, the namespace is exported with
    zeros (an autoscaler reads "nothing to do", not an error)."""
    fresh = settings.replace(shards=0)
    with Server(fresh, tmp_path / "files") as srv:
        m = scrape(srv)
    assert m[("prefixq_shards", fresh.namespace)] == 0
    assert m[("prefixq_outstanding_requests", fresh.namespace)] == 0


def test_a_cancelled_bursts_queued_entries_are_no_outstanding_work(
    make_settings: Callable[..., Settings], tmp_path: Path, r: redis.Redis
) -> None:
    """Given no worker, a cancelled burst (its heads in the intakes, the rest in its lanes, over
    2 shards) beside a live one: the figures count the live burst's requests only (before: the
    cancelled burst's entries too, until a worker skipped them, so a cancel of a large burst
    scaled a fleet at zero up to its maximum for nothing); inspect shows them as ended_waiting."""
    from prefixq.store import burst_end

    s = make_settings(shards=2, placement="round-robin")
    cancelled = Producer(s).submit([{"id": f"c{i}", "prompt": f"x {i}"} for i in range(40)])
    Producer(s).submit([{"id": f"l{i}", "prompt": f"y {i}"} for i in range(3)])
    burst_end.cancel(cancelled, s, client=r)
    with Server(s, tmp_path / "files") as srv:
        m = scrape(srv)
    assert m[("prefixq_outstanding_requests", s.namespace)] == 3
    assert m[("prefixq_queued_requests", s.namespace)] == 3
    p = cli(s, "inspect", "--json")
    assert p.returncode == 0, p.stderr
    shards = json.loads(p.stdout)["shards"]
    assert sum(x["ended_waiting"] for x in shards) == 40
    assert sum(x["waiting"] for x in shards) == 3
