"""Bearer API keys: which keys the server accepts and which namespace each one works in.

The ``api_keys`` setting is a comma-separated list of ``KEY`` or ``KEY=NAMESPACE`` entries, or
``@PATH``: a file with one entry a line (blank lines and ``#`` comments skipped). A key without a
namespace works in the server's ``namespace``. With no keys at all, any bearer token (or none) is
accepted and the server must listen on a loopback address only.

A key's batches and files live in its namespace (a prefixq namespace: its bursts go to that
namespace's workers); another namespace's objects do not exist for it (404).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from dataclasses import dataclass
from pathlib import Path

from prefixq.core.errors import ConfigError
from prefixq.core.settings import Settings
from prefixq.openai.apierror import ApiError

__all__ = ["KeyRing", "host_name", "is_loopback"]

log = logging.getLogger(__name__)


def _entries(spec: str) -> list[str]:
    spec = spec.strip()
    if spec.startswith("@"):
        path = Path(spec[1:]).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"api_keys: cannot read {path}: {e.strerror}") from None
        lines = (ln.split("#", 1)[0].strip() for ln in text.splitlines())
        return [ln for ln in lines if ln]
    return [e.strip() for e in spec.split(",") if e.strip()]


@dataclass(frozen=True, slots=True)
class KeyRing:
    """The accepted keys (key -> namespace) and the namespace of key-less access."""

    keys: tuple[tuple[str, str], ...]
    default_namespace: str

    @classmethod
    def from_settings(cls, settings: Settings) -> KeyRing:
        """Parse ``settings.api_keys``; ConfigError on a malformed entry or namespace."""
        pairs: list[tuple[str, str]] = []
        for entry in _entries(settings.api_keys):
            key, _, ns = entry.partition("=")
            key, ns = key.strip(), ns.strip() or settings.namespace
            if not key or any(c.isspace() for c in key):
                raise ConfigError("api_keys: an empty key, or a key with spaces")
            settings.replace(namespace=ns)  # the same checks as any namespace (ConfigError)
            pairs.append((key, ns))
        if len({k for k, _ in pairs}) != len(pairs):
            raise ConfigError("api_keys: the same key is listed twice")
        return cls(tuple(pairs), settings.namespace)

    @property
    def open(self) -> bool:
        """True when no key is configured: every caller is let in (loopback only)."""
        return not self.keys

    @property
    def namespaces(self) -> list[str]:
        """Every namespace a caller can work in (the server's first)."""
        out = [self.default_namespace]
        out += [ns for _, ns in self.keys if ns not in out]
        return out

    def guard_host(self, host_header: str | None) -> None:
        """Without keys the server answers requests for a loopback name only (ApiError 403
        otherwise): a page of another site that a DNS-rebinding name points at 127.0.0.1 sends
        that name as its Host, and must not reach files, batches or the dashboard."""
        if self.open and not is_loopback(host_name(host_header or "")):
            raise ApiError(
                403,
                "This server has no API keys and answers requests for a loopback address only "
                "(Host header).",
                code="host_not_allowed",
            )

    def namespace_for(self, authorization: str | None) -> str:
        """The caller's namespace from its ``Authorization`` header; ApiError 401 when it is
        missing or wrong (every key is compared, in constant time)."""
        if self.open:
            return self.default_namespace
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise ApiError(
                401,
                "You didn't provide an API key. You need to provide your API key in an "
                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            )
        found = None
        for key, ns in self.keys:
            if hmac.compare_digest(key.encode(), token.encode()):
                found = ns
        if found is None:
            shown = token[:3] + "*" * 4 + token[-4:] if len(token) > 8 else "*" * len(token)
            raise ApiError(401, f"Incorrect API key provided: {shown}.", code="invalid_api_key")
        return found


def host_name(host: str) -> str:
    """The name part of a ``Host`` header (``[::1]:8000`` -> ``::1``, ``a:80`` -> ``a``)."""
    host = host.strip()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_loopback(host: str) -> bool:
    """True for ``localhost`` (any case, with or without the root's dot: host names are not
    case-sensitive) and loopback addresses (127.0.0.0/8, ::1)."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
