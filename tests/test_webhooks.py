"""Webhooks, end to end on this machine: `prefixq serve` processes and FakeEngine workers on a real
Redis post to a real HTTP receiver (tests/webhook_receiver.py), and the official `openai` client's
``webhooks.unwrap`` checks and parses what arrives. Covered: every batch event type, a wrong
secret, a receiver down then up (each event once, one id over its retries), ``serve`` killed with
-9 between a batch's end and its delivery, two servers sending each event once, giving up after
the retry window, and bursts submitted from Python with ``on_complete_url`` (ended by their last
result or by a cancel), sent by the worker. docs/operations.md, "Receiving webhooks"."""

from __future__ import annotations

import base64
import json
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from openai import OpenAI

from helpers import cli, requests, wait_until
from openai_server import Server, chat_line, completion_line, jsonl, wait_batch
from prefixq.client import Producer
from prefixq.core.errors import ConfigError, ValidationError
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.core.webhooks import retry_delay
from webhook_receiver import Got, Receiver

FINAL = {"completed", "failed", "expired", "cancelled"}


def _secret() -> str:
    return "whsec_" + base64.b64encode(os.urandom(32)).decode()


def _config(ns: str, secret: str, url: str = "") -> str:
    """The ``webhooks`` setting: the namespace's secret, and ``url`` as its endpoint."""
    spec: dict[str, Any] = {"secret": secret}
    if url:
        spec["endpoints"] = [{"url": url}]
    return json.dumps({ns: spec})


def _flags(webhooks: str, **extra: float) -> list[str]:
    """``prefixq serve`` flags: the webhooks, short retries and timeouts (as tests want them)."""
    values = {"webhook_retry_base_s": 0.2, "webhook_retry_max_s": 0.5, "webhook_timeout_s": 1.0}
    out = ["--webhooks", webhooks]
    for name, v in (values | extra).items():
        out += ["--" + name.replace("_", "-"), str(v)]
    return out


def _unwrap(got: Got, secret: str) -> Any:
    return OpenAI(api_key="unused").webhooks.unwrap(got.body, got.headers, secret=secret)


def _batch(c: OpenAI, lines: list[dict[str, Any]], window: str = "1h", endpoint: str = "") -> str:
    f = c.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return c.batches.create(
        input_file_id=f.id,
        endpoint=endpoint or "/v1/completions",  # type: ignore[arg-type]
        completion_window=window,  # type: ignore[arg-type]
    ).id


def _outbox(r: redis.Redis, s: Settings) -> list[dict[str, Any]]:
    return [json.loads(v) for v in r.hvals(Keys(s.namespace).hooks)]


def test_every_batch_end_is_signed_and_parsed_by_the_official_client(
    settings: Settings, tmp_path: Path, fake_worker: Callable[..., Any]
) -> None:
    """Given an endpoint for every batch event, a completed, a failed, an expired and a cancelled
    batch each send one event that ``client.webhooks.unwrap`` accepts and parses as its type,
    naming its batch; a wrong secret is refused for every one."""
    secret = _secret()
    with Receiver() as rx:
        flags = _flags(_config(settings.namespace, secret, rx.url))
        with Server(settings, tmp_path / "files", extra=flags) as srv, fake_worker(settings):
            c = OpenAI(base_url=srv.url, api_key="k", max_retries=0)
            want = {
                _batch(c, [completion_line(f"q{i}", "a b") for i in range(2)]): "completed",
                _batch(c, [chat_line("x", "hi")]): "failed",  # a chat line in a completions batch
                _batch(c, [completion_line("s", "sleep:8 a")], window="2s"): "expired",
            }
            cancel = _batch(c, [completion_line(f"c{i}", "sleep:8 a") for i in range(2)])
            want[cancel] = "cancelled"
            c.batches.cancel(cancel)
            for bid, status in want.items():
                assert wait_batch(c, bid, FINAL, timeout=20).status == status, srv.tail()
            wait_until(lambda: len(rx.ok()) == len(want), 20, "an event per batch")
    events = {}
    for got in rx.ok():
        ev = _unwrap(got, secret)
        events[ev.data.id] = ev
        assert ev.object == "event" and ev.id.startswith("evt_")
        assert type(ev).__name__ == f"Batch{want[ev.data.id].capitalize()}WebhookEvent"
        with pytest.raises(openai.InvalidWebhookSignatureError):
            _unwrap(got, _secret())
    assert {bid: ev.type for bid, ev in events.items()} == {
        bid: f"batch.{status}" for bid, status in want.items()
    }
    assert len({g.headers["webhook-id"] for g in rx.ok()}) == len(want)


def test_a_receiver_down_then_up_gets_each_event_once_under_one_id(
    settings: Settings, tmp_path: Path, r: redis.Redis, fake_worker: Callable[..., Any]
) -> None:
    """Given a receiver that refuses connections, then answers 503 twice, then 200: each batch's
    event is retried with backoff and arrives once, every attempt with the same webhook-id and
    the same body; the outbox is empty after, and its counters say so."""
    secret = _secret()
    rx = Receiver(start=False)
    flags = _flags(_config(settings.namespace, secret, rx.url))
    try:
        with Server(settings, tmp_path / "files", extra=flags) as srv, fake_worker(settings):
            c = OpenAI(base_url=srv.url, api_key="k", max_retries=0)
            ids = [_batch(c, [completion_line(f"q{n}{i}", "a b") for i in range(2)]) for n in "ab"]
            for bid in ids:
                assert wait_batch(c, bid, FINAL).status == "completed", srv.tail()
            wait_until(
                lambda: len(d := _outbox(r, settings)) == 2 and all(x["attempts"] >= 2 for x in d),
                20,
                "two failed attempts of each delivery",
            )
            rx.fail_next = 2
            rx.start()
            wait_until(lambda: r.hlen(Keys(settings.namespace).hooks) == 0, 20, "an empty outbox")
    finally:
        rx.stop()
    ok = rx.ok()
    assert sorted(_unwrap(g, secret).data.id for g in ok) == sorted(ids)
    for g in ok:  # every attempt the receiver saw of this delivery: one id, one body
        tries = [x for x in rx.got if x.headers["webhook-id"] == g.headers["webhook-id"]]
        assert {x.body for x in tries} == {g.body}
    assert len(rx.got) == len(ok) + 2  # the two 503s were retried, nothing sent twice
    stats = r.hgetall(Keys(settings.namespace).hooks_stats)
    assert int(stats[b"delivered"]) == len(ids) and int(stats[b"retried"]) >= 2 * len(ids) + 2


def test_serve_killed_between_a_batch_end_and_its_delivery_delivers_after_restart(
    settings: Settings, tmp_path: Path, r: redis.Redis, fake_worker: Callable[..., Any]
) -> None:
    """Given a batch that completed while its receiver was down, ``serve`` killed with -9, then
    the receiver up: the restarted server sends the event (the outbox was written with the
    batch's final status)."""
    secret = _secret()
    rx = Receiver(start=False)
    flags = _flags(_config(settings.namespace, secret, rx.url))
    try:
        with Server(settings, tmp_path / "files", extra=flags) as srv, fake_worker(settings):
            c = OpenAI(base_url=srv.url, api_key="k", max_retries=0)
            bid = _batch(c, [completion_line("k", "a b")])
            assert wait_batch(c, bid, FINAL).status == "completed", srv.tail()
            assert len(_outbox(r, settings)) == 1
            srv.kill()
            rx.start()
            srv.start()
            wait_until(lambda: rx.ok(), 30, "the event after the restart")
    finally:
        rx.stop()
    assert [_unwrap(g, secret).data.id for g in rx.ok()] == [bid]


def test_two_servers_send_each_event_once(
    settings: Settings, tmp_path: Path, r: redis.Redis, fake_worker: Callable[..., Any]
) -> None:
    """Given two ``serve`` processes on one Redis and a receiver slow to answer (each attempt
    outlasts the deliverers' look at the outbox), each batch's event reaches the receiver once:
    the deliverers claim what they send."""
    secret = _secret()
    with Receiver() as rx:
        rx.delay_s = 1.0
        flags = _flags(_config(settings.namespace, secret, rx.url), webhook_timeout_s=3.0)
        files = tmp_path / "files"
        a, b = Server(settings, files, extra=flags), Server(settings, files, extra=flags)
        with a, b, fake_worker(settings):
            c = OpenAI(base_url=a.url, api_key="k", max_retries=0)
            ids = [_batch(c, [completion_line(f"t{n}", "a b")]) for n in range(6)]
            for bid in ids:
                assert wait_batch(c, bid, FINAL).status == "completed", a.tail()
            wait_until(lambda: r.hlen(Keys(settings.namespace).hooks) == 0, 20, "delivered")
    assert sorted(_unwrap(g, secret).data.id for g in rx.got) == sorted(ids)


def test_a_delivery_past_the_retry_window_is_given_up_with_a_log_line(
    settings: Settings, tmp_path: Path, r: redis.Redis, fake_worker: Callable[..., Any]
) -> None:
    """Given a receiver that always answers 503 and a short retry window, the delivery is retried
    until the window ends, then given up: logged, counted, gone from the outbox."""
    with Receiver() as rx:
        rx.fail_next = 10**9
        flags = _flags(_config(settings.namespace, _secret(), rx.url), webhook_retry_window_s=2)
        with Server(settings, tmp_path / "files", extra=flags) as srv, fake_worker(settings):
            c = OpenAI(base_url=srv.url, api_key="k", max_retries=0)
            bid = _batch(c, [completion_line("g", "a b")])
            assert wait_batch(c, bid, FINAL).status == "completed", srv.tail()
            keys = Keys(settings.namespace)
            wait_until(lambda: r.hget(keys.hooks_stats, "gave_up") == b"1", 20, "giving up")
            assert r.hlen(keys.hooks) == 0 and not rx.ok()
            # the counter is set in Redis before the server writes its log line
            wait_until(lambda: "gave up after" in srv.tail(20_000), 10, "the give-up log line")
    assert len(rx.got) >= 2


def test_a_python_burst_with_on_complete_url_is_sent_by_the_worker(
    settings: Settings, fake_worker: Callable[..., Any]
) -> None:
    """Given a worker whose settings have the namespace's secret and a burst submitted from Python
    with ``on_complete_url``, the receiver gets one signed ``batch.completed`` naming the burst,
    with no server running."""
    secret = _secret()
    s = settings.replace(webhooks=_config(settings.namespace, secret), webhook_timeout_s=1.0)
    with Receiver() as rx, fake_worker(s):
        burst = Producer(s).submit(requests(3), on_complete_url=rx.url)
        burst.wait(timeout=20)
        wait_until(lambda: rx.ok(), 20, "the burst's event")
    (ev,) = [_unwrap(g, secret) for g in rx.ok()]
    assert (ev.type, ev.data.id) == ("batch.completed", burst.id)


def test_a_cancelled_burst_is_sent_batch_cancelled_once(
    settings: Settings, r: redis.Redis, fake_worker: Callable[..., Any]
) -> None:
    """Given a burst with ``on_complete_url`` cancelled before any worker ran (the cancel ends it,
    and queues its event), then a worker: the worker sends one ``batch.cancelled``; cancelling
    again queues nothing."""
    secret = _secret()
    s = settings.replace(webhooks=_config(settings.namespace, secret), webhook_timeout_s=1.0)
    with Receiver() as rx:
        burst = Producer(s).submit(requests(4), on_complete_url=rx.url)
        assert burst.cancel().ended
        assert len(_outbox(r, s)) == 1
        burst.cancel()
        assert len(_outbox(r, s)) == 1
        with fake_worker(s):
            wait_until(lambda: r.hlen(Keys(s.namespace).hooks) == 0, 20, "delivered")
    (ev,) = [_unwrap(g, secret) for g in rx.got]
    assert (ev.type, ev.data.id) == ("batch.cancelled", burst.id)


@pytest.mark.parametrize("url", ["ftp://example.com/x", "example.com/hook", "", 5])
def test_on_complete_url_must_be_http_and_a_bad_one_queues_nothing(
    settings: Settings, r: redis.Redis, url: Any
) -> None:
    with pytest.raises(ValidationError, match="on_complete_url"):
        Producer(settings).submit(requests(1), on_complete_url=url)
    assert r.zcard(Keys(settings.namespace).bursts) == 0


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("not json", "not JSON"),
        ('{"ns": {"secret": "plain"}}', "whsec_"),
        ('{"ns": {"secret": "whsec_!!"}}', "not base64"),
        ('{"ns": {"endpoints": [{"url": "http://h/x"}]}}', "no secret"),
        ('{"ns": {"secret": "%s", "endpoints": [{"url": "h"}]}}', "http"),
        ('{"ns": {"secret": "%s", "endpoints": [{"url": "http://h", "events": ["x"]}]}}', "events"),
        # a TypeError (unhashable list) and a RecursionError, as tracebacks
        ('{"ns": {"secret": "%s", "endpoints": [{"url": "http://h", "events": [[1]]}]}}', "events"),
        ('{"ns": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deep"),
    ],
)
def test_a_bad_webhooks_setting_is_refused_without_showing_a_secret(spec: str, why: str) -> None:
    secret = _secret()
    spec = spec.replace("%s", secret)
    with pytest.raises(ConfigError, match=why) as e:
        Settings(webhooks=spec)
    assert secret not in str(e.value)
    ok = Settings(webhooks=_config("ns", secret, "http://h/x"))
    assert secret not in repr(ok)


def test_the_retry_schedule_doubles_up_to_its_cap_with_jitter() -> None:
    """Each wait is ``base * 2**(n-1)`` capped at ``max``, times a jitter in [0.5, 1]."""
    s = Settings()
    rng = random.Random(1)
    base, most = s.webhook_retry_base_s, s.webhook_retry_max_s
    for n in range(1, 40):
        step = min(most, base * 2 ** (n - 1))
        assert 0.5 * step <= retry_delay(n, base, most, rng) <= step


def test_a_burst_whose_ender_died_before_queueing_its_event_is_sent_by_serve(
    settings: Settings, tmp_path: Path, r: redis.Redis, fake_worker: Callable[..., Any]
) -> None:
    """Given a burst with ``on_complete_url`` that finished while no process queued its event (as
    a worker killed right after recording the last result leaves it), a ``serve`` with the
    namespace's secret finds it among the watched bursts and sends one ``batch.completed``."""
    secret = _secret()
    keys = Keys(settings.namespace)
    with Receiver() as rx:
        with fake_worker(settings):  # no webhooks configured: it queues, never sends
            burst = Producer(settings).submit(requests(2), on_complete_url=rx.url)
            burst.wait(timeout=20)
        (delivery,) = [k.decode() for k in r.hkeys(keys.hooks)]
        r.delete(keys.hooks, keys.hooks_due, keys.hook_seen(delivery))  # as if never queued
        assert r.zscore(keys.hook_bursts, burst.id) is not None
        flags = _flags(_config(settings.namespace, secret))
        with Server(settings, tmp_path / "files", extra=flags):
            wait_until(lambda: rx.ok(), 20, "the burst's event")
            wait_until(lambda: r.zcard(keys.hook_bursts) == 0, 20, "the burst unwatched")
    (ev,) = [_unwrap(g, secret) for g in rx.got]
    assert (ev.type, ev.data.id) == ("batch.completed", burst.id)
    assert ev.id == "evt_" + delivery[3:]  # the id every process derives for this burst's event


def test_a_corrupt_outbox_record_is_dropped_and_the_rest_is_sent(
    settings: Settings, tmp_path: Path, r: redis.Redis
) -> None:
    """Given an outbox entry that is no delivery record (written by something else) beside a
    cancelled burst's event, ``serve`` drops the bad one (logged, counted as given up) and sends
    the good one."""
    secret = _secret()
    keys = Keys(settings.namespace)
    s = settings.replace(webhooks=_config(settings.namespace, secret))
    with Receiver() as rx:
        r.hset(keys.hooks, "wh_bad", "not json")
        r.zadd(keys.hooks_due, {"wh_bad": 0})
        burst = Producer(s).submit(requests(1), on_complete_url=rx.url)
        burst.cancel()
        with Server(settings, tmp_path / "files", extra=_flags(s.webhooks)) as srv:
            wait_until(lambda: rx.ok(), 20, "the good event")
            wait_until(lambda: r.hlen(keys.hooks) == 0, 20, "an empty outbox")
            assert "wh_bad: its outbox record is not one" in srv.tail(20_000)
    assert [_unwrap(g, secret).data.id for g in rx.got] == [burst.id]
    assert r.hget(keys.hooks_stats, "gave_up") == b"1"


def test_prefixq_submit_takes_on_complete_url_and_a_worker_sends_it(
    settings: Settings, tmp_path: Path, fake_worker: Callable[..., Any]
) -> None:
    """Given ``prefixq submit --on-complete-url``, the burst's end reaches the receiver; a URL
    that is not http(s) is a usage error before anything is queued."""
    secret = _secret()
    s = settings.replace(webhooks=_config(settings.namespace, secret), webhook_timeout_s=1.0)
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in requests(2)))
    bad = cli(settings, "submit", str(path), "--on-complete-url", "mailto:x@example.com")
    assert bad.returncode == 2 and "--on-complete-url must be an http" in bad.stderr
    with Receiver() as rx, fake_worker(s):
        done = cli(settings, "submit", str(path), "--wait", "--on-complete-url", rx.url)
        assert done.returncode == 0, done.stderr
        wait_until(lambda: rx.ok(), 20, "the burst's event")
    (ev,) = [_unwrap(g, secret) for g in rx.ok()]
    assert (ev.type, ev.data.id) == ("batch.completed", done.stdout.split()[-1])
