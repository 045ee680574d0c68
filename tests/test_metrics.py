"""Worker metrics: the real Worker loop on a real Redis with the deterministic FakeEngine, and a
Prometheus exporter on a free port, scraped over HTTP."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from fake_engine import FakeEngine
from helpers import FakeWorker, wait_burst
from prefixq.cli.main import build_parser, settings_from
from prefixq.cli.redis_server import free_port
from prefixq.cli.worker_process import metrics_exporter
from prefixq.client import Producer
from prefixq.core.errors import ConfigError, SetupError
from prefixq.core.keys import FIELD, Keys
from prefixq.core.records import Result
from prefixq.core.settings import Settings
from prefixq.integrations.metric_series import COUNTERS
from prefixq.integrations.metrics import MetricsExporter
from prefixq.integrations.worker_metrics import WorkerMetrics
from prefixq.worker.worker import EXIT_OK, Worker

Samples = dict[str, float]


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))  # type: ignore[arg-type]


def scrape(port: int, worker: str, shard: str = "0") -> Samples:
    """Every sample of one worker, keyed by name (plus ``{le=...}`` for histogram buckets)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = dict(s.labels)
            assert (labels.pop("shard"), labels.pop("worker")) == (shard, worker), s
            key = s.name + (f"{{le={labels.pop('le')}}}" if "le" in labels else "")
            if "priority" in labels:  # the per-tenant families
                key += f"{{{labels.pop('priority')},{labels.pop('tenant')}}}"
            if "code" in labels:  # errors per code
                key += f"{{code={labels.pop('code')}}}"
            assert not labels, s
            out[key] = s.value
    return out


def scrape_until(
    port: int, worker: str, ready: Callable[[Samples], bool], within: float = 15.0
) -> Samples:
    deadline = time.monotonic() + within
    while True:
        m = scrape(port, worker)
        if ready(m):
            return m
        assert time.monotonic() < deadline, f"metrics never got there: {m}"
        time.sleep(0.02)


class GatedEngine(FakeEngine):
    """A FakeEngine whose start (the engine loading) waits until the test opens the gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    async def start(self) -> None:
        await asyncio.to_thread(self.gate.wait, 30)
        await super().start()


def test_a_burst_is_counted_timed_and_its_queue_seen_before_and_after(
    make_settings: Callable[..., Settings],
    fake_worker: Callable[..., FakeWorker],
    r: redis.Redis,
) -> None:
    """Given 5 requests (one refused by the engine) and one undecodable entry queued while the
    worker's engine loads, the exporter first shows 6 waiting entries and the engine down; after
    the burst, the counters equal the burst's numbers, each histogram counts the 4 successes with
    the sums the results' own timings give, tokens add up, the queue is empty and GC pauses
    show."""
    s = make_settings(heartbeat_s=0.05)
    texts = ["a b c", "d e", "fail:no", "f", "g h i j"]
    port = free_port()
    exporters: list[MetricsExporter] = []

    def exporter(w: Worker) -> MetricsExporter:
        exporters.append(metrics_exporter(w, port, addr="127.0.0.1"))
        w.add_middleware(exporters[-1])  # as `prefixq worker --metrics-port` registers it
        return exporters[-1]

    engine = GatedEngine()
    fw = fake_worker(s, name="m0", engine=engine, wrap=exporter, until="built")
    assert fw.worker is not None
    (exp,) = exporters
    assert exp.port == port and exp in fw.worker.middleware
    burst = Producer(s).submit(
        [{"id": f"q{i}", "prompt": t, "max_tokens": 8} for i, t in enumerate(texts)]
    )
    r.xadd(Keys(s.namespace).stream(0), {FIELD: b"\x01garbage"})
    time.sleep(0.1)

    before = scrape_until(
        port,
        "m0",
        lambda m: (
            m.get("prefixq_queue_depth") == 6 and m["prefixq_queue_oldest_age_seconds"] >= 0.05
        ),
    )
    assert before["prefixq_engine_up"] == 0
    assert before["prefixq_queue_pending"] == 0
    # the burst's 5 requests as its priority and tenant; the garbage entry's tenant is unknown
    assert before["prefixq_tenant_queue_depth{normal,default}"] == 5
    assert before["prefixq_tenant_queue_depth{normal,?}"] == 1
    assert before["prefixq_requests_admitted_total"] == 0
    assert before["prefixq_end_to_end_seconds_count"] == 0

    engine.gate.set()
    got = wait_burst(r, s, burst, 15)
    ok = [g for g in got if g.error is None]
    assert len(ok) == 4
    gc.collect()  # GcWatch runs after warm-up: this pause must reach the histogram

    m = scrape_until(
        port,
        "m0",
        lambda m: (
            m["prefixq_queue_depth"] == 0
            and m["prefixq_queue_pending"] == 0
            and m["prefixq_dead_letter_stream_length"] == 1
        ),
    )
    assert fw.stop() == EXIT_OK
    assert fw.worker.gc.observer is None, "the stopped exporter let go of the GC watch"
    with pytest.raises(ConnectionRefusedError):  # and no longer serves
        socket.create_connection(("127.0.0.1", port), timeout=2).close()

    assert m["prefixq_engine_up"] == 1
    assert m["prefixq_inflight"] == 0
    assert m["prefixq_tenant_admitted_total{normal,default}"] == 5
    assert m["prefixq_tenant_inflight{normal,default}"] == 0
    assert m["prefixq_tenant_queue_wait_seconds_total{normal,default}"] > 0
    assert m["prefixq_max_inflight"] == 8  # 2 x FakeEngine's max_num_seqs
    assert m["prefixq_requests_admitted_total"] == 5
    assert m["prefixq_requests_finished_total"] == 4
    assert m["prefixq_requests_failed_total"] == 1
    assert m["prefixq_request_errors_total{code=engine_error}"] == 1
    assert m["prefixq_predicted_cached_tokens_total"] == 0
    assert m["prefixq_loop_lag_seconds_count"] >= 1
    assert m["prefixq_dead_letters_total"] == 1
    assert m["prefixq_requests_reclaimed_total"] == 0
    assert m["prefixq_queue_oldest_age_seconds"] == 0
    assert m["prefixq_queue_stats_age_seconds"] < 5
    for stage in ("queue_wait", "first_token", "end_to_end"):
        assert m[f"prefixq_{stage}_seconds_count"] == 4
        assert m[f"prefixq_{stage}_seconds_bucket{{le=+Inf}}"] == 4
    t = [g.timings for g in ok]
    assert m["prefixq_queue_wait_seconds_sum"] == pytest.approx(
        sum(x.admitted - x.enqueued for x in t)
    )
    assert m["prefixq_first_token_seconds_sum"] == pytest.approx(
        sum(x.first_token - x.admitted for x in t)
    )
    assert m["prefixq_end_to_end_seconds_sum"] == pytest.approx(
        sum(x.finished - x.enqueued for x in t)
    )
    assert m["prefixq_prompt_tokens_total"] == sum(g.prompt_tokens for g in ok) == 10
    assert m["prefixq_output_tokens_total"] == sum(g.output_tokens for g in ok) == 10
    assert m["prefixq_cached_tokens_total"] == 0
    assert m["prefixq_cached_token_ratio"] == 0
    assert m["prefixq_gc_pause_seconds_count"] >= 1
    with pytest.raises(urllib.error.URLError, match="refused"):  # stopped serving on exit
        scrape(port, "m0")


def test_histogram_buckets_are_cumulative_and_the_cached_ratio_follows_the_tokens() -> None:
    """Observations land in the first bucket whose bound holds them; buckets are cumulative;
    the cached-token ratio is cached / prompt tokens; failed results are not timed."""
    keys = ("engine_up", "inflight", "max_inflight", *COUNTERS)
    m = WorkerMetrics(3, "w", lambda now: dict.fromkeys(keys, 0))
    waits = (0.004, 0.005, 0.3, 7200.0)
    tokens = ((10, 0), (10, 5), (20, 15), (0, 0))
    for wait, (prompt, cached) in zip(waits, tokens, strict=True):
        res = Result(id="x", index=0, prompt_tokens=prompt, cached_tokens=cached)
        res.timings.enqueued, res.timings.admitted = 100.0, 100.0 + wait
        res.timings.finished = res.timings.admitted + 1
        m.observe(res)
    m.observe(Result(id="bad", index=1, error="refused"))
    fam = {f.name: f for f in m.collect()}
    samples = fam["prefixq_queue_wait_seconds"].samples
    buckets = {s.labels["le"]: s.value for s in samples if s.name.endswith("_bucket")}
    assert buckets["0.005"] == 2  # 0.004 and 0.005 (le is inclusive)
    assert buckets["0.25"] == 2
    assert buckets["0.5"] == 3
    assert buckets["3600.0"] == 3
    assert buckets["+Inf"] == 4
    assert m.first_token.count == 0  # no first-token time, nothing observed
    ratio = fam["prefixq_cached_token_ratio"].samples[0]
    assert ratio.value == pytest.approx(20 / 40)
    assert ratio.labels == {"shard": "3", "worker": "w"}


def test_metrics_port_is_a_setting_with_an_env_var_and_a_flag() -> None:
    """PREFIXQ_METRICS_PORT and --metrics-port set it (the flag wins); 0 = off; bad ports fail."""
    assert Settings().metrics_port == 0
    assert Settings.from_env({"PREFIXQ_METRICS_PORT": "9105"}).metrics_port == 9105
    args = build_parser().parse_args(["worker", "--shard", "0", "--metrics-port", "9200"])
    assert settings_from(args).metrics_port == 9200
    with pytest.raises(ConfigError):
        Settings(metrics_port=70_000)


def test_a_taken_port_is_a_setup_error(make_settings: Callable[..., Settings]) -> None:
    """The exporter refuses to start on a port something else holds, saying which."""

    async def main() -> None:
        w = Worker(make_settings(), 0, FakeEngine(), name="busy")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            port = sock.getsockname()[1]
            with pytest.raises(SetupError, match=str(port)):
                async with metrics_exporter(w, port, addr="127.0.0.1"):
                    pass
        assert not w.middleware
        await w.r.aclose()

    run(main())
