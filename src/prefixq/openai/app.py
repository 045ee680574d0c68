"""The ASGI app of ``prefixq serve``: OpenAI's Files and Batch endpoints under ``/v1``, and what
extensions add (the CLI adds the dashboard, ``/`` and ``/api/``: prefixq.dashboard, which
``prefixq dashboard`` serves alone: ``batch_api=False``).

Every error is answered in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``:
400 for bad parameters and files over the limits, 401 for a missing or wrong API key, 404 for an
unknown object (or one of another namespace), 409 for a cancel the batch's status does not allow,
413 for an upload whose declared size is over ``max_file_bytes``, 503 while Redis is unreachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import redis
import redis.asyncio as aredis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from prefixq.core.errors import PrefixqError, RedisUnavailable
from prefixq.core.settings import Settings
from prefixq.openai.apierror import ApiError, bad_request
from prefixq.openai.auth import KeyRing
from prefixq.openai.batches import BatchStore
from prefixq.openai.pages import parse_limit
from prefixq.openai.runner import Sweeper
from prefixq.ops.webhook_delivery import delivering
from prefixq.store.burst_end import AsyncBurstDone
from prefixq.store.connection import async_client, sync_client
from prefixq.store.redis_errors import describe

__all__ = ["Extension", "Served", "create_app"]

log = logging.getLogger(__name__)

#: room for the multipart framing around an upload of ``max_file_bytes``
_FORM_OVERHEAD = 64 << 10
#: largest JSON body of POST /v1/batches
_MAX_JSON = 1 << 20


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(ApiError(status, message, type=kind).body(), status_code=status)


class Served:
    """What an extension of the app (`create_app`'s ``extensions``) is given: the settings, the
    keys, the hook for bursts a cancel ends, and the server's Redis clients (open while the app
    runs: its lifespan opens and closes them)."""

    def __init__(
        self,
        settings: Settings,
        keyring: KeyRing,
        on_burst_done: AsyncBurstDone | None,
        holder: dict[str, Any],
    ) -> None:
        self.settings, self.keyring, self.on_burst_done = settings, keyring, on_burst_done
        self._holder = holder

    @property
    def async_redis(self) -> aredis.Redis:
        """The server's asyncio client."""
        r: aredis.Redis = self._holder["r"]
        return r

    @property
    def blocking_redis(self) -> redis.Redis:
        """The server's blocking client (for prefixq.ops, in the thread pool)."""
        r: redis.Redis = self._holder["sync"]
        return r


#: adds routes to the app (the dashboard: prefixq.dashboard.api.mount)
Extension = Callable[[FastAPI, Served], None]


def create_app(
    settings: Settings,
    *,
    sweep_interval: float = 0.5,
    on_burst_done: AsyncBurstDone | None = None,
    batch_api: bool = True,
    extensions: Sequence[Extension] = (),
) -> FastAPI:
    """The app; its lifespan opens the Redis clients and runs the batch sweeper (runner.py) and
    the webhook deliverer (prefixq.ops.webhook_delivery).
    ``on_burst_done`` runs for a burst that a cancel or an expiry here ends (its ``on_complete``:
    `prefixq serve` passes RQ's); ``batch_api=False``: no ``/v1`` and no sweeper (``prefixq
    dashboard``); ``extensions`` add their routes (the CLI passes the dashboard's)."""
    keyring = KeyRing.from_settings(settings)
    holder: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        r = async_client(settings)
        holder["r"] = r
        holder["sync"] = sync_client(settings)  # for extensions (prefixq.ops is blocking)
        task = None
        hooks = contextlib.AsyncExitStack()
        if batch_api:
            sweeper = Sweeper(r, settings, keyring.namespaces, on_burst_done)
            holder["sweeper"] = sweeper
            task = asyncio.create_task(sweeper.run(sweep_interval))
            # webhooks: a task of its own, so no delivery ever holds the sweeper up
            await hooks.enter_async_context(delivering(r, settings, keyring.namespaces))
        try:
            yield
        finally:
            await hooks.aclose()
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                await holder["sweeper"].close()
            await r.aclose()
            holder["sync"].close()

    app = FastAPI(title="prefixq", lifespan=lifespan, docs_url=None, redoc_url=None)
    served = Served(settings, keyring, on_burst_done, holder)
    for extend in extensions:
        extend(app, served)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        if e.status_code in (404, 405):
            return _error(e.status_code, f"Invalid URL ({request.method} {request.url.path})")
        return _error(e.status_code, str(e.detail))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return _error(400, f"Invalid request: {e.errors()}")

    @app.exception_handler(ClientDisconnect)
    async def gone(request: Request, e: ClientDisconnect) -> JSONResponse:
        """The client left mid-body: nobody reads the answer; not a server error."""
        log.debug("%s %s: the client disconnected mid-body", request.method, request.url.path)
        return _error(400, "The client disconnected before the request body was read.")

    @app.exception_handler(PrefixqError)
    async def prefixq_error(request: Request, e: PrefixqError) -> JSONResponse:
        if isinstance(e, RedisUnavailable):
            return await unavailable(request, e)
        log.exception("%s %s failed", request.method, request.url.path)
        return _error(500, f"The server had an error: {e}", "server_error")

    @app.exception_handler(RedisConnectionError)
    @app.exception_handler(RedisTimeoutError)
    async def unavailable(request: Request, e: Exception) -> JSONResponse:
        log.warning("%s %s: Redis unavailable: %s", request.method, request.url.path, e)
        msg = str(e if isinstance(e, RedisUnavailable) else describe(settings, e))
        return _error(503, msg, "server_error")

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        """200 while Redis answers (no API key needed: for health checks)."""
        await holder["r"].ping()
        return JSONResponse({"status": "ok"})

    if batch_api:
        _batch_routes(app, settings, keyring, holder)
    return app


def _batch_routes(
    app: FastAPI, settings: Settings, keyring: KeyRing, holder: dict[str, Any]
) -> None:
    """OpenAI's Files and Batch endpoints under ``/v1``."""

    def store(request: Request) -> BatchStore:
        keyring.guard_host(request.headers.get("host"))
        ns = keyring.namespace_for(request.headers.get("authorization"))
        sweeper: Sweeper = holder["sweeper"]
        return sweeper.stores[ns]

    # files
    @app.post("/v1/files")
    async def upload_file(request: Request) -> JSONResponse:
        st = store(request)
        declared = request.headers.get("content-length")
        if (
            declared
            and declared.isdigit()
            and int(declared) > settings.max_file_bytes + _FORM_OVERHEAD
        ):
            raise ApiError(
                413,
                f"File is too large: over the server's limit of {settings.max_file_bytes} bytes.",
                param="file",
                code="file_too_large",
            )
        obj = await st.files.upload(request.stream(), request.headers.get("content-type"))
        return JSONResponse(obj)

    @app.get("/v1/files")
    async def list_files(request: Request) -> JSONResponse:
        q = request.query_params
        pg = await store(request).files.list(
            after=q.get("after"),
            limit=parse_limit(q.get("limit"), default=10_000, most=10_000),
            order=q.get("order", "desc"),
            purpose=q.get("purpose"),
        )
        return JSONResponse(pg.to_json())

    @app.get("/v1/files/{file_id}")
    async def get_file(request: Request, file_id: str) -> JSONResponse:
        return JSONResponse(await store(request).files.get(file_id))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str) -> FileResponse:
        path = await store(request).files.content(file_id)
        return FileResponse(path, media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    async def delete_file(request: Request, file_id: str) -> JSONResponse:
        return JSONResponse(await store(request).files.delete(file_id))

    # batches
    @app.post("/v1/batches")
    async def create_batch(request: Request) -> JSONResponse:
        st = store(request)
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > _MAX_JSON:
                raise bad_request("The request body is too large.")
        try:
            body = json.loads(raw or b"null")
            # a lone surrogate (``"\\ud800"``) is valid JSON but no text: Redis could not store it
            json.dumps(body, ensure_ascii=False).encode()
        except (ValueError, RecursionError):  # UnicodeError, JSONDecodeError, an int too long
            raise bad_request(
                "We could not parse the JSON body of your request. (HINT: This likely means you "
                "aren't using your HTTP library correctly.)"
            ) from None
        obj, token = await st.create(body)
        sweeper: Sweeper = holder["sweeper"]
        sweeper.spawn(st, obj["id"], sweeper.start(st, obj["id"], token))
        return JSONResponse(obj)

    @app.get("/v1/batches")
    async def list_batches(request: Request) -> JSONResponse:
        q = request.query_params
        limit = parse_limit(q.get("limit"), default=20, most=100)
        pg = await store(request).list(after=q.get("after"), limit=limit)
        return JSONResponse(pg.to_json())

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(request: Request, batch_id: str) -> JSONResponse:
        return JSONResponse(await store(request).get(batch_id))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str) -> JSONResponse:
        return JSONResponse(await store(request).cancel(batch_id))
