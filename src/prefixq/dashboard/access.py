"""Who may see and do what on the dashboard: the caller's namespace, the read-only setting, and the
guards against requests a browser makes on another site's behalf.

- **Namespace**: with API keys configured every page request and every ``/api/`` call needs
  ``Authorization: Bearer <key>`` (the page asks for the key and keeps it in the tab's
  ``sessionStorage``); the key's namespace is the only one it sees (prefixq.openai.auth). Without
  keys the server listens on loopback only and shows its own namespace.
- **No ambient credentials**: no cookie is ever set, so a request another site makes the browser
  send carries no key; and no CORS header is ever sent, so another site cannot read a reply.
- **Actions** (cancel, requeue) need a ``POST`` with the header ``X-Prefixq-Action`` (a header a
  cross-site form cannot send; a cross-site script would need a CORS preflight this server never
  grants), are refused when the browser says the request comes from another site
  (``Sec-Fetch-Site`` or ``Origin``), and are refused (403) when ``dashboard_read_only`` is set.
- **Without keys**, a request whose ``Host`` is not a loopback name or address is refused (403):
  a page on another site whose name was made to resolve to 127.0.0.1 (DNS rebinding) would
  otherwise be same-origin with the dashboard.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.requests import Request

from prefixq.core.settings import Settings
from prefixq.openai.apierror import ApiError
from prefixq.openai.auth import KeyRing

__all__ = ["ACTION_HEADER", "Access"]

#: the header every state-changing request must carry
ACTION_HEADER = "x-prefixq-action"


@dataclass(frozen=True, slots=True)
class Access:
    """The server's keys and settings, asked once per request."""

    settings: Settings
    keyring: KeyRing

    @property
    def read_only(self) -> bool:
        return self.settings.dashboard_read_only

    def guard_host(self, request: Request) -> None:
        """Without keys, only a loopback ``Host`` (403 otherwise: `KeyRing.guard_host`)."""
        self.keyring.guard_host(request.headers.get("host"))

    def settings_for(self, request: Request) -> Settings:
        """The caller's settings: the server's, in its key's namespace (401 without a valid key
        when keys are configured)."""
        self.guard_host(request)
        ns = self.keyring.namespace_for(request.headers.get("authorization"))
        return (
            self.settings if ns == self.settings.namespace else self.settings.replace(namespace=ns)
        )

    def guard_action(self, request: Request) -> None:
        """A state-changing request: read-only refuses it (403), and so do the cross-site
        checks (403)."""
        if self.read_only:
            raise ApiError(
                403,
                "The dashboard is read-only (dashboard_read_only): cancel and requeue are off.",
                code="read_only",
            )
        if not request.headers.get(ACTION_HEADER):
            raise ApiError(
                403,
                f"Actions need the {ACTION_HEADER} header (the dashboard sends it).",
                code="action_header_missing",
            )
        site = request.headers.get("sec-fetch-site")
        if site is not None and site not in ("same-origin", "none"):
            raise ApiError(403, f"Refused a {site} request.", code="cross_site")
        origin = request.headers.get("origin")
        if origin and origin != "null":
            if urlsplit(origin).netloc.lower() != request.headers.get("host", "").lower():
                raise ApiError(403, "Refused a request from another origin.", code="cross_site")
        elif origin == "null":
            raise ApiError(403, "Refused a request from an opaque origin.", code="cross_site")
