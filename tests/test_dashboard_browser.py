"""The dashboard in a real headless Chromium (Debian's `chromium`, driven by playwright), against
a real Redis: the session's real CPU workers (`engines`) for a burst that runs, fake-engine
workers where a test needs a burst that waits (to cancel it) or a dead letter (to requeue it).
Each test writes a screenshot of what it saw under its tmp dir. One browser for the module.

Locally a missing chromium skips these tests; in CI it fails them (./dev setup installs it).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from playwright.sync_api import Browser, Page, expect, sync_playwright

from helpers import FakeWorker, requests, wait_burst
from openai_server import Server
from prefixq.cli.redis_server import RedisServer
from prefixq.client import Producer
from prefixq.core.keys import GROUP, Keys
from prefixq.core.settings import Settings
from prefixq.ops.recovery import Recovery

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
#: what a headless Chromium needs here (as root: no sandbox) and nothing that calls out
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
TIMEOUT_MS = 30_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    path = shutil.which("chromium")
    if path is None:
        if IN_CI:
            pytest.fail("chromium is not installed (./dev setup installs it)")
        pytest.skip("chromium not on PATH")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=ARGS)
        yield b
        b.close()


class Tab:
    """A page in its own browser context, with the console errors and dialogs it met."""

    def __init__(self, browser: Browser, width: int = 1366) -> None:
        self.context = browser.new_context(viewport={"width": width, "height": 900})
        self.page: Page = self.context.new_page()
        self.page.set_default_timeout(TIMEOUT_MS)
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))

        def dialog(d: Any) -> None:
            self.dialogs.append(d.message)
            d.accept()

        self.page.on("dialog", dialog)

    def fetch(self, path: str, method: str = "GET", **headers: str) -> int:
        """The status of a fetch the page itself makes (same origin, as the page's code)."""
        got: int = self.page.evaluate(
            "([p, m, h]) => fetch(p, {method: m, headers: h}).then((r) => r.status)",
            [path, method, headers],
        )
        return got

    def shot(self, path: Path) -> None:
        # a frame of a page that updates as it polls: on a loaded 2-core machine (engines and
        # the suite's other workers) the renderer took over 30 s to give one, once
        self.page.screenshot(path=str(path), full_page=True, timeout=120_000)
        assert path.stat().st_size > 10_000


@pytest.fixture
def tab(browser: Browser) -> Iterator[Callable[..., Tab]]:
    made: list[Tab] = []

    def make(width: int = 1366) -> Tab:
        made.append(Tab(browser, width))
        return made[-1]

    yield make
    for t in made:
        t.context.close()


@pytest.fixture
def serve(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., Server]]:
    started: list[Server] = []

    def make(settings: Settings, **kw: Any) -> Server:
        # one files directory per namespace: the shared engine deployment's namespace has the
        # session's (its servers refuse another: prefixq/openai/files_volume.py)
        files = tmp_path / "files"
        if "engines" in request.fixturenames:
            engines = request.getfixturevalue("engines")
            if settings.namespace == engines.settings.namespace:
                files = request.getfixturevalue("engines_files")
        started.append(Server(settings, files, **kw))
        return started[-1].start()

    yield make
    for srv in started:
        srv.stop()


def no_overflow(page: Page) -> None:
    """The page is no wider than the window (wide tables scroll inside their panel)."""
    width = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert width <= 0, f"the page is {width}px wider than the window"


def dead_letter(r: redis.Redis, s: Settings) -> str:
    """A one-request burst whose request is dead-lettered after its one allowed delivery (to a
    consumer that died): the id of its dead letter (``s`` has max_attempts=1)."""
    keys = Keys(s.namespace)
    Producer(s).submit(requests(1), burst_id="dl-burst")
    r.xgroup_create(keys.stream(0), GROUP, id="0", mkstream=True)
    assert r.xreadgroup(GROUP, "ghost", {keys.stream(0): ">"}, count=10)
    (rep,) = Recovery(s).reclaim(idle_s=0)
    assert rep.dead == 1
    return str(r.xrange(keys.dead(0))[0][0].decode())


@pytest.mark.engine
def test_a_running_burst_appears_its_progress_rises_and_its_page_shows_percentiles(
    engines: Any, r: redis.Redis, tab: Callable[..., Tab], serve: Any, tmp_path: Path
) -> None:
    """Given the real CPU workers and a burst of 80 requests of different lengths submitted
    while the overview is open, the burst appears running part done, its progress bar's value
    rises between two looks, the page logs no error; its page then shows the three stages'
    percentiles once finished."""
    s = engines.settings
    srv = serve(s)
    t = tab(1366)
    t.page.goto(srv.root)
    # the overview's first load: its reads wait for the CPU engines' cores (5 s was not enough
    # once in a loaded full run)
    expect(t.page.locator("#shards-body table").first).to_be_visible(timeout=30_000)
    # lengths from 8 to 176 tokens: the engine batches them all, so the short ones finish
    # long before the long ones and the burst stays running for a while
    reqs = [
        {"id": f"b{i}", "prompt": f"Tell a story about the number {i}.",
         "max_tokens": 8 + 24 * (i % 8), "ignore_eos": True, "temperature": 0}
        for i in range(80)
    ]  # fmt: skip
    burst = Producer(s).submit(reqs, tenant="browser")
    row = t.page.locator("#bursts-body tr", has=t.page.get_by_role("link", name=burst))
    bar = row.get_by_role("progressbar")
    value = (
        "(b) => Number(document.querySelector(`a[href=\"#/burst/${b}\"]`)?.closest('tr')"
        "?.querySelector('[role=progressbar]')?.getAttribute('aria-valuenow') ?? 0)"
    )
    t.page.wait_for_function(f"([b, n]) => {{ const v = ({value})(b); return v > 0 && v < n; }}",
                             arg=[burst, len(reqs)], timeout=300_000)  # fmt: skip
    first = int(bar.get_attribute("aria-valuenow") or 0)
    expect(row.locator(".badge")).to_have_text("▶ running")
    t.page.wait_for_function(f"([b, n]) => ({value})(b) > n", arg=[burst, first], timeout=300_000)
    assert int(bar.get_attribute("aria-valuenow") or 0) > first
    t.shot(tmp_path / "overview-running.png")
    no_overflow(t.page)

    row.get_by_role("link", name=burst).click()
    expect(t.page.locator("#burst-head .badge")).to_have_text("✓ finished", timeout=300_000)
    pct = t.page.locator("table.percentiles tbody tr")
    expect(pct).to_have_count(3)
    for i in range(3):
        cells = pct.nth(i).locator("td")
        assert all(cells.nth(c).inner_text() not in ("\u2013", "0") for c in range(1, 5)), i
    expect(t.page.locator("#histograms figure")).to_have_count(3)
    t.shot(tmp_path / "burst.png")
    assert t.errors == []


def test_cancel_and_requeue_work_with_a_key_and_are_refused_without_one(
    make_settings: Callable[..., Settings],
    fake_worker: Callable[..., FakeWorker],
    r: redis.Redis,
    tab: Callable[..., Tab],
    serve: Any,
    tmp_path: Path,
) -> None:
    """Given a server with keys, a dead letter and a burst of slow requests: the page asks for
    the key, shows the namespace; cancel on the burst's page cancels it; requeue on the dead
    letter requeues it; without the key the page's own POSTs are 401, and with it but without
    the action header 403."""
    s = make_settings(max_attempts=1, heartbeat_s=0.2, history_every_s=0.5)
    dead_id = dead_letter(r, s)
    fake_worker(s, name="ui0")  # room for 8: the slow 6 leave room for the requeued one
    slow = Producer(s).submit(  # one quick request makes it running; five stay in the engine
        requests(6, lambda i: f"sleep:60 q{i}" if i else "quick"), tenant="slow-team"
    )
    srv = serve(s, api_keys=f"sekrit={s.namespace}")

    anon = tab()
    anon.page.goto(srv.root)
    expect(anon.page.get_by_role("heading", name="API key")).to_be_visible()
    assert anon.fetch(f"api/bursts/{slow}/cancel", "POST", **{"X-Prefixq-Action": "1"}) == 401
    assert anon.fetch("api/dead/requeue", "POST", **{"X-Prefixq-Action": "1"}) == 401

    t = tab(1280)
    t.page.goto(srv.root)
    t.page.get_by_label("Key").fill("sekrit")
    t.page.get_by_role("button", name="Show").click()
    expect(t.page.locator("#ns")).to_have_text(f"namespace {s.namespace}")
    expect(t.page.get_by_role("link", name=slow)).to_be_visible()
    expect(t.page.locator("#dead-body")).to_contain_text(dead_id)
    no_overflow(t.page)
    t.shot(tmp_path / "overview-keys.png")
    auth = {"Authorization": "Bearer sekrit"}
    assert anon.fetch(f"api/bursts/{slow}/cancel", "POST", **auth) == 403  # no action header

    t.page.locator("#dead-body").get_by_role("button", name="requeue", exact=True).click()
    expect(t.page.locator("#dead-note")).to_contain_text("requeued 1")
    wait_burst(r, s, "dl-burst", 20)
    assert [x.error for x in wait_burst(r, s, "dl-burst", 20)] == [None]

    t.page.get_by_role("link", name=slow).click()
    expect(t.page.locator("#burst-head .badge")).to_have_text("▶ running")
    t.page.get_by_role("button", name="Cancel burst").click()
    # the cancel's POST, then the page's next poll: beyond expect's 5 s on a loaded machine (a
    # full suite of three processes beside vLLM CPU workers once took longer)
    expect(t.page.locator("#burst-head .badge")).to_have_text("✕ cancelled", timeout=20_000)
    assert any(slow in d for d in t.dialogs)
    expect(t.page.locator("#burst-note")).to_contain_text("5 requests cancelled")
    expect(t.page.locator("#failed-body")).to_contain_text("cancelled")
    t.shot(tmp_path / "burst-cancelled.png")
    assert int(r.hget(Keys(s.namespace).burst(slow), "cancelled") or 0) == 5
    assert t.errors == []


def test_read_only_hides_the_actions_and_refuses_them(
    make_settings: Callable[..., Settings],
    r: redis.Redis,
    tab: Callable[..., Tab],
    serve: Any,
    tmp_path: Path,
) -> None:
    """Given --dashboard-read-only, a queued burst and a dead letter: the page says read-only,
    shows neither cancel nor requeue, and the page's own POSTs are 403."""
    s = make_settings(max_attempts=1)
    dead_id = dead_letter(r, s)
    queued = Producer(s).submit(requests(3), burst_id="ro-queued")
    srv = serve(s, extra=["--dashboard-read-only"])
    t = tab(760)
    t.page.goto(srv.root)
    expect(t.page.locator("#mode")).to_contain_text("read-only")
    expect(t.page.locator("#dead-body")).to_contain_text(dead_id)
    expect(t.page.locator("#dead-body button")).to_have_count(0)
    no_overflow(t.page)
    t.shot(tmp_path / "overview-read-only-narrow.png")
    t.page.goto(srv.root + f"#/burst/{queued}")
    expect(t.page.locator("#burst-head .badge")).to_have_text("◌ queued")
    expect(t.page.get_by_role("button", name="Cancel burst")).to_have_count(0)
    act = {"X-Prefixq-Action": "1"}
    assert t.fetch(f"api/bursts/{queued}/cancel", "POST", **act) == 403
    assert len(t.errors) == 1 and "403" in t.errors[0], t.errors  # that refused fetch only


def test_html_in_ids_and_errors_is_text_and_a_bad_burst_id_says_so(
    settings: Settings,
    fake_worker: Callable[..., FakeWorker],
    r: redis.Redis,
    tab: Callable[..., Tab],
    serve: Any,
    tmp_path: Path,
) -> None:
    """Given a failed request whose id and error are HTML, its burst's page shows them as text
    (no element made, no script run); a burst id that does not exist gets a message, not a
    blank page."""
    fake_worker(settings, name="x0")
    reqs = [
        {"id": "<img src=x onerror=alert(1)>", "prompt": "fail:<b id=injected>bold</b>"},
        {"id": "fine", "prompt": "a b"},
    ]
    burst = Producer(settings).submit(reqs, burst_id="html-burst")
    wait_burst(r, settings, burst, 20)
    srv = serve(settings)
    t = tab()
    t.page.goto(srv.root + f"#/burst/{burst}")
    expect(t.page.locator("#failed-body")).to_contain_text("<img src=x onerror=alert(1)>")
    expect(t.page.locator("#failed-body")).to_contain_text("<b id=injected>bold</b>")
    assert t.page.locator("#injected, img").count() == 0 and t.dialogs == []
    t.page.goto(srv.root + "#/burst/%3Cscript%3Ealert(3)%3C%2Fscript%3E")
    expect(t.page.locator("#burst-body .error")).to_contain_text("No such burst")
    expect(t.page.locator("#burst-head h1")).to_have_text("<script>alert(3)</script>")
    t.shot(tmp_path / "burst-unknown.png")
    assert t.dialogs == []


def test_redis_gone_shows_an_error_over_the_last_figures_not_a_blank_page(
    tab: Callable[..., Tab], serve: Any, tmp_path: Path
) -> None:
    """Given the overview open and then Redis stopped, a banner says Redis cannot be reached
    and when the figures are from, and the tables stay."""
    with RedisServer() as own:
        s = Settings(redis_url=own.url, namespace="gone", shards=1)
        Producer(s).submit(requests(2), burst_id="before-the-fall")
        srv = serve(s)
        t = tab()
        t.page.goto(srv.root)
        # the bursts' table comes with the page's second read (seconds on a loaded machine)
        expect(t.page.get_by_role("link", name="before-the-fall")).to_be_visible(timeout=30_000)
    banner = t.page.get_by_role("alert")
    expect(banner).to_contain_text("Redis cannot be reached", timeout=60_000)
    expect(banner).to_contain_text("The figures below are from")
    expect(t.page.get_by_role("link", name="before-the-fall")).to_be_visible()
    t.shot(tmp_path / "overview-redis-gone.png")


def test_an_orphaned_shards_moved_queue_and_each_workers_share_are_shown(
    make_settings: Callable[..., Settings],
    fake_worker: Callable[..., FakeWorker],
    tab: Callable[..., Tab],
    serve: Any,
    tmp_path: Path,
) -> None:
    """Given 3 shards, a burst queued on all three, and workers on shards 0 and 1 only: shard 2's
    queue moves once it is orphaned; the overview marks shard 2 and lists the orphaned moves, and
    the burst's page shows each worker's results, which add up to the burst."""
    s = make_settings(shards=3, placement="hash", heartbeat_s=0.2, orphan_after_s=1.0)
    docs = [{**q, "prefix": f"document {i % 9} " * 40} for i, q in enumerate(requests(36))]
    burst = Producer(s).submit(docs)  # no shard live yet: every shard takes its share
    fake_worker(s, name="fleet-a", shard=0)
    fake_worker(s, name="fleet-b", shard=1)
    assert burst.wait(timeout=60).done == 36
    srv = serve(s)
    t = tab(1366)
    t.page.goto(srv.root)
    moves = t.page.locator("#shards-body table.moves tbody tr", has_text="orphaned")
    expect(moves).to_have_count(1, timeout=15_000)
    shard2 = t.page.locator("#shards-body table").first.locator("tbody tr").nth(2)
    expect(shard2).to_contain_text("✕ none: queue moving")
    t.page.goto(f"{srv.root}#/burst/{burst.id}")
    rows = t.page.locator("table.burst-workers tbody tr")
    expect(rows).to_have_count(2, timeout=15_000)
    counts = [int(rows.nth(i).locator("td").nth(1).inner_text()) for i in range(2)]
    assert sum(counts) == 36 and min(counts) > 0, counts
    t.shot(tmp_path / "fleet.png")
    no_overflow(t.page)
    assert t.errors == []
