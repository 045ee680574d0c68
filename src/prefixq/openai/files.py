"""The files store: file contents in a directory, file objects in Redis.

A file lives at ``<files_dir>/<namespace>/<file id>`` (``files_dir`` defaults to
``<cache_dir>/files``); its object (id, bytes, lines, created_at, filename, purpose) is a Redis hash
listed in a sorted set by creation time. A file may expire (``expires_at``; expiry.py): once that
time has come it is gone, answering 404 from the first access or sweep after it. Contents are
written under a temporary name and renamed into place before the object is recorded, so a listed
file is always complete. Several servers sharing a Redis must share ``files_dir`` too (one volume;
openai/files_volume.py refuses a server whose directory is another).
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import redis.asyncio as aredis

from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.engine.embedded_model import default_cache_dir
from prefixq.openai.apierror import bad_request, not_found
from prefixq.openai.expiry import PER_SWEEP, Clock, form_expires_after
from prefixq.openai.pages import Page, page
from prefixq.openai.uploads import receive

__all__ = ["FileStore", "files_root", "new_file_id"]

log = logging.getLogger(__name__)

#: purposes a client may upload with, and those the server writes
UPLOAD_PURPOSES = frozenset({"batch"})


_ID = re.compile(r"file-[0-9a-f]{24}")
#: an upload's partial content untouched this long is one a killed server left behind
STALE_UPLOAD_S = 3600.0
#: how long a removed file's place in the listing is kept for a cursor naming it
GONE_TTL_S = 7 * 24 * 3600


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def files_root(settings: Settings) -> Path:
    """The ``files_dir`` setting, or ``<cache_dir>/files``."""
    if settings.files_dir:
        return Path(settings.files_dir).expanduser()
    return default_cache_dir(settings.cache_dir) / "files"


def file_object(h: dict[bytes, bytes]) -> dict[str, Any]:
    """OpenAI's File object from its Redis hash."""
    m = {k.decode(): v.decode() for k, v in h.items()}
    return {
        "id": m["id"],
        "object": "file",
        "bytes": int(m["bytes"]),
        "created_at": int(m["created_at"]),
        "filename": m["filename"],
        "purpose": m["purpose"],
        "status": "processed",
        "status_details": None,
        "expires_at": int(float(m["expires_at"])) if m.get("expires_at") else None,
    }


class FileStore:
    """Files of one namespace; ``r`` is the server's shared asyncio Redis client."""

    def __init__(self, r: aredis.Redis, settings: Settings, namespace: str) -> None:
        self.r, self.settings, self.keys = r, settings, Keys(namespace)
        self.dir = files_root(settings) / namespace
        self.clock = Clock(settings)

    def path(self, file_id: str) -> Path:
        """Where a file's content lives; ids are the server's own (``file-`` + hex), and anything
        else (``..``, slashes) never names a path."""
        if not _ID.fullmatch(file_id):
            raise not_found("File", file_id)
        return self.dir / file_id

    def sweep_uploads(self, older_than_s: float = STALE_UPLOAD_S) -> int:
        """Remove partial uploads (``.upload-*``) not written to for ``older_than_s``: what a
        server killed mid-upload left (a live upload writes every chunk it gets); returns how
        many."""
        cutoff, n = time.time() - older_than_s, 0
        for tmp in self.dir.glob(".upload-*"):
            try:
                if tmp.stat().st_mtime < cutoff:
                    tmp.unlink()
                    n += 1
            except FileNotFoundError:  # finished or removed meanwhile
                continue
        if n:
            log.info("removed %d partial upload(s) left by a stopped server in %s", n, self.dir)
        return n

    async def sweep_expired(self) -> int:
        """Remove the files whose ``expires_at`` has come (object, listing and bytes), at most
        `PER_SWEEP` a call; returns how many."""
        due = await self.r.zrangebyscore(
            self.keys.oai_expiring, "-inf", self.clock.now(), start=0, num=PER_SWEEP
        )
        for raw in due:
            await self.remove(raw.decode())
        if due:
            log.info("%d expired file(s) removed from %s", len(due), self.dir)
        return len(due)

    async def upload(
        self, chunks: AsyncIterator[bytes], content_type: str | None
    ) -> dict[str, Any]:
        """Receive a multipart upload (fields ``purpose`` and ``file``) and record it."""
        self.dir.mkdir(parents=True, exist_ok=True)
        file_id = new_file_id()
        tmp = self.dir / f".upload-{file_id}"
        s = self.settings
        up = await receive(
            chunks, content_type, tmp, max_bytes=s.max_file_bytes, max_lines=s.max_file_lines
        )
        try:
            purpose = up.fields.get("purpose")
            if not up.got_file:
                raise bad_request("Missing required parameter: 'file'.", param="file")
            if purpose is None:
                raise bad_request("Missing required parameter: 'purpose'.", param="purpose")
            if purpose not in UPLOAD_PURPOSES:
                raise bad_request(
                    f"Invalid value for 'purpose': {purpose!r}; this server takes 'batch' files.",
                    param="purpose",
                    code="invalid_value",
                )
            expires_s = form_expires_after(up.fields)
            tmp.rename(self.path(file_id))
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        try:
            return await self.record(
                file_id, up.filename or "upload.jsonl", "batch", up.bytes, up.lines, expires_s
            )
        except BaseException:  # Redis unreachable: no object, so no content either
            self.path(file_id).unlink(missing_ok=True)
            raise

    async def record(
        self,
        file_id: str,
        filename: str,
        purpose: str,
        size: int,
        lines: int,
        expires_s: int | None = None,
    ) -> dict[str, Any]:
        """Record the object of a file already in place, expiring ``expires_s`` after its
        creation when given; returns it."""
        now = time.time()
        h: dict[str, Any] = {
            "id": file_id,
            "bytes": size,
            "lines": lines,
            "created_at": int(now),
            "filename": filename,
            "purpose": purpose,
        }
        pipe = self.r.pipeline(transaction=True)
        if expires_s is not None:
            h["expires_at"] = int(now) + expires_s
            pipe.zadd(self.keys.oai_expiring, {file_id: h["expires_at"]})
        pipe.hset(self.keys.oai_file(file_id), mapping=h)
        pipe.zadd(self.keys.oai_files, {file_id: int(now * 1000)})
        await pipe.execute()
        log.info("file %s: %s, %d bytes, %d lines (%s)", file_id, filename, size, lines, purpose)
        return file_object({k.encode(): str(v).encode() for k, v in h.items()})

    async def get(self, file_id: str) -> dict[str, Any]:
        """The File object; 404 if unknown, and for an expired file, which is removed here."""
        self.path(file_id)  # 404 for what cannot be an id
        h = await self.r.hgetall(self.keys.oai_file(file_id))
        if not h:
            raise not_found("File", file_id)
        obj = file_object(h)
        if obj["expires_at"] is not None and self.clock.now() >= obj["expires_at"]:
            await self.remove(file_id)
            raise not_found("File", file_id)
        return obj

    async def content(self, file_id: str) -> Path:
        """The path of an existing file's content (404 if unknown or gone from disk)."""
        await self.get(file_id)
        path = self.path(file_id)
        if not path.is_file():
            log.warning("file %s is recorded but missing from %s", file_id, self.dir)
            raise not_found("File", file_id)
        return path

    async def delete(self, file_id: str) -> dict[str, Any]:
        await self.get(file_id)  # 404 for an expired file too (removed there)
        if not await self.remove(file_id):
            raise not_found("File", file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    async def remove(self, file_id: str) -> bool:
        """Delete the object and its content, whichever exists; True if there was an object."""
        path = self.path(file_id)
        created = await self.r.zscore(self.keys.oai_files, file_id)
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self.keys.oai_file(file_id))
        pipe.zrem(self.keys.oai_files, file_id)
        pipe.zrem(self.keys.oai_expiring, file_id)
        if created is not None:  # a list's cursor may name it (openai/pages.py)
            pipe.set(self.keys.oai_file_gone(file_id), int(created), ex=GONE_TTL_S)
        deleted = (await pipe.execute())[0]
        path.unlink(missing_ok=True)
        return bool(deleted)

    async def list(self, *, after: str | None, limit: int, order: str, purpose: str | None) -> Page:
        """Files newest first (``order="desc"``) or oldest first, after the cursor ``after``."""

        async def fetch(ids: list[str]) -> list[dict[str, Any]]:
            pipe = self.r.pipeline(transaction=False)
            for i in ids:
                pipe.hgetall(self.keys.oai_file(i))
            return [file_object(h) for h in await pipe.execute() if h]

        now = self.clock.now()

        def keep(o: dict[str, Any]) -> bool:  # expired files are gone, whether swept yet or not
            live = o["expires_at"] is None or now < o["expires_at"]
            return live and (purpose is None or o["purpose"] == purpose)

        return await page(
            self.r,
            self.keys.oai_files,
            fetch,
            after=after,
            limit=limit,
            order=order,
            keep=keep,
            gone=self.keys.oai_file_gone,
        )
