"""The deliverer: sends the webhook outbox's due deliveries (prefixq.store.webhook_outbox), signed
as Standard Webhooks says (prefixq.core.webhooks), and retries the failed ones.

It runs as a task of its own in every ``prefixq serve`` (the namespaces it serves) and every
``prefixq worker`` given webhooks (its namespace: prefixq.integrations.webhooks), so bursts
submitted from Python or RQ get their ``on_complete_url`` called with no server running. Any number
of deliverers share an outbox: each claims what it sends (held past one attempt), so every
delivery is sent once while they live, and again (at least once) only after one died mid-attempt.

An attempt is an HTTP POST of the event's JSON with the headers ``webhook-id`` (the delivery's id,
the same on every retry), ``webhook-timestamp`` and ``webhook-signature``, taking at most
``webhook_timeout_s``; a 2xx answer delivers it. A network error or any other answer retries it
after ``webhook_retry_base_s * 2**(attempts-1)`` seconds (at most ``webhook_retry_max_s``, times a
jitter in [0.5, 1]) until ``webhook_retry_window_s`` (72 h) after its event: the first attempt
that fails past that gives up, with an error log line and the ``gave_up`` counter. At most
``webhook_concurrency`` attempts run at once; the batch sweeper never waits for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx
import redis.asyncio as aredis

from prefixq.core.errors import PrefixqError
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.core.webhooks import NamespaceHooks, WebhookConfig, retry_delay, signed_headers
from prefixq.store.connection import raise_if_cancelled
from prefixq.store.redis_errors import TRANSIENT
from prefixq.store.webhook_outbox import Delivery, claim, settle, sweep_bursts

__all__ = ["Deliverer", "delivering"]

log = logging.getLogger(__name__)

#: seconds between looks at the outboxes while nothing is due
LOOK_EVERY_S = 0.5
#: seconds between looks at the bursts with an on_complete_url that may have ended unseen
WATCH_EVERY_S = 2.0


def _where(url: str) -> str:
    """A URL as logged: no query string or user info (either may hold a token)."""
    try:
        p = urlsplit(url)
        return f"{p.scheme}://{p.hostname}{':' + str(p.port) if p.port else ''}{p.path}"
    except ValueError:  # not a URL (an outbox record written before check_url refused it)
        return "<malformed URL>"


async def _post(http: httpx.AsyncClient, url: str, body: bytes, headers: dict[str, str]) -> int:
    """POST ``body``; the answer's status. Its body is never read: the status says whether the
    event was taken, and a receiver that answers with gigabytes must not fill this process."""
    async with http.stream("POST", url, content=body, headers=headers) as resp:
        return resp.status_code


class Deliverer:
    """Sends the due webhook deliveries of ``namespaces`` until cancelled (`run`)."""

    def __init__(self, r: aredis.Redis, settings: Settings, namespaces: list[str]) -> None:
        self.r, self.settings = r, settings
        config = WebhookConfig.parse(settings.webhooks)
        #: the namespaces configured here (another's deliveries wait for a process that has them)
        self.hooks = {ns: h for ns in namespaces if (h := config.of(ns)).key or h.endpoints}
        #: how long a claim holds: past one attempt, with room for a slow Redis
        self.hold_s = 2 * settings.webhook_timeout_s + 5.0
        self.tasks: set[asyncio.Task[None]] = set()
        self._watch_due = 0.0
        #: set when an attempt ends: look again at once (a backlog drains at full concurrency)
        self._freed = asyncio.Event()

    async def run(self, every: float = LOOK_EVERY_S) -> None:
        """Claim and send for ever, riding out Redis outages: a look every ``every`` seconds, and
        one as soon as an attempt ends; cancel to stop (attempts in flight are cancelled too:
        their claims run out and another deliverer retries them)."""
        timeout = httpx.Timeout(self.settings.webhook_timeout_s)
        async with httpx.AsyncClient(timeout=timeout, follow_redirects=False) as http:
            try:
                while True:
                    try:
                        await self.look(http)
                    except (*TRANSIENT, PrefixqError) as e:
                        log.warning("looking for due webhooks failed: %s", e)
                    except Exception:  # never lose the deliverer: it is what retries
                        log.exception("looking for due webhooks failed")
                    raise_if_cancelled()
                    with contextlib.suppress(TimeoutError):  # or as soon as a slot is free
                        await asyncio.wait_for(self._freed.wait(), every)
                    self._freed.clear()
            finally:
                for t in list(self.tasks):
                    t.cancel()
                await asyncio.gather(*self.tasks, return_exceptions=True)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        self._freed.set()

    async def look(self, http: httpx.AsyncClient) -> int:
        """One look at every outbox: queue the events of watched bursts that ended (every
        `WATCH_EVERY_S`), claim what is due, up to the free attempt slots, and start an attempt
        for each; returns how many were started."""
        if time.monotonic() >= self._watch_due:
            self._watch_due = time.monotonic() + WATCH_EVERY_S
            for ns in self.hooks:
                await sweep_bursts(self.r, self.settings.replace(namespace=ns))
        started = 0
        for ns, hooks in self.hooks.items():
            free = self.settings.webhook_concurrency - len(self.tasks)
            if free <= 0:
                break
            keys = Keys(ns)
            for d in await claim(self.r, keys, free, self.hold_s):
                task = asyncio.create_task(self._attempt(http, keys, hooks, d))
                self.tasks.add(task)
                task.add_done_callback(self._done)
                started += 1
        return started

    async def _attempt(
        self, http: httpx.AsyncClient, keys: Keys, hooks: NamespaceHooks, d: Delivery
    ) -> None:
        try:
            error = await self._send(http, hooks, d)
            await self._settle(keys, d, error)
        except (*TRANSIENT, PrefixqError) as e:  # the claim runs out: it is retried
            log.warning("webhook %s: recording its attempt failed: %s", d.id, e)
        except Exception:  # never lose the loop to one delivery
            log.exception("webhook %s: attempt failed", d.id)

    async def _send(self, http: httpx.AsyncClient, hooks: NamespaceHooks, d: Delivery) -> str:
        """POST it once; "" when delivered, else why not."""
        key = hooks.key_for(d.url)
        if key is None:
            return "no signing secret for its namespace in the webhooks setting"
        headers = signed_headers(key, d.id, int(time.time()), d.body)
        headers["user-agent"] = "prefixq-webhooks"
        limit = self.settings.webhook_timeout_s
        try:
            # httpx's timeout bounds each read and write, not the attempt: a receiver that
            # trickles its answer would hold the attempt past its claim (and be sent it again)
            status = await asyncio.wait_for(_post(http, d.url, d.body.encode(), headers), limit)
        except TimeoutError:
            return f"no answer within webhook_timeout_s ({limit:g} s)"
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as e:  # a URL no attempt can reach
            return f"{type(e).__name__}: {e}"[:300]
        if 200 <= status < 300:
            return ""
        return f"HTTP {status}"

    async def _settle(self, keys: Keys, d: Delivery, error: str) -> None:
        s = self.settings
        if not error:
            await settle(self.r, keys, d, "delivered")
            log.info("webhook %s delivered to %s (attempt %d)", d.id, _where(d.url), d.attempts + 1)
            return
        d.attempts += 1
        d.error = error
        now = time.time()
        if now - d.first >= s.webhook_retry_window_s:
            if await settle(self.r, keys, d, "gave_up"):
                log.error(
                    "webhook %s to %s: gave up after %d attempts over %.1f h: %s",
                    d.id,
                    _where(d.url),
                    d.attempts,
                    (now - d.first) / 3600,
                    error,
                )
            return
        delay = retry_delay(d.attempts, s.webhook_retry_base_s, s.webhook_retry_max_s)
        if await settle(self.r, keys, d, "retried", now + delay):
            log.warning(
                "webhook %s to %s: attempt %d failed (%s); retried in %.1f s",
                d.id,
                _where(d.url),
                d.attempts,
                error,
                delay,
            )


@contextlib.asynccontextmanager
async def delivering(
    r: aredis.Redis, settings: Settings, namespaces: list[str]
) -> AsyncIterator[Deliverer]:
    """A `Deliverer` running as a task while the block runs (cancelled at its end); none runs
    when the settings configure none of ``namespaces``."""
    d = Deliverer(r, settings, namespaces)
    if not d.hooks:
        yield d
        return
    task = asyncio.create_task(d.run())
    try:
        yield d
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
