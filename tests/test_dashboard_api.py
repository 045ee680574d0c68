"""The dashboard's /api/ (docs/dashboard.md) on `prefixq serve` and `prefixq dashboard` as real
processes, a real Redis and fake-engine workers: its shapes are `prefixq inspect --json`'s, keys
see their own namespace only, actions need a key, the action header and a same-site caller, and
read-only refuses them; what the page cannot trust (ids, HTML, a Redis that went away) comes
back as data or as an error in the one shape."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from helpers import FakeWorker, cli, requests, wait_burst, wait_settled, wait_until
from openai_server import Server
from prefixq.cli.redis_server import RedisServer
from prefixq.client import Producer
from prefixq.core.keys import GROUP, Keys
from prefixq.core.settings import Settings
from prefixq.ops.recovery import Recovery
from prefixq.ops.stats import shard_stats

ACT = {"X-Prefixq-Action": "1"}


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """``serve(settings, api_keys=..., extra=[...], command=...)`` -> a started server; all are
    stopped at the end."""
    started: list[Server] = []

    def make(settings: Settings, **kw: Any) -> Server:
        srv = Server(settings, tmp_path / "files", **kw)  # replicas share one files directory
        started.append(srv)
        return srv.start()

    yield make
    for srv in started:
        srv.stop()


def get(srv: Server, path: str, key: str = "", **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(
        srv.root + path, headers={**headers, **kw.pop("headers", {})}, timeout=30, **kw
    )


def post(srv: Server, path: str, key: str = "", body: Any = None, **headers: str) -> httpx.Response:
    h = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(srv.root + path, json=body or {}, headers={**h, **headers}, timeout=30)


def inspect_json(s: Settings, *args: str) -> dict[str, Any]:
    p = cli(s, "inspect", "--json", *args)
    assert p.returncode == 0, p.stderr
    got: dict[str, Any] = json.loads(p.stdout)
    return got


def test_the_apis_shards_and_bursts_are_inspects_objects(
    settings: Settings, fake_worker: Callable[..., FakeWorker], r: redis.Redis, serve: Any
) -> None:
    """Given a finished burst of 10 (3 refused by the engine), /api/shards' shards and sharing
    have inspect --json's keys (and the same counts), /api/bursts/ID's burst is inspect --burst
    ID --json's burst field for field, and /api/snapshot is inspect --json."""
    fake_worker(settings, name="api0")
    reqs = requests(10, lambda i: f"fail:no {i}" if i % 4 == 0 else f"hello {i}")
    burst = Producer(settings).submit(reqs, tenant="team-a")
    wait_burst(r, settings, burst, 20)
    wait_settled(r, settings)
    # admissions are counted at the worker's next heartbeat, which can come after the results
    wait_until(
        lambda: sum(n for n, _ in shard_stats(r, settings, 1)[0]["admitted"].values()) == 10,
        20,
        "the worker's heartbeat to count the 10 admissions",
    )
    srv = serve(settings)

    want = inspect_json(settings, "--burst", burst)
    got = get(srv, "api/shards").json()
    assert got["namespace"] == settings.namespace
    for a, b in zip(got["shards"], want["shards"], strict=True):
        assert a.keys() == b.keys()
        assert [w.keys() for w in a["worker_detail"]] == [w.keys() for w in b["worker_detail"]]
        for k in ("waiting", "pending", "dead_letters", "admitted", "prompt_tokens", "workers"):
            assert a[k] == b[k], k
    # the finished burst's lane closes at the worker's next lane-index refresh and leaves both
    # views then; compare the two once neither is between reads of that moment
    wait_until(
        lambda: get(srv, "api/shards").json()["sharing"] == inspect_json(settings)["sharing"],
        20,
        "the API's fair-share lanes to be inspect's",
    )
    detail = get(srv, f"api/bursts/{burst}").json()
    (inspected,) = want["bursts"]
    assert detail["burst"] == inspected
    assert (inspected["done"], inspected["failed"], inspected["tenant"]) == (7, 3, "team-a")
    assert sum(inspected["histograms"]["end_to_end_s"]) == 7
    summary = detail["summary"]
    assert (summary["status"], summary["progress"], summary["eta_s"]) == ("finished", 1.0, None)
    snap = get(srv, f"api/snapshot?burst={burst}").json()
    assert snap.keys() == want.keys() and snap["bursts"] == want["bursts"]


def test_bursts_are_listed_newest_first_and_filtered_by_status_tenant_and_text(
    settings: Settings, fake_worker: Callable[..., FakeWorker], r: redis.Redis, serve: Any
) -> None:
    """Given a finished burst of team-a, and a cancelled one and a queued one of team-b (no
    worker for them), the filters pick each, counts say how many of each status, and the
    tenants offered are both."""
    with fake_worker(settings, name="api1"):
        done = Producer(settings).submit(requests(3), tenant="team-a", burst_id="done-one")
        wait_burst(r, settings, done, 20)
    gone = Producer(settings).submit(requests(3), tenant="team-b", burst_id="gone-one")
    assert cli(settings, "cancel", gone).returncode == 0
    queued = Producer(settings).submit(requests(2), tenant="team-b", burst_id="waiting-one")
    srv = serve(settings)

    def ids(query: str) -> list[str]:
        return [b["burst"] for b in get(srv, "api/bursts?" + query).json()["bursts"]]

    assert ids("") == [queued, gone, done]
    assert ids("status=active") == [queued]
    assert ids("status=cancelled") == [gone]
    assert ids("tenant=team-b") == [queued, gone]
    assert ids("q=DONE") == [done]
    assert ids("q=team-") == [queued, gone, done]
    assert ids("limit=1") == [queued]
    got = get(srv, "api/bursts").json()
    assert got["counts"] == {"queued": 1, "cancelled": 1, "finished": 1}
    assert got["tenants"] == ["team-a", "team-b"] and got["indexed"] == 3
    row = got["bursts"][0]
    assert (row["status"], row["done"], row["total"], row["requests_per_s"]) == ("queued", 0, 2, 0)


def test_a_key_sees_and_acts_on_its_own_namespace_only_and_actions_need_the_header(
    make_settings: Callable[..., Settings], serve: Any
) -> None:
    """Given keys ka (namespace A, a queued burst) and kb (namespace B, nothing): no key is a
    401 (the session says so with a 200); kb neither lists nor reads nor cancels A's burst;
    ka's cancel is refused without the action header, from another site or origin, and done
    with it."""
    a = make_settings()
    b = make_settings()
    burst = Producer(a).submit(requests(3), burst_id="theirs")
    srv = serve(a, api_keys=f"ka={a.namespace},kb={b.namespace}", host="127.0.0.1")
    assert get(srv, "api/bursts").status_code == 401
    assert get(srv, "api/shards", key="wrong").json()["error"]["code"] == "invalid_api_key"
    assert get(srv, "api/session").json() == {
        "keys": True,
        "authenticated": False,
        "message": get(srv, "api/session").json()["message"],
    }
    assert get(srv, "api/session", key="kb").json()["namespace"] == b.namespace

    assert get(srv, "api/bursts", key="kb").json()["bursts"] == []
    assert get(srv, "api/shards", key="kb").json()["shards"] == []  # no worker there yet
    assert get(srv, f"api/bursts/{burst}", key="kb").status_code == 404
    assert post(srv, f"api/bursts/{burst}/cancel", key="kb", **ACT).status_code == 404
    assert [x["burst"] for x in get(srv, "api/bursts", key="ka").json()["bursts"]] == [burst]

    for headers, code in [
        ({}, "action_header_missing"),
        ({**ACT, "Sec-Fetch-Site": "cross-site"}, "cross_site"),
        ({**ACT, "Origin": "http://evil.example"}, "cross_site"),
    ]:
        resp = post(srv, f"api/bursts/{burst}/cancel", key="ka", **headers)
        assert (resp.status_code, resp.json()["error"]["code"]) == (403, code)
    assert get(srv, f"api/bursts/{burst}", key="ka").json()["burst"]["status"] == "queued"
    assert post(srv, f"api/bursts/{burst}/cancel", key="", **ACT).status_code == 401

    origin = srv.root.rstrip("/")
    resp = post(srv, f"api/bursts/{burst}/cancel", key="ka", Origin=origin, **ACT)
    assert resp.status_code == 200, resp.text
    assert (resp.json()["status"], resp.json()["cancelled"]) == ("cancelled", 3)
    assert get(srv, f"api/bursts/{burst}", key="ka").json()["burst"]["status"] == "cancelled"


def test_read_only_refuses_cancel_and_requeue_and_says_so(settings: Settings, serve: Any) -> None:
    """Given --dashboard-read-only, the session says read-only and cancel and requeue are 403
    (the burst stays queued)."""
    burst = Producer(settings).submit(requests(2))
    srv = serve(settings, extra=["--dashboard-read-only"])
    assert get(srv, "api/session").json()["read_only"] is True
    for path, body in [(f"api/bursts/{burst}/cancel", {}), ("api/dead/requeue", {"all": True})]:
        resp = post(srv, path, body=body, **ACT)
        assert (resp.status_code, resp.json()["error"]["code"]) == (403, "read_only")
    assert get(srv, f"api/bursts/{burst}").json()["burst"]["status"] == "queued"


def test_without_keys_only_requests_for_a_loopback_host_are_answered(
    settings: Settings, serve: Any
) -> None:
    """Given no API keys, a request whose Host is another name (DNS rebinding) is a 403 for the
    page and the API; localhost and 127.0.0.1 are served, the page with its CSP."""
    srv = serve(settings)
    for path in ("", "api/shards", "ui/app.js"):
        resp = get(srv, path, headers={"Host": "evil.example"})
        assert (resp.status_code, resp.json()["error"]["code"]) == (403, "host_not_allowed")
    page = get(srv, "", headers={"Host": f"localhost:{srv.port}"})
    assert page.status_code == 200 and "<main" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert "access-control-allow-origin" not in page.headers
    assert get(srv, "api/shards").status_code == 200


def test_requeue_of_one_dead_letter_runs_its_request_again(
    make_settings: Callable[..., Settings],
    fake_worker: Callable[..., FakeWorker],
    r: redis.Redis,
    serve: Any,
) -> None:
    """Given a request dead-lettered after its one allowed delivery (to a consumer that died),
    /api/dead lists it, requeueing it by id takes its failed result back and a worker serves
    it; a body naming nothing is a 400."""
    s = make_settings(max_attempts=1)
    keys = Keys(s.namespace)
    burst = Producer(s).submit(requests(1))
    r.xgroup_create(keys.stream(0), GROUP, id="0", mkstream=True)  # no worker has joined yet
    assert r.xreadgroup(GROUP, "ghost", {keys.stream(0): ">"}, count=10)
    (rep,) = Recovery(s).reclaim(idle_s=0)
    assert rep.dead == 1
    assert wait_burst(r, s, burst, 5)[0].error_code == "dead_lettered"
    srv = serve(s)
    dead = get(srv, "api/dead").json()
    ((letter,),) = [dead["dead"]]
    assert (letter["burst"], letter["index"], dead["per_shard"]) == (burst, 0, [1])
    assert post(srv, "api/dead/requeue", body={"ids": []}, **ACT).status_code == 400
    huge = post(srv, "api/dead/requeue", body={"ids": ["18446744073709551616-0"]}, **ACT)
    assert huge.status_code == 400 and "is not a dead letter id" in huge.text, huge.text
    fake_worker(s, name="rq0")
    resp = post(srv, "api/dead/requeue", body={"ids": [letter["id"]]}, **ACT)
    assert resp.status_code == 200, resp.text
    assert (resp.json()["requeued"], resp.json()["cleared"]) == (1, 1)
    wait_until(
        lambda: get(srv, f"api/bursts/{burst}").json()["burst"]["done"] == 1, 20, "served again"
    )
    assert get(srv, "api/dead").json()["dead"] == []


def test_what_the_page_cannot_trust_comes_back_as_data_or_an_error(
    settings: Settings, fake_worker: Callable[..., FakeWorker], r: redis.Redis, serve: Any
) -> None:
    """Ids that cannot be bursts are 404s, bad parameters 400s (all in the one error shape);
    HTML in request ids and errors comes back as the same text in JSON; the downloads stream
    both formats, one line per result (prefixq's as `prefixq results` writes them)."""
    fake_worker(settings, name="adv0")
    reqs = [
        {"id": "<img src=x onerror=alert(1)>", "prompt": "fail:<script>alert(2)</script>"},
        {"id": "ok", "prompt": "a b c"},
    ]
    burst = Producer(settings).submit(reqs)
    wait_burst(r, settings, burst, 20)
    srv = serve(settings)
    for path in ("api/bursts/%3Cscript%3E", "api/bursts/a%7Bb%7D", "api/bursts/nope/failed"):
        resp = get(srv, path)
        assert (resp.status_code, resp.json()["error"]["code"]) == (404, "burst_not_found"), path
    for path in (
        "api/bursts?status=bogus",
        "api/bursts?limit=abc",
        "api/history?window_s=5",
        f"api/bursts/{burst}/results?format=xml",
    ):
        resp = get(srv, path)
        assert resp.status_code == 400 and resp.json()["error"]["message"], path
    (bad,) = get(srv, f"api/bursts/{burst}/failed").json()["failed"]
    assert bad["id"] == "<img src=x onerror=alert(1)>"
    assert "<script>alert(2)</script>" in bad["error"]
    plain = get(srv, f"api/bursts/{burst}/results").text.splitlines()
    assert [json.loads(x)["id"] for x in plain] == ["<img src=x onerror=alert(1)>", "ok"]
    assert plain == cli(settings, "results", burst).stdout.splitlines()  # as `prefixq results`
    oai = get(srv, f"api/bursts/{burst}/results?format=openai")
    assert "attachment" in oai.headers["content-disposition"]
    assert [json.loads(x)["custom_id"] for x in oai.text.splitlines()] == [reqs[0]["id"], "ok"]
    # a body Python cannot read (a number past 4,300 digits; too deep): a 400, not a 500
    for body in (b'{"ids": ' + b"1" * 5000 + b"}", b"[" * 100_000 + b"]" * 100_000):
        resp = httpx.post(srv.root + "api/dead/requeue", content=body, headers=ACT, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["message"], resp.text


def test_redis_gone_is_a_503_in_the_error_shape(tmp_path: Path, serve: Any) -> None:
    """Given a server whose Redis stops, /api/shards answers 503 with the reason (the page shows
    it), and the page itself still loads."""
    with RedisServer() as own:
        s = Settings(redis_url=own.url, namespace="gone", shards=1)
        srv = serve(s)
        assert get(srv, "api/shards").status_code == 200
    t0 = time.monotonic()
    resp = get(srv, "api/shards")
    assert resp.status_code == 503, resp.text
    assert "redis" in resp.json()["error"]["message"].lower()
    assert time.monotonic() - t0 < 25
    assert get(srv, "").status_code == 200


def test_prefixq_dashboard_serves_the_page_and_api_without_the_batch_api(
    settings: Settings, serve: Any
) -> None:
    """`prefixq dashboard` answers /, /ui/* and /api/ but no /v1 endpoint; unknown files are
    404s."""
    srv = serve(settings, command="dashboard")
    assert get(srv, "").headers["content-type"].startswith("text/html")
    assert get(srv, "ui/app.js").headers["content-type"].startswith("text/javascript")
    assert get(srv, "ui/secrets.txt").status_code == 404
    assert get(srv, "api/session").json()["namespace"] == settings.namespace
    assert get(srv, "v1/files").status_code == 404
    assert get(srv, "health").status_code == 200
    assert httpx.head(srv.root, timeout=30).status_code == 200  # was a 405


def test_a_quiet_worker_and_a_gone_one_stand_out(
    settings: Settings, fake_worker: Callable[..., FakeWorker], r: redis.Redis, serve: Any
) -> None:
    """Given a live worker, one whose last beat is 10 intervals old (hung: its heartbeat not yet
    expired) and one whose heartbeat expired (killed), /api/shards marks the second quiet and
    lists the third as gone with the age of its last beat."""
    fake_worker(settings, name="alive")
    keys = Keys(settings.namespace)
    now = time.time()
    r.hset(keys.heartbeat(0, "hung"), mapping={"inflight": 3, "beat": now - 10, "every_s": 1.0})
    r.zadd(keys.workers(0), {"hung": now - 10, "killed": now - 120})
    srv = serve(settings)
    (shard,) = get(srv, "api/shards").json()["shards"]
    quiet = {w["name"]: w["quiet"] for w in shard["worker_detail"]}
    assert quiet == {"alive": False, "hung": True}
    ((gone,),) = [shard["workers_gone"]]
    assert gone["name"] == "killed" and 119 < gone["last_beat_age_s"] < 200


def test_a_bursts_results_or_events_of_another_type_leave_the_rest_shown(
    settings: Settings, fake_worker: Callable[..., FakeWorker], r: redis.Redis, serve: Any
) -> None:
    """Given a finished burst whose results hash and events stream hold strings (anything with
    write access may write one), inspect and the dashboard show the rest and name what they
    could not read; the results download is a 404 saying why before any line. Before: inspect
    failed as a whole (WRONGTYPE), /api/snapshot, /api/bursts/ID and /failed were 500s, and the
    download a 200 with an empty body cut short."""
    fake_worker(settings, name="wt0")
    burst = Producer(settings).submit(requests(4))
    wait_burst(r, settings, burst, 20)
    keys = Keys(settings.namespace)
    for key in (keys.results(burst), keys.events(burst)):
        r.delete(key)
        r.set(key, "garbage")
    srv = serve(settings)
    snap = inspect_json(settings)
    (b,) = [x for x in snap["bursts"] if x["burst"] == burst]
    assert b["done"] == 4 and b["results"] == 0
    assert any(f"burst {burst}'s results not shown" in p for p in snap["problems"])
    got = get(srv, "api/snapshot")
    assert got.status_code == 200 and got.json()["problems"]
    one = get(srv, f"api/bursts/{burst}")
    assert one.status_code == 200 and one.json()["burst"]["done"] == 4
    assert len(one.json()["problems"]) == 2, one.json()["problems"]
    failed = get(srv, f"api/bursts/{burst}/failed")
    assert failed.status_code == 200 and not failed.json()["complete"]
    assert failed.json()["problems"]
    dl = get(srv, f"api/bursts/{burst}/results")
    assert dl.status_code == 404 and "not a hash" in dl.json()["error"]["message"]
