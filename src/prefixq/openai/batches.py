"""Batches: the records behind ``/v1/batches`` (`BatchStore`) and the Batch objects rendered from
them (`batch_object`).

A batch record is a Redis hash (core/keys.py ``oai_batch``) written when the batch is created and
moved from status to status only by lua/batch_transition.lua, which checks the caller's lease
(if it holds one) in the same script; its burst (``burst``: the batch id, unless a recovery had
to resubmit) carries the requests and results. While a batch runs, ``request_counts`` are read
live from its burst's counters; the final ones are written with the final status. Its
``output_expires_after`` is kept as ``output_expires_s``, for its output and error files.
docs/openai.md, "Batches", has the statuses and their transitions.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from typing import Any

import anyio
import redis.asyncio as aredis

from prefixq.core.errors import BurstNotFound, ValidationError
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.core.sharing import DEFAULT_PRIORITY, check_priority, check_tenant
from prefixq.core.webhooks import WebhookConfig
from prefixq.openai.apierror import ApiError, bad_request, not_found
from prefixq.openai.embeddings import EMBEDDINGS, count_file_inputs, too_many_inputs
from prefixq.openai.expiry import expires_after
from prefixq.openai.files import FileStore
from prefixq.openai.formats import ENDPOINTS
from prefixq.openai.lease import TTL_MS
from prefixq.openai.pages import Page, page
from prefixq.store import burst_end
from prefixq.store.lua_script import LuaScript
from prefixq.store.webhook_outbox import transition_args

__all__ = ["FINAL", "BatchStore", "batch_object", "cancel_burst", "window_seconds"]

log = logging.getLogger(__name__)

#: statuses a batch never leaves
FINAL = frozenset({"failed", "completed", "expired", "cancelled"})
_WINDOW = re.compile(r"^([1-9][0-9]{0,8})([smhd])$")  # 9 digits: past 30 days in any unit
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}
#: longest completion window accepted (30 days)
MAX_WINDOW_S = 30 * 86400
_TIMES = (
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


def window_seconds(window: Any) -> int:
    """Seconds in a completion window: ``24h`` as OpenAI takes it, or any ``<N>s|m|h|d`` up to
    30 days; 400 otherwise."""
    m = _WINDOW.match(window) if isinstance(window, str) else None
    seconds = int(m.group(1)) * _UNIT[m.group(2)] if m else 0
    if not 1 <= seconds <= MAX_WINDOW_S:
        raise bad_request(
            f"Invalid 'completion_window': {window!r}; expected a duration such as '24h' "
            "(a number and s, m, h or d, at most 30 days).",
            param="completion_window",
            code="invalid_value",
        )
    return seconds


def _check_metadata(metadata: Any) -> dict[str, str] | None:
    """OpenAI's limits: at most 16 pairs, keys up to 64 characters, values up to 512."""
    if metadata is None:
        return None
    if (
        not isinstance(metadata, dict)
        or len(metadata) > 16
        or not all(isinstance(k, str) and len(k) <= 64 for k in metadata)
        or not all(isinstance(v, str) and len(v) <= 512 for v in metadata.values())
    ):
        raise bad_request(
            "Invalid 'metadata': at most 16 string pairs, keys up to 64 characters and values "
            "up to 512.",
            param="metadata",
            code="invalid_value",
        )
    try:  # the burst's priority and tenant (prefixq.core.sharing), when the metadata names them
        check_priority(metadata.get("priority", DEFAULT_PRIORITY))
        if "tenant" in metadata:
            check_tenant(metadata["tenant"])
    except ValidationError as e:
        raise bad_request(
            f"Invalid 'metadata': {e}.", param="metadata", code="invalid_value"
        ) from None
    return dict(metadata)


def sharing(metadata: str) -> dict[str, str]:
    """``priority`` and ``tenant`` for the batch's burst, from its stored metadata (JSON)."""
    meta = json.loads(metadata) if metadata else {}
    return {k: meta[k] for k in ("priority", "tenant") if isinstance(meta.get(k), str)}


def _counts(m: dict[str, str], live: dict[str, str] | None) -> dict[str, int]:
    if "completed" in m:  # final counts
        src = {"total": m.get("total"), "completed": m.get("completed"), "failed": m.get("failed")}
    elif live:
        src = {
            "total": live.get("total"),
            "completed": live.get("done"),
            "failed": live.get("failed"),
        }
    else:
        src = {"total": m.get("total")}
    return {k: int(src.get(k) or 0) for k in ("total", "completed", "failed")}


def batch_object(m: dict[str, str], live: dict[str, str] | None = None) -> dict[str, Any]:
    """OpenAI's Batch object from a batch record (and its burst's counters while it runs)."""

    def when(name: str) -> int | None:
        return int(float(m[name])) if m.get(name) else None

    errors = json.loads(m["errors"]) if m.get("errors") else None
    return {
        "id": m["id"],
        "object": "batch",
        "endpoint": m["endpoint"],
        "model": m.get("model") or None,
        "errors": None if errors is None else {"object": "list", "data": errors},
        "input_file_id": m["input_file_id"],
        "completion_window": m["completion_window"],
        "status": m["status"],
        "output_file_id": m.get("output_file_id") or None,
        "error_file_id": m.get("error_file_id") or None,
        "created_at": int(float(m["created_at"])),
        **{name: when(name) for name in _TIMES},
        "request_counts": _counts(m, live),
        "usage": json.loads(m["usage"]) if m.get("usage") else None,
        "metadata": json.loads(m["metadata"]) if m.get("metadata") else None,
    }


async def cancel_burst(
    r: aredis.Redis,
    settings: Settings,
    burst: str,
    on_burst_done: burst_end.AsyncBurstDone | None = None,
) -> None:
    """Cancel the burst's unfinished requests (`prefixq.store.burst_end.acancel`); a burst that is
    gone has nothing left to cancel."""
    try:
        await burst_end.acancel(burst, settings, r, on_burst_done=on_burst_done)
    except BurstNotFound:
        log.warning("burst %s: nothing to cancel, its record is gone", burst)


def _decode(h: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in h.items()}


class BatchStore:
    """Batches of one namespace."""

    def __init__(
        self,
        r: aredis.Redis,
        settings: Settings,
        namespace: str,
        on_burst_done: burst_end.AsyncBurstDone | None = None,
    ) -> None:
        self.r, self.keys = r, Keys(namespace)
        #: a burst's ``on_complete`` when a cancel or an expiry here ends it (from the CLI)
        self.on_burst_done = on_burst_done
        self.settings = settings.replace(namespace=namespace)
        self.files = FileStore(r, settings, namespace)
        self._move = LuaScript("batch_transition")
        #: the endpoints a final status is announced to (queued by the move itself)
        self.hooks = WebhookConfig.parse(settings.webhooks).of(namespace)

    async def record(self, batch_id: str) -> dict[str, str]:
        """The batch's record; 404 when there is none in this namespace."""
        m = _decode(await self.r.hgetall(self.keys.oai_batch(batch_id)))
        if not m:
            raise not_found("batch", batch_id)
        return m

    async def create(self, body: Any) -> tuple[dict[str, Any], str]:
        """Check the create parameters and write the record (status ``validating``) with its
        lease taken; returns the Batch object and the lease token."""
        if not isinstance(body, dict):
            raise bad_request("The request body must be a JSON object.")
        for name in ("input_file_id", "endpoint", "completion_window"):
            if name not in body:
                raise bad_request(f"Missing required parameter: '{name}'.", param=name)
        endpoint = body["endpoint"]
        if endpoint not in ENDPOINTS:
            raise bad_request(
                f"Invalid 'endpoint': {endpoint!r}; this server runs "
                f"{' and '.join(ENDPOINTS)} batches.",
                param="endpoint",
                code="invalid_value",
            )
        window_s = window_seconds(body["completion_window"])
        metadata = _check_metadata(body.get("metadata"))
        output_expires_s = expires_after(body.get("output_expires_after"), "output_expires_after")
        extra = set(body) - {
            "input_file_id",
            "endpoint",
            "completion_window",
            "metadata",
            "output_expires_after",
        }
        if extra:
            name = sorted(extra)[0]
            raise bad_request(f"Unrecognized request argument supplied: {name}", param=name)
        file_id = body["input_file_id"]
        if not isinstance(file_id, str):
            raise bad_request("'input_file_id' must be a string.", param="input_file_id")
        try:
            f = await self.files.get(file_id)
        except ApiError:
            raise bad_request(
                f"Invalid 'input_file_id': no file {file_id!r}.", param="input_file_id"
            ) from None
        if f["purpose"] != "batch":
            raise bad_request(
                f"The file {file_id!r} has purpose {f['purpose']!r}, not 'batch'.",
                param="input_file_id",
            )
        if endpoint == EMBEDDINGS:  # OpenAI's limit of inputs across an embeddings batch
            n = await anyio.to_thread.run_sync(count_file_inputs, self.files.path(file_id))
            refusal = too_many_inputs(n)
            if refusal:
                raise bad_request(refusal, param="input_file_id", code="too_many_inputs")
        batch_id = "batch_" + secrets.token_hex(16)
        now = time.time()
        m = {
            "id": batch_id,
            "endpoint": endpoint,
            "input_file_id": file_id,
            "completion_window": body["completion_window"],
            "window_s": window_s,
            "created_at": now,
            "expires_at": now + window_s,
            "status": "validating",
            "burst": batch_id,
            "metadata": "" if metadata is None else json.dumps(metadata, ensure_ascii=False),
            "output_expires_s": output_expires_s or "",
        }
        token = secrets.token_hex(8)
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.keys.oai_batch(batch_id), mapping=m)
        pipe.zadd(self.keys.oai_batches, {batch_id: int(now * 1000)})
        pipe.sadd(self.keys.oai_open, batch_id)
        pipe.set(self.keys.oai_lease(batch_id), token, px=TTL_MS)
        await pipe.execute()
        return batch_object({k: str(v) for k, v in m.items()}), token

    async def live(self, m: dict[str, str]) -> dict[str, str] | None:
        """The burst's counters while the batch runs (None once final or before it is queued)."""
        if m["status"] in FINAL or "total" not in m:
            return None
        raw = await self.r.hmget(self.keys.burst(m["burst"]), ["total", "done", "failed"])
        if raw[0] is None:
            return None
        return dict(zip(("total", "done", "failed"), (v.decode() for v in raw), strict=True))

    async def get(self, batch_id: str) -> dict[str, Any]:
        m = await self.record(batch_id)
        return batch_object(m, await self.live(m))

    async def list(self, *, after: str | None, limit: int) -> Page:
        async def fetch(ids: list[str]) -> list[dict[str, Any]]:
            pipe = self.r.pipeline(transaction=False)
            for i in ids:
                pipe.hgetall(self.keys.oai_batch(i))
            records = [_decode(h) for h in await pipe.execute() if h]
            return [batch_object(m, await self.live(m)) for m in records]

        return await page(self.r, self.keys.oai_batches, fetch, after=after, limit=limit)

    async def move(
        self,
        batch_id: str,
        frm: tuple[str, ...],
        to: str,
        fields: dict[str, Any] | None = None,
        *,
        token: str = "",
    ) -> int:
        """Status change by lua/batch_transition.lua: 1 moved, 0 in another status, -1 no record,
        -2 the lease ``token`` is not held any more. A move to a final status queues the batch's
        webhook deliveries in the same script (prefixq.store.webhook_outbox)."""
        args: list[Any] = [batch_id, token, ",".join(frm), to, "1" if to in FINAL else "0"]
        if to in FINAL:
            args += transition_args(self.hooks, batch_id, to, time.time())
        else:
            args += [0, 0]
        for k, v in (fields or {}).items():
            args += [k, v]
        keys = [
            self.keys.oai_batch(batch_id),
            self.keys.oai_open,
            self.keys.oai_lease(batch_id),
            self.keys.hooks,
            self.keys.hooks_due,
        ]
        return int(await self._move.acall(self.r, keys=keys, args=args))

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        """Ask for a cancel: ``validating`` and ``in_progress`` batches go to ``cancelling``;
        the burst's unfinished requests are cancelled and the sweeper finishes the job."""
        m = await self.record(batch_id)
        if m["status"] in ("cancelling", "cancelled"):
            return batch_object(m, await self.live(m))
        moved = await self.move(
            batch_id, ("validating", "in_progress"), "cancelling", {"cancelling_at": time.time()}
        )
        if moved != 1:
            m = await self.record(batch_id)
            if m["status"] in ("cancelling", "cancelled"):  # another cancel moved it meanwhile
                return batch_object(m, await self.live(m))
            raise ApiError(
                409,
                f"Cannot cancel a batch with status {m['status']!r}.",
                param="batch_id",
            )
        # the burst may exist whatever status was read above (the runner can have queued it
        # meanwhile); the runner also cancels a burst it queued for a batch found cancelling
        m = await self.record(batch_id)
        if await self.r.exists(self.keys.burst(m["burst"])):
            await cancel_burst(self.r, self.settings, m["burst"], self.on_burst_done)
        return batch_object(m, await self.live(m))
