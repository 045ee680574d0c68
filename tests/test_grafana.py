"""deploy/grafana/prefixq.json queries only metrics a real worker exports: the engines' real
`prefixq worker` processes (vLLM CPU engine) are scraped after a burst with one refused request,
and every metric name in every panel's query must be among the samples."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from helpers import wait_burst
from prefixq.client import Producer

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy/grafana/prefixq.json"


def queried_names() -> set[str]:
    """Every metric name in the dashboard's queries (and its variables')."""
    dash = json.loads(DASHBOARD.read_text())
    exprs: list[str] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                if k in ("expr", "query", "definition") and isinstance(v, str):
                    exprs.append(v)
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(dash)
    return {n for e in exprs for n in re.findall(r"\bprefixq_[a-z0-9_]+", e)}


def selectors() -> set[str]:
    """The name before every ``{...}`` label selector of the dashboard's queries."""
    return set(re.findall(r"\b([a-z_:][a-z0-9_:]*)\{", DASHBOARD.read_text()))


def scraped(port: int) -> set[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_the_dashboard_selects_prefixq_metrics_only() -> None:
    """Every series selector names a prefixq metric, and the extraction the engine test relies
    on finds the core ones."""
    names = queried_names()
    assert {"prefixq_requests_finished_total", "prefixq_queue_wait_seconds_bucket"} <= names
    # no other metric (Prometheus' own `up`, a typo'd family) is selected anywhere
    assert selectors() <= names, selectors() - names


@pytest.mark.engine
def test_every_metric_the_grafana_dashboard_queries_is_exported_by_a_real_worker(
    engines: Any, r: redis.Redis
) -> None:
    """Given the engines' two real workers after a burst that has one request the engine
    refuses (a token id outside the vocabulary), every name the dashboard queries is a sample
    of their /metrics."""
    s = engines.settings
    reqs: list[dict[str, Any]] = [
        {"id": f"g{i}", "prompt": f"Count to {i}:", "max_tokens": 4, "temperature": 0}
        for i in range(6)
    ]
    reqs.append({"id": "bad", "prompt_token_ids": [10**9], "max_tokens": 2})
    burst = Producer(s).submit(reqs, tenant="grafana")
    got = wait_burst(r, s, burst, 300)
    assert [g.error_code for g in got if g.error] == ["invalid_request"]
    wanted = queried_names()
    deadline = time.monotonic() + 30
    while True:  # the queue gauges appear after the exporter's first read
        have = set().union(*(scraped(p) for p in engines.metrics_ports))
        if wanted <= have or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert sorted(wanted - have) == []
