"""The dashboard's routes: the page (``/``, ``/ui/*``) and its JSON API under ``/api/``, added to
``prefixq serve``'s app as an extension (`mount`)
(docs/dashboard.md lists every endpoint and shape).

Every ``/api/`` reply is JSON (errors in the server's one shape, ``{"error": {"message", "type",
"param", "code"}}``), never cached, and about the caller's namespace only (access.py). The data
comes from prefixq.ops (stats, burst_list, history, recovery) over one blocking Redis client, in the
server's thread pool; the shapes are those of ``prefixq inspect --json`` where both show the same
thing (``/api/snapshot`` is exactly that JSON).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from importlib import resources
from typing import Any, TypeVar

import redis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from prefixq.client import results as results_api
from prefixq.client.submit_args import check_burst_id
from prefixq.core.errors import BurstNotFound, ConfigError, ValidationError
from prefixq.core.settings import Settings
from prefixq.dashboard.access import ACTION_HEADER, Access
from prefixq.dashboard.downloads import result_lines
from prefixq.openai.apierror import ApiError, bad_request
from prefixq.openai.app import Served
from prefixq.ops import burst_list, fleet_stats, history, stats
from prefixq.ops.recovery import Recovery
from prefixq.ops.tolerant import tolerant
from prefixq.store.burst_end import acancel
from prefixq.store.deployment import resolve_shards

__all__ = ["mount"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: the page's files (package data) and their types
_FILES = {
    "app.js": "text/javascript; charset=utf-8",
    "charts.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
#: what the page may load and do: its own files and its own API, nothing else
_PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}
_API_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}
#: largest JSON body of an action
_MAX_BODY = 1 << 20


def _static(name: str) -> bytes:
    return (resources.files("prefixq.dashboard") / "static" / name).read_bytes()


def _int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        v = int(raw)
    except ValueError:
        raise bad_request(f"{name} must be an integer, not {raw[:40]!r}", param=name) from None
    if not lo <= v <= hi:
        raise bad_request(f"{name} must be {lo} to {hi}, not {v}", param=name)
    return v


def _burst_id(burst: str) -> str:
    """A usable burst id, or 404 (an id that cannot exist names no burst)."""
    try:
        return check_burst_id(burst)
    except ValidationError:
        raise ApiError(404, "No such burst (not a burst id).", code="burst_not_found") from None


def _json(obj: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(obj, status_code=status, headers=_API_HEADERS)


def mount(app: FastAPI, served: Served) -> None:
    """Add the page and ``/api/`` to ``app`` (an extension of prefixq.openai.app.create_app):
    the server's clients, keys and burst-done hook come in ``served``."""
    settings = served.settings
    access = Access(settings, served.keyring)

    def client() -> redis.Redis:
        return served.blocking_redis

    async def call(fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        return await run_in_threadpool(fn, *args, **kw)

    def shard_count(r: redis.Redis, s: Settings) -> int:
        try:
            return resolve_shards(r, s.replace(shards=0))
        except ConfigError:  # no worker has started in this namespace yet
            return 0

    # ---- the page ------------------------------------------------------------------------
    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def page(request: Request) -> Response:
        access.guard_host(request)
        return Response(_static("index.html"), media_type="text/html; charset=utf-8",
                        headers=_PAGE_HEADERS)  # fmt: skip

    @app.get("/ui/{name}", include_in_schema=False)
    async def asset(request: Request, name: str) -> Response:
        access.guard_host(request)
        if name not in _FILES:
            raise ApiError(404, "No such file.")
        return Response(_static(name), media_type=_FILES[name], headers=_PAGE_HEADERS)

    # ---- reading -------------------------------------------------------------------------
    @app.get("/api/session")
    async def session(request: Request) -> JSONResponse:
        """Who the caller is to the dashboard: namespace, read-only, whether keys are on. Without
        a valid key (keys on) a 200 that says so, so that the page asks for one."""
        try:
            s = access.settings_for(request)
        except ApiError as e:
            if e.status != 401:
                raise
            return _json({"keys": True, "authenticated": False, "message": e.message})
        return _json(
            {
                "authenticated": True,
                "namespace": s.namespace,
                "read_only": access.read_only,
                "keys": not access.keyring.open,
                "action_header": ACTION_HEADER,
                "history_every_s": s.history_every_s,
                "at": time.time(),
            }
        )

    @app.get("/api/snapshot")
    async def snapshot(request: Request) -> JSONResponse:
        """Exactly ``prefixq inspect --json [--burst ID] [--recent N]``."""
        s = access.settings_for(request)
        recent = _int_param(request, "recent", 5, 0, 100)
        burst = request.query_params.get("burst") or None
        if burst is not None:
            _burst_id(burst)
        try:
            snap = await call(stats.snapshot, s.replace(shards=0), burst=burst, recent=recent,
                              client=client())  # fmt: skip
        except BurstNotFound as e:
            raise ApiError(404, str(e), code="burst_not_found") from None
        except ConfigError as e:
            raise ApiError(409, str(e), code="no_deployment") from None
        return _json(snap)

    @app.get("/api/shards")
    async def shards(request: Request) -> JSONResponse:
        """``{namespace, at, shards, fleet, sharing, problems}``: the objects of ``inspect
        --json`` (``problems``: what a key of another type kept from view, ops/tolerant.py)."""
        s = access.settings_for(request)

        def read() -> dict[str, Any]:
            r = client()
            n = shard_count(r, s)
            lane_bursts: dict[tuple[str, str], set[str]] = {}
            problems: list[str] = []
            per_shard = stats.shard_stats(r, s, n, lane_bursts, problems)
            return {
                "namespace": s.namespace,
                "shards": per_shard,
                "fleet": fleet_stats.fleet(r, s, n, time.time(), problems),
                "sharing": stats.sharing(per_shard, lane_bursts),
                "problems": problems,
                "at": time.time(),
            }

        return _json(await call(read))

    @app.get("/api/history")
    async def history_(request: Request) -> JSONResponse:
        """The shards' rolling history (prefixq.ops.history.series)."""
        s = access.settings_for(request)
        window = _int_param(request, "window_s", 3600, 60, 7 * 86400)

        def read() -> dict[str, Any]:
            r = client()
            return history.series(r, s.keys, shard_count(r, s), window_s=window,
                                  step_s=s.history_every_s)  # fmt: skip

        return _json(await call(read))

    @app.get("/api/bursts")
    async def list_bursts(request: Request) -> JSONResponse:
        """Recent bursts, filtered (prefixq.ops.burst_list.listing)."""
        s = access.settings_for(request)
        q = request.query_params
        status = q.get("status", "")
        if status and status not in (*burst_list.ACTIVE, "active", "finished", "cancelled",
                                     "expired", "lost"):  # fmt: skip
            raise bad_request(f"unknown status {status[:40]!r}", param="status")
        limit = _int_param(request, "limit", 50, 1, 500)
        got = await call(burst_list.listing, client(), s, limit=limit, status=status,
                         tenant=q.get("tenant", "")[:64], text=q.get("q", "")[:200])  # fmt: skip
        return _json(got)

    @app.get("/api/bursts/{burst}")
    async def burst(request: Request, burst: str) -> JSONResponse:
        """``{"burst": <inspect's burst object>, "summary": <its listing row>}``."""
        s = access.settings_for(request)
        b = _burst_id(burst)

        def read() -> dict[str, Any]:
            r = client()
            problems: list[str] = []  # keys of another type (ops/tolerant.py)
            detail = stats.burst_stats(r, s, b, problems)
            st = results_api.status(b, s, client=r)
            since = int((time.time() - burst_list.RATE_WINDOW_S) * 1000)
            recent: list[Any] = tolerant(problems, f"burst {b}'s events", [], r.xrevrange,
                              s.keys.events(b), "+", since, burst_list.RATE_EVENTS)  # fmt: skip
            summary = burst_list.summary(st, recent, time.time())
            return {"burst": detail, "summary": summary, "problems": problems}

        try:
            return _json(await call(read))
        except BurstNotFound as e:
            raise ApiError(404, str(e), code="burst_not_found") from None

    @app.get("/api/bursts/{burst}/failed")
    async def failed(request: Request, burst: str) -> JSONResponse:
        """A burst's failed requests (prefixq.ops.burst_list.failures)."""
        s = access.settings_for(request)
        b = _burst_id(burst)
        limit = _int_param(request, "limit", 100, 1, 1000)
        if not await call(client().exists, s.keys.burst(b)):
            raise ApiError(404, f"no burst {b!r} in namespace {s.namespace!r}",
                           code="burst_not_found")  # fmt: skip
        return _json(await call(burst_list.failures, client(), s, b, limit=limit))

    @app.get("/api/bursts/{burst}/results")
    async def download(request: Request, burst: str) -> StreamingResponse:
        """The results recorded so far as JSONL (``format=prefixq`` or ``openai``)."""
        s = access.settings_for(request)
        b = _burst_id(burst)
        fmt = request.query_params.get("format", "prefixq")
        try:
            lines = await call(result_lines, client(), s, b, fmt)
        except BurstNotFound as e:
            raise ApiError(404, str(e), code="burst_not_found") from None
        except ConfigError as e:
            raise bad_request(str(e), param="format") from None
        name = f"{b}-{fmt}.jsonl".replace('"', "")
        return StreamingResponse(
            lines,
            media_type="application/x-ndjson",
            headers={**_API_HEADERS, "Content-Disposition": f'attachment; filename="{name}"'},
        )

    @app.get("/api/dead")
    async def dead(request: Request) -> JSONResponse:
        """Dead letters, oldest first, at most ``limit`` per shard (``prefixq dead --json``)."""
        s = access.settings_for(request)
        limit = _int_param(request, "limit", 100, 1, 1000)

        def read() -> dict[str, Any]:
            r = client()
            n = shard_count(r, s)
            if not n:
                return {"dead": [], "per_shard": [], "at": time.time()}
            rec = Recovery(s.replace(shards=0), r)
            pipe = r.pipeline(transaction=False)
            for k in range(n):
                pipe.xlen(s.keys.dead(k))
            return {
                "dead": [d.to_json() for d in rec.letters(None, limit=limit)],
                "per_shard": pipe.execute(),
                "at": time.time(),
            }

        return _json(await call(read))

    # ---- actions -------------------------------------------------------------------------
    async def body(request: Request) -> dict[str, Any]:
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > _MAX_BODY:
                raise bad_request("The request body is too large.")
        try:
            obj = json.loads(raw or b"{}")
        except (ValueError, RecursionError):  # not UTF-8, not JSON, an int too long, too deep
            raise bad_request("The body is not JSON.") from None
        if not isinstance(obj, dict):
            raise bad_request("The body must be a JSON object.")
        return obj

    @app.post("/api/bursts/{burst}/cancel")
    async def cancel_burst(request: Request, burst: str) -> JSONResponse:
        """`prefixq cancel BURST --json`."""
        s = access.settings_for(request)
        access.guard_action(request)
        b = _burst_id(burst)
        try:
            rep = await acancel(b, s, served.async_redis, on_burst_done=served.on_burst_done)
        except BurstNotFound as e:
            raise ApiError(404, str(e), code="burst_not_found") from None
        log.info("dashboard: burst %s cancelled in namespace %s", b, s.namespace)
        return _json(rep.to_json())

    @app.post("/api/dead/requeue")
    async def requeue(request: Request) -> JSONResponse:
        """`prefixq dead --requeue [--id ID ...] --json`: ``{"ids": [...]}`` or ``{"all": true}``"""
        s = access.settings_for(request)
        access.guard_action(request)
        obj = await body(request)
        ids = obj.get("ids")
        if obj.get("all") is True and ids is None:
            chosen = None
        elif isinstance(ids, list) and ids and all(isinstance(i, str) for i in ids):
            chosen = ids[:1000]
        else:
            raise bad_request('Send {"ids": ["<dead letter id>", ...]} or {"all": true}.')
        try:
            rep = await call(lambda: Recovery(s.replace(shards=0), client()).requeue(None, chosen))
        except ConfigError as e:
            raise bad_request(str(e), param="ids") from None
        log.info("dashboard: requeued %d dead letters in namespace %s", rep.requeued, s.namespace)
        return _json(rep.to_json())
