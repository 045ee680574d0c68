"""What moves a batch along without any client asking (`Sweeper`): validating and queueing its
burst, and finalizing it (writing the output and error files) once every request has a result.

Each server sweeps the open batches of every namespace it serves. Every step on a batch runs under
its lease (lease.py), so with two servers on one Redis each step runs once, and a step a dead
server left half done is redone by whichever server sweeps next, after the lease's TTL: keep each
step safe to redo (a burst queued in part is cancelled and queued again as
``<batch id>-<attempt>``; half-written files are removed). Every pass also runs
`prefixq.store.burst_end.expire_due` for each namespace, so a batch's window ends on time even
while no worker serves it. docs/openai.md, "Several servers, restarts and finalizing", has the
design.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import logging
import time
from collections.abc import Coroutine
from typing import Any

import anyio
import redis.asyncio as aredis

from prefixq.client import Producer
from prefixq.client.results import read_stored
from prefixq.core import wire
from prefixq.core.errors import PrefixqError, ValidationError
from prefixq.core.records import Result
from prefixq.core.settings import Settings
from prefixq.openai import lease
from prefixq.openai.batches import FINAL, BatchStore, cancel_burst, sharing
from prefixq.openai.formats import format_result
from prefixq.openai.output_files import OutputFiles
from prefixq.openai.validate import check_input
from prefixq.store import burst_end
from prefixq.store.connection import raise_if_cancelled
from prefixq.store.redis_errors import TRANSIENT

__all__ = ["Sweeper"]

log = logging.getLogger(__name__)

_FETCH = 512
#: how often the sweeper looks for partial uploads a killed server left (files.py)
UPLOADS_EVERY_S = 600.0
#: the burst record field the producer writes once every entry is queued
_QUEUED_MARK = "encoded_bytes"


def _decode(h: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in h.items()}


def _expires(m: dict[str, str]) -> float:
    """When the batch's completion window ends (its record's ``expires_at``)."""
    try:
        return float(m["expires_at"])
    except (KeyError, ValueError):
        return float("inf")  # a record without one: no window to end


def _failed(errors: list[dict[str, Any]]) -> dict[str, Any]:
    return {"failed_at": time.time(), "errors": json.dumps(errors, ensure_ascii=False)}


class Sweeper:
    """Validates, queues and finalizes the open batches of the given namespaces."""

    def __init__(
        self,
        r: aredis.Redis,
        settings: Settings,
        namespaces: list[str],
        on_burst_done: burst_end.AsyncBurstDone | None = None,
    ) -> None:
        self.r, self.settings = r, settings
        self.on_burst_done = on_burst_done
        self.stores = {ns: BatchStore(r, settings, ns, on_burst_done) for ns in namespaces}
        self.tasks: set[asyncio.Task[None]] = set()
        self.busy: set[tuple[str, str]] = set()
        #: batches whose last step failed: (not before, last delay), doubling up to a minute
        self.retry: dict[tuple[str, str], tuple[float, float]] = {}

    def spawn(self, store: BatchStore, batch_id: str, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` in the background (one task per batch at a time)."""
        key = (store.keys.ns, batch_id)
        self.busy.add(key)

        async def run() -> None:
            try:
                await coro
                self.retry.pop(key, None)
            except Exception as err:
                delay = min(60.0, 2 * self.retry.get(key, (0.0, 0.5))[1])
                self.retry[key] = (time.monotonic() + delay, delay)
                if isinstance(err, PrefixqError):  # the deployment's state (no shard count
                    # yet, Redis away): one line, retried until it changes or the window ends
                    log.warning("batch %s: %s; retried in %.0f s", batch_id, err, delay)
                else:
                    log.exception("batch %s: step failed; retried in %.0f s", batch_id, delay)
            finally:
                self.busy.discard(key)

        task = asyncio.create_task(run())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def start(self, store: BatchStore, batch_id: str, token: str) -> None:
        """Validate the input file and queue the burst (under the lease ``token``)."""
        async with lease.held(self.r, store.keys.oai_lease(batch_id), token):
            await self._start(store, batch_id, token)

    async def _start(self, store: BatchStore, batch_id: str, token: str) -> None:
        m = await store.record(batch_id)
        burst = m["burst"]
        exists = await self.r.hmget(store.keys.burst(burst), ["total", _QUEUED_MARK])
        if m["status"] == "cancelling":  # cancelled while validating
            if exists[0] is None:
                done = {"cancelled_at": time.time(), "total": 0, "completed": 0, "failed": 0}
                await store.move(batch_id, ("cancelling",), "cancelled", done, token=token)
            else:  # queued (in part) by an attempt that died: cancel it, then finalize it
                await cancel_burst(self.r, store.settings, burst, self.on_burst_done)
                await self.r.hset(store.keys.oai_batch(batch_id), "total", int(exists[0]))
            return
        if m["status"] != "validating":
            return
        if exists[0] is not None:
            if exists[1] is not None:  # an earlier attempt queued all of it
                await self._queued(
                    store, batch_id, burst, int(exists[0]), m.get("model", ""), token
                )
                return
            await cancel_burst(
                self.r, store.settings, burst, self.on_burst_done
            )  # partly queued: none of it may run
            attempt = await self.r.hincrby(store.keys.oai_batch(batch_id), "attempts", 1)
            burst = f"{batch_id}-{attempt}"
            await self.r.hset(store.keys.oai_batch(batch_id), "burst", burst)
            log.warning(
                "batch %s: an earlier attempt queued part of it; queueing as %s", batch_id, burst
            )
        path = store.files.path(m["input_file_id"])
        if not path.is_file():
            err = {
                "code": "invalid_request",
                "message": f"The input file {m['input_file_id']!r} no longer exists.",
                "param": "input_file_id",
                "line": None,
            }
            await store.move(batch_id, ("validating",), "failed", _failed([err]), token=token)
            return
        checked = await anyio.to_thread.run_sync(check_input, path, m["endpoint"], store.settings)
        status = (await store.record(batch_id))["status"]
        if status == "cancelling":  # cancelled while its file was checked: nothing may run
            done = {"cancelled_at": time.time(), "total": 0, "completed": 0, "failed": 0}
            await store.move(batch_id, ("cancelling",), "cancelled", done, token=token)
            return
        if status != "validating":
            return
        if checked.errors:
            log.info("batch %s: %d errors in its input file", batch_id, checked.error_count)
            await store.move(
                batch_id, ("validating",), "failed", _failed(checked.errors), token=token
            )
            return
        meta = {"input_format": "openai", "endpoint": m["endpoint"], "openai_batch": batch_id}
        if checked.model:
            meta["model"] = checked.model
        share = sharing(m.get("metadata", ""))
        try:
            await Producer(store.settings).asubmit(
                checked.requests,
                burst_id=burst,
                deadline=float(m["created_at"]) + int(m["window_s"]),
                metadata=meta,
                priority=share.get("priority"),
                tenant=share.get("tenant"),
            )
        except ValidationError as e:
            err = {"code": "invalid_request", "message": str(e), "param": None, "line": None}
            await store.move(batch_id, ("validating",), "failed", _failed([err]), token=token)
            return
        log.info("batch %s: %d requests queued as burst %s", batch_id, len(checked.requests), burst)
        await self._queued(
            store, batch_id, burst, len(checked.requests), checked.model or "", token
        )

    async def expire(self, store: BatchStore, batch_id: str, token: str) -> None:
        """End a batch that was never queued and whose window is over: ``expired``, nothing
        run (OpenAI's batches expire at the window whatever they were doing)."""
        async with lease.held(self.r, store.keys.oai_lease(batch_id), token):
            m = await store.record(batch_id)
            burst = await self.r.exists(store.keys.burst(m["burst"]))
            if m["status"] != "validating" or burst or time.time() < _expires(m):
                return  # queued meanwhile: its burst expires at the same deadline
            fields = {"expired_at": time.time(), "total": 0, "completed": 0, "failed": 0}
            if await store.move(batch_id, ("validating",), "expired", fields, token=token):
                log.warning("batch %s: expired before it could be queued", batch_id)

    async def _queued(
        self, store: BatchStore, batch_id: str, burst: str, total: int, model: str, token: str
    ) -> None:
        await self.r.hset(store.keys.oai_batch(batch_id), mapping={"total": total, "model": model})
        moved = await store.move(
            batch_id, ("validating",), "in_progress", {"in_progress_at": time.time()}, token=token
        )
        if moved == 0 and (await store.record(batch_id))["status"] == "cancelling":
            await cancel_burst(self.r, store.settings, burst, self.on_burst_done)

    async def finalize(self, store: BatchStore, batch_id: str, token: str) -> None:
        """Write the output and error files of a batch whose burst has every result."""
        async with lease.held(self.r, store.keys.oai_lease(batch_id), token):
            m = await store.record(batch_id)
            if m["status"] == "in_progress":
                fields = {"finalizing_at": time.time()}
                if (
                    await store.move(batch_id, ("in_progress",), "finalizing", fields, token=token)
                    != 1
                ):
                    return
                m = await store.record(batch_id)
            if m["status"] not in ("finalizing", "cancelling"):
                return
            out_s = int(m["output_expires_s"]) if m.get("output_expires_s") else None
            files = OutputFiles(store, batch_id, expires_s=out_s)
            files.sweep_stale()
            for fid in filter(None, m.get("publishing", "").split(",")):
                await store.files.remove(fid)  # published by an attempt that died before the end
            try:
                await self._write(store, m, files)
                final = "cancelled" if m["status"] == "cancelling" else "completed"
                # its burst cancelled outside the Batch API (`prefixq cancel`, the dashboard):
                # cancelled results come only from a cancel
                if final == "completed" and files.kinds.get("cancelled"):
                    final = "cancelled"
                if final == "completed" and files.kinds.get("expired"):
                    final = "expired"
                pending = {"publishing": files.pending()}
                status = m["status"]
                if await store.move(batch_id, (status,), status, pending, token=token) != 1:
                    return  # the lease was lost: whoever holds it now finalizes
                ids = await files.publish()
            finally:
                files.discard()
            done = files.kinds.get("completed", 0)
            fields2: dict[str, Any] = {
                f"{final}_at": time.time(),
                **ids,
                "total": sum(files.kinds.values()),
                "completed": done,
                "failed": sum(files.kinds.values()) - done,
                "usage": json.dumps(files.usage.to_json()),
                "publishing": "",
            }
            if final == "cancelled" and not m.get("cancelling_at"):
                fields2["cancelling_at"] = fields2["cancelled_at"]  # cancelled as its burst
            moved = await store.move(batch_id, (m["status"],), final, fields2, token=token)
            if moved != 1:
                for fid in ids.values():
                    if fid:
                        await store.files.delete(fid)
                return
            log.info("batch %s: %s (%s)", batch_id, final, files.kinds)

    async def _write(self, store: BatchStore, m: dict[str, str], files: OutputFiles) -> None:
        burst = m["burst"]
        limits = wire.Limits.from_settings(store.settings)
        total = int(await self.r.hget(store.keys.burst(burst), "total") or 0)
        for start in builtins.range(0, total, _FETCH):
            idx = list(builtins.range(start, min(total, start + _FETCH)))
            raw = await self.r.hmget(store.keys.results(burst), idx)
            lines = []
            for i, v in zip(idx, raw, strict=True):
                # a line that says what is wrong, rather than no files at all
                if v is None:  # not expected once the burst is finished
                    why = "no result was recorded"
                    res = Result(id="", index=i, error=why, error_code="internal_error")
                else:
                    res = read_stored(v, i, "", limits)
                if res.error_code == "internal_error" and not res.id:
                    rid = await self.r.lindex(store.keys.ids(burst), i)
                    res.id = (rid or b"").decode("utf-8", "replace")
                files.usage.add(res)
                lines.append(
                    format_result(
                        res, burst=burst, endpoint=m["endpoint"], model=m.get("model", "")
                    )
                )
            await files.write(lines)

    async def sweep(self) -> None:
        """One pass over every open batch of every namespace: two pipelined reads per namespace
        (the batch records, then their bursts' counters), then a step for each batch that needs
        one and whose lease is free."""
        for store in self.stores.values():
            ns = store.keys.ns
            await burst_end.expire_due(  # batches past their window
                self.r, store.settings, on_burst_done=self.on_burst_done
            )
            await store.files.sweep_expired()  # files past their expires_at (expiry.py)
            open_ids = {x.decode() for x in await self.r.smembers(store.keys.oai_open)}
            for key in [k for k in self.retry if k[0] == ns and k[1] not in open_ids]:
                del self.retry[key]  # finished elsewhere meanwhile
            # batches waiting out a failed step's backoff are read too: a cancel, or a window
            # that ends, goes at once (neither needs what the step waits for)
            ids = sorted(i for i in open_ids if (ns, i) not in self.busy)
            if not ids:
                continue
            pipe = self.r.pipeline(transaction=False)
            for batch_id in ids:
                pipe.hgetall(store.keys.oai_batch(batch_id))
            records = [_decode(h) for h in await pipe.execute()]
            pipe = self.r.pipeline(transaction=False)
            for m in records:
                pipe.hmget(store.keys.burst(m.get("burst") or "-"), ["total", "done", "failed"])
            counters = await pipe.execute()
            now = time.monotonic()
            for batch_id, m, st in zip(ids, records, counters, strict=True):
                backoff = self.retry.get((ns, batch_id), (0.0, 0.0))[0] > now
                await self._visit(store, batch_id, m, st, backoff)

    async def _visit(
        self,
        store: BatchStore,
        batch_id: str,
        m: dict[str, str],
        st: list[bytes | None],
        backoff: bool = False,
    ) -> None:
        status = m.get("status")
        if status is None or status in FINAL:
            await self.r.srem(store.keys.oai_open, batch_id)
            return
        cancelled_unqueued = status == "cancelling" and "total" not in m
        if status == "validating" and st[0] is None and time.time() >= _expires(m):
            step = self.expire  # never queued (no shard count, a step failing): its window ended
        elif backoff and not cancelled_unqueued:
            return  # a cancel before queueing needs nothing a failed step waits for
        elif status == "validating" or cancelled_unqueued:
            step = self.start
        elif st[0] is None:
            err = {
                "code": "internal_error",
                "message": f"The burst {m['burst']} is gone (expired or deleted).",
                "param": None,
                "line": None,
            }
            await store.move(batch_id, (status,), "failed", _failed([err]))
            return
        elif int(st[1] or 0) + int(st[2] or 0) < int(st[0]):
            return  # still running
        else:
            step = self.finalize
        token = await lease.acquire(self.r, store.keys.oai_lease(batch_id))
        if token is not None:
            self.spawn(store, batch_id, step(store, batch_id, token))

    async def run(self, interval: float = 0.5) -> None:
        """Sweep for ever (until cancelled), riding out Redis outages; partial uploads a killed
        server left are removed at start and every `UPLOADS_EVERY_S`."""
        uploads_due = 0.0
        while True:
            if time.monotonic() >= uploads_due:
                uploads_due = time.monotonic() + UPLOADS_EVERY_S
                for store in self.stores.values():
                    try:
                        store.files.sweep_uploads()
                    except OSError as e:
                        log.warning("removing stale partial uploads failed: %s", e)
            try:
                await self.sweep()
            except (*TRANSIENT, PrefixqError) as e:
                log.warning("sweeping batches failed: %s", e)
            raise_if_cancelled()  # a cancel a Redis call swallowed: the server is stopping
            await asyncio.sleep(interval)

    async def close(self) -> None:
        for t in list(self.tasks):
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
