"""Webhooks as OpenAI sends them: the endpoints configured per namespace (`WebhookConfig`, from
the ``webhooks`` setting), the event objects (`event_body`), their Standard Webhooks signature
(`signed_headers`) and the retry schedule (`retry_delay`). No I/O beyond reading ``@PATH``.

The setting is JSON, or ``@PATH`` of a JSON file: namespace -> ``{"secret": "whsec_...",
"endpoints": [{"url": ..., "secret": ..., "events": [...]}]}``. An endpoint without a secret
uses its namespace's; ``events`` defaults to every batch event. The namespace's secret also signs
the ``on_complete_url`` deliveries of its bursts. docs/operations.md, "Receiving webhooks", has
the format, the signature and the schedule; the outbox is prefixq.store.webhook_outbox.

The signature is the one OpenAI's client checks (``client.webhooks.unwrap``): headers
``webhook-id`` (the same on every retry), ``webhook-timestamp`` (epoch seconds of this attempt,
within 5 minutes of the receiver's clock) and ``webhook-signature`` = ``v1,`` + base64 of
HMAC-SHA256 over ``{id}.{timestamp}.{body}``, keyed with the base64-decoded secret after
``whsec_``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import random
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from prefixq.core.errors import ConfigError, ValidationError

__all__ = [
    "EVENTS",
    "Endpoint",
    "NamespaceHooks",
    "WebhookConfig",
    "check_url",
    "event_body",
    "new_delivery_id",
    "retry_delay",
    "signed_headers",
]

#: the event types, one per final status of a batch (OpenAI's names)
EVENTS = ("batch.completed", "batch.failed", "batch.expired", "batch.cancelled")
_PREFIX = "whsec_"


def check_url(url: Any, what: str = "url") -> str:
    """An ``http(s)://host[:port]...`` URL that can be posted to; ValidationError otherwise (a
    port that is not a number from 1 to 65535, whitespace or control characters, an unclosed
    ``[`` IPv6 host), so no delivery is ever queued for an address no attempt can reach."""
    try:
        parts = urlsplit(url) if isinstance(url, str) else None
        ok = (
            parts is not None
            and parts.scheme in ("http", "https")
            and bool(parts.hostname)
            and parts.port != 0  # reading it checks it: ValueError when not 0-65535
            and not any(c <= " " or c == "\x7f" for c in url)
        )
    except ValueError:
        ok = False
    if not ok:
        raise ValidationError(f"{what} must be an http:// or https:// URL, not {url!r}")
    return str(url)


def _secret(value: Any, where: str) -> bytes:
    """The key bytes of a ``whsec_<base64>`` secret (never shown in an error)."""
    if not isinstance(value, str) or not value.startswith(_PREFIX):
        raise ConfigError(f"webhooks: {where}: the secret must be 'whsec_' and base64")
    try:
        key = base64.b64decode(value[len(_PREFIX) :], validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(f"webhooks: {where}: the secret after 'whsec_' is not base64") from None
    if len(key) < 16:
        raise ConfigError(f"webhooks: {where}: the secret must hold at least 16 bytes")
    return key


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One receiver of a namespace's batch events."""

    url: str
    key: bytes
    events: frozenset[str]

    def __repr__(self) -> str:  # the key stays out of logs and tracebacks
        return f"Endpoint(url={self.url!r}, events={sorted(self.events)})"


@dataclass(frozen=True, slots=True)
class NamespaceHooks:
    """A namespace's endpoints, and its own key (signs its bursts' ``on_complete_url``)."""

    key: bytes | None
    endpoints: tuple[Endpoint, ...]

    def __repr__(self) -> str:
        return f"NamespaceHooks(endpoints={list(self.endpoints)})"

    def wanting(self, event: str) -> list[Endpoint]:
        """The endpoints that take ``event``."""
        return [e for e in self.endpoints if event in e.events]

    def key_for(self, url: str) -> bytes | None:
        """The key that signs a delivery to ``url``: its endpoint's, else the namespace's."""
        for e in self.endpoints:
            if e.url == url:
                return e.key
        return self.key


_NONE = NamespaceHooks(None, ())


@dataclass(frozen=True, slots=True)
class WebhookConfig:
    """Every namespace's webhooks (`NamespaceHooks`), parsed from the ``webhooks`` setting."""

    namespaces: dict[str, NamespaceHooks]

    @classmethod
    def parse(cls, spec: str) -> WebhookConfig:
        """Parse the setting (JSON or ``@PATH``); ConfigError saying what is wrong."""
        spec = spec.strip()
        if not spec:
            return cls({})
        if spec.startswith("@"):
            path = Path(spec[1:]).expanduser()
            try:
                spec = path.read_text(encoding="utf-8")
            except OSError as e:
                raise ConfigError(f"webhooks: cannot read {path}: {e.strerror}") from None
            except UnicodeDecodeError:
                raise ConfigError(f"webhooks: {path} is not UTF-8 text") from None
        try:
            raw = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ConfigError(f"webhooks: not JSON ({e.msg}, line {e.lineno})") from None
        except RecursionError:
            raise ConfigError("webhooks: not JSON (nested too deep)") from None
        if not isinstance(raw, dict):
            raise ConfigError("webhooks: expected a JSON object of namespace -> settings")
        return cls({ns: _namespace(ns, v) for ns, v in raw.items()})

    def of(self, namespace: str) -> NamespaceHooks:
        """The namespace's webhooks (none configured: no endpoints, no key)."""
        return self.namespaces.get(namespace, _NONE)


def _namespace(ns: str, raw: Any) -> NamespaceHooks:
    if not isinstance(raw, dict) or set(raw) - {"secret", "endpoints"}:
        raise ConfigError(f"webhooks: {ns!r}: expected an object with 'secret' and 'endpoints'")
    key = _secret(raw["secret"], f"{ns!r}") if "secret" in raw else None
    items = raw.get("endpoints", [])
    if not isinstance(items, list):
        raise ConfigError(f"webhooks: {ns!r}: 'endpoints' must be a list")
    out: list[Endpoint] = []
    for i, e in enumerate(items):
        where = f"{ns!r} endpoint {i + 1}"
        if not isinstance(e, dict) or "url" not in e or set(e) - {"url", "secret", "events"}:
            raise ConfigError(f"webhooks: {where}: expected 'url', 'secret' and 'events'")
        try:
            url = check_url(e["url"])
        except ValidationError as err:
            raise ConfigError(f"webhooks: {where}: {err}") from None
        if any(x.url == url for x in out):
            raise ConfigError(f"webhooks: {where}: {url!r} is listed twice")
        ekey = _secret(e["secret"], where) if "secret" in e else key
        if ekey is None:
            raise ConfigError(f"webhooks: {where}: no secret (its own, or the namespace's)")
        events = e.get("events", list(EVENTS))
        if (
            not isinstance(events, list)
            or not events
            or not all(isinstance(x, str) and x in EVENTS for x in events)
        ):
            raise ConfigError(f"webhooks: {where}: 'events' must list some of {', '.join(EVENTS)}")
        out.append(Endpoint(url, ekey, frozenset(events)))
    return NamespaceHooks(key, tuple(out))


def event_body(event: str, object_id: str, created_at: float, event_id: str = "") -> str:
    """OpenAI's event object as the JSON text sent (the same bytes on every retry)."""
    return json.dumps(
        {
            "id": event_id or "evt_" + secrets.token_hex(12),
            "object": "event",
            "type": event,
            "created_at": int(created_at),
            "data": {"id": object_id},
        },
        separators=(",", ":"),
    )


def new_delivery_id(*parts: str) -> str:
    """A delivery's ``webhook-id``: random, or derived from ``parts`` (a burst's event: every
    process that sees the burst end derives the same one, so it is queued once)."""
    if not parts:
        return "wh_" + secrets.token_hex(12)
    return "wh_" + hashlib.blake2b("\0".join(parts).encode(), digest_size=12).hexdigest()


def signed_headers(key: bytes, delivery_id: str, timestamp: int, body: str) -> dict[str, str]:
    """The Standard Webhooks headers of one attempt."""
    mac = hmac.new(key, f"{delivery_id}.{timestamp}.{body}".encode(), hashlib.sha256).digest()
    return {
        "webhook-id": delivery_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": "v1," + base64.b64encode(mac).decode(),
        "content-type": "application/json",
    }


def retry_delay(
    attempts: int, base_s: float, max_s: float, rng: random.Random | None = None
) -> float:
    """Seconds before the next attempt after ``attempts`` failed ones: ``base_s * 2**(n-1)``,
    at most ``max_s``, times a jitter in [0.5, 1]."""
    step = min(max_s, base_s * 2 ** min(attempts - 1, 60))
    return float(step * (0.5 + 0.5 * (rng or random).random()))
