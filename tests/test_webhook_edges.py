"""Webhooks against hostile receivers and addresses, on real `prefixq serve` processes and a real
Redis: URLs no attempt can reach (a port that is no number, control
characters, an unclosed IPv6 host): refused where they are given, and an outbox record holding
one is a failed attempt, retried and given up as any other. docs/operations.md, "Receiving
webhooks"."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis

from helpers import requests, wait_until
from openai_server import Server
from prefixq.client import Producer
from prefixq.core.errors import ConfigError, ValidationError
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.store.webhook_outbox import Delivery
from test_webhooks import _config, _flags, _secret

BAD_URLS = ["http://h:abc/x", "http://h:99999/x", "http://[::1/x", "http://a\nb/x", "http://h/\x00"]


@pytest.mark.parametrize("url", BAD_URLS)
def test_a_url_no_attempt_can_reach_is_refused_where_it_is_given(
    settings: Settings, r: redis.Redis, url: str
) -> None:
    with pytest.raises(ValidationError, match="on_complete_url"):
        Producer(settings).submit(requests(1), on_complete_url=url)
    assert r.zcard(Keys(settings.namespace).bursts) == 0
    spec = {"ns": {"secret": _secret(), "endpoints": [{"url": url}]}}
    with pytest.raises(ConfigError, match="http"):
        Settings(webhooks=json.dumps(spec))


def test_an_outbox_delivery_to_a_malformed_url_is_retried_then_given_up(
    settings: Settings, tmp_path: Path, r: redis.Redis
) -> None:
    """Given an outbox record whose URL httpx cannot post to (queued before such URLs were
    refused), each attempt is a failed attempt, retried with backoff and given up after the
    retry window: counted and logged, not an exception every time its claim runs out."""
    keys = Keys(settings.namespace)
    d = Delivery("wh_badurl", "http://h:abc/x", '{"id":"evt_x"}', time.time(), 0, "")
    r.hset(keys.hooks, d.id, d.dumps())
    r.zadd(keys.hooks_due, {d.id: 0})
    flags = _flags(_config(settings.namespace, _secret()), webhook_retry_window_s=2)
    with Server(settings, tmp_path / "files", extra=flags) as srv:
        wait_until(lambda: r.hget(keys.hooks_stats, "gave_up") == b"1", 20, "giving up")
        log = srv.tail(20_000)
    assert r.hlen(keys.hooks) == 0 and int(r.hget(keys.hooks_stats, "retried") or 0) >= 1
    assert "gave up after" in log and "Traceback" not in log
