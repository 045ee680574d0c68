"""`Producer`: validate a burst, place each request on a shard, enqueue it in pipelined XADDs.

A burst is written in this order: shared prefixes (content-addressed, ``SET NX`` + TTL), the burst
record (total, settings, byte counts), then the entries, shard by shard, in pipelines of
``_CHUNK`` commands, each pipeline also raising the shard's outstanding-prefill counter.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aredis
from redis.exceptions import NoPermissionError

from prefixq import wire
from prefixq.affinity.placement import (
    HashPlacer,
    Placed,
    Placer,
    RandomPlacer,
    RoundRobinPlacer,
)
from prefixq.affinity.prefix_map import AffinityPlacer
from prefixq.connection import TRANSIENT, async_client, describe
from prefixq.deployment import resolve_shards
from prefixq.entries import digest, prefix_size, split_prefix, to_wire
from prefixq.errors import ValidationError
from prefixq.inputs import normalize
from prefixq.keys import FIELD, Keys
from prefixq.producer.items import ItemBuilder
from prefixq.records import Request
from prefixq.settings import Settings

log = logging.getLogger(__name__)

_CHUNK = 1024
#: request ids per RPUSH of the burst's id list
_IDS_CHUNK = 10_000
#: the first chunk is small, so the engines start while the rest is encoded
_FIRST_CHUNK = 16
#: called with (requests enqueued so far, total)
Progress = Callable[[int, int], None]


def new_burst_id() -> str:
    """Sortable and unique: UTC time plus 6 random hex digits."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


@dataclass(slots=True)
class _Encoded:
    now: float
    deadline: float | None = None
    raw_bytes: int = 0
    entry_bytes: int = 0


class Producer:
    """Submits bursts. ``submit`` blocks; ``asubmit`` is the same inside an event loop."""

    def __init__(
        self, settings: Settings | None = None, *, tokenizer: Any = None, model: str = ""
    ) -> None:
        self.settings = settings or Settings.from_env()
        self.keys = Keys(self.settings.namespace)
        self.items = ItemBuilder(self.settings, tokenizer=tokenizer, model=model)

    def submit(self, requests: Iterable[Request | Mapping[str, Any]], **options: Any) -> str:
        """Enqueue a burst; returns its id. Options as for `asubmit`."""
        return asyncio.run(self.asubmit(requests, **options))

    async def asubmit(
        self,
        requests: Iterable[Request | Mapping[str, Any]],
        *,
        burst_id: str | None = None,
        placement: str | None = None,
        on_complete: str | None = None,
        rq_queue: str | None = None,
        progress: Progress | None = None,
        seed: int | None = None,
        deadline: float | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> str:
        """Validate, place and enqueue ``requests``; returns the burst id.

        ``placement`` overrides the setting (a name, or a `Placer` of your own);
        ``on_complete`` ("pkg.module:func") is enqueued as an RQ job on ``rq_queue`` with the
        burst id once the burst's last request is recorded. ``deadline`` (epoch seconds): requests
        not admitted by then get an expired result. ``metadata``: string pairs kept on the burst
        record (field ``metadata``, JSON).
        """
        s = self.settings
        reqs = normalize(requests, s)
        burst = burst_id or new_burst_id()
        extra: dict[str, Any] = {}
        if deadline is not None:
            if not math.isfinite(deadline):
                raise ValidationError(f"deadline must be finite epoch seconds, not {deadline!r}")
            extra["deadline"] = deadline
        if metadata:
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
                raise ValidationError("metadata must map strings to strings")
            extra["metadata"] = json.dumps(dict(metadata), ensure_ascii=False)
        r = async_client(s)
        try:
            return await self._submit(
                r,
                reqs,
                burst,
                placement or s.placement,
                on_complete,
                rq_queue,
                progress,
                seed,
                extra,
            )
        except (*TRANSIENT, NoPermissionError) as e:  # ACL refusals become ConfigError too
            raise describe(s, e) from e
        finally:
            await r.aclose()

    async def _submit(
        self,
        r: aredis.Redis,
        reqs: list[Request],
        burst: str,
        placement: str | Placer,
        on_complete: str | None,
        rq_queue: str | None,
        progress: Progress | None,
        seed: int | None,
        extra: dict[str, Any],
    ) -> str:
        s, keys = self.settings, self.keys
        if on_complete is not None and ":" not in on_complete:
            raise ValidationError("on_complete must look like 'package.module:function'")
        shards = await resolve_shards(r, s)
        if await r.exists(keys.burst(burst)):
            raise ValidationError(f"burst {burst!r} already exists")
        parts = [split_prefix(q) for q in reqs]
        items = [self.items.build(q, p) for q, (p, _) in zip(reqs, parts, strict=True)]
        placer = await self._placer(r, placement, seed)
        placed = await placer.place(r, items, shards)
        prefixes, refs = self._prefixes(parts)
        new_bytes = await self._store_prefixes(r, prefixes)
        enc = _Encoded(now=time.time())
        per_shard = Counter(p.shard for p in placed)
        meta: dict[str, Any] = {
            "total": len(reqs),
            "done": 0,
            "failed": 0,
            "created": enc.now,
            "status": "queued",
            "shards": shards,
            "codec": s.codec,
            "placement": placement if isinstance(placement, str) else type(placement).__name__,
            "per_shard": ",".join(str(per_shard[k]) for k in range(shards)),
            "prefixes": len(prefixes),
            "prefix_bytes": new_bytes,
            "prefix_bytes_reused": sum(len(v) for v, _ in prefixes.values()) - new_bytes,
        }
        if on_complete:
            meta["on_complete"] = on_complete
            meta["rq_queue"] = rq_queue or "default"
        meta.update(extra)
        pipe = r.pipeline(transaction=False)
        pipe.hset(keys.burst(burst), mapping=meta)
        pipe.expire(keys.burst(burst), s.result_ttl_s)
        pipe.zadd(keys.bursts, {burst: enc.now})
        for start in range(0, len(reqs), _IDS_CHUNK):  # request ids in input order
            pipe.rpush(keys.ids(burst), *(q.id for q in reqs[start : start + _IDS_CHUNK]))
        pipe.expire(keys.ids(burst), s.result_ttl_s)
        if "deadline" in extra:
            pipe.zadd(keys.deadlines, {burst: extra["deadline"]})
        await pipe.execute()
        enc.deadline = extra.get("deadline")
        # encode and send in growing chunks, so the first requests reach the workers while the
        # rest are still being encoded
        start, size = 0, _FIRST_CHUNK
        while start < len(reqs):
            end = min(len(reqs), start + size)
            by_shard = self._encode(reqs, parts, placed, refs, burst, prefixes, enc, start, end)
            await self._enqueue(r, by_shard)
            if progress:
                progress(end, len(reqs))
            start, size = end, min(size * 4, _CHUNK)
        sizes = {
            "raw_bytes": enc.raw_bytes,
            "entry_bytes": enc.entry_bytes,
            "encoded_bytes": enc.entry_bytes + new_bytes,
        }
        await r.hset(keys.burst(burst), mapping=sizes)
        log.info(
            "burst %s: %d requests on %d shards (%s), %d -> %d bytes",
            burst,
            len(reqs),
            shards,
            meta["per_shard"],
            enc.raw_bytes,
            sizes["encoded_bytes"],
        )
        return burst

    def _prefixes(
        self, parts: list[tuple[dict[str, Any] | None, dict[str, Any]]]
    ) -> tuple[dict[str, tuple[bytes, int]], list[str | None]]:
        """Prefixes worth storing once (digest -> (encoded, packed size)) and each request's
        reference. A prefix is stored once when at least two requests of the burst share it and
        it is long enough; a prefix used once travels inline (a separate key would only add a
        write and a read)."""
        s = self.settings
        packed = [
            wire.pack(p) if p is not None and prefix_size(p) >= s.prefix_store_min_chars else None
            for p, _ in parts
        ]
        uses = Counter(b for b in packed if b is not None)
        stored: dict[str, tuple[bytes, int]] = {}
        refs: list[str | None] = []
        for b in packed:
            ref = None
            if b is not None and uses[b] > 1:
                ref = digest(b)
                if ref not in stored:
                    stored[ref] = (wire.compress(b, s.codec, s.codec_level), len(b))
            refs.append(ref)
        return stored, refs

    def _encode(
        self,
        reqs: list[Request],
        parts: list[tuple[dict[str, Any] | None, dict[str, Any]]],
        placed: list[Placed],
        refs: list[str | None],
        burst: str,
        prefixes: dict[str, tuple[bytes, int]],
        enc: _Encoded,
        start: int,
        end: int,
    ) -> dict[int, list[tuple[bytes, int]]]:
        """Encode requests [start, end); returns shard -> [(entry, work)] and counts bytes."""
        s = self.settings
        by_shard: dict[int, list[tuple[bytes, int]]] = defaultdict(list)
        inline_key, ref_key = len(wire.pack("x")), len(wire.pack("xr"))
        for i in range(start, end):
            q, (prefix, own), pl, ref = reqs[i], parts[i], placed[i], refs[i]
            entry = to_wire(
                q,
                prefix=prefix,
                prefix_ref=ref,
                burst=burst,
                index=i,
                shard=pl.shard,
                enqueued=enc.now,
                work=pl.work,
                predicted_cached=pl.predicted_cached,
                own=own,
                deadline=enc.deadline,
            )
            packed = wire.pack(entry)
            data = wire.compress(packed, s.codec, s.codec_level)
            if len(data) > s.max_entry_bytes:
                raise ValidationError(
                    f"request {i} ({q.id!r}) encodes to {len(data)} bytes, "
                    f"over max_entry_bytes={s.max_entry_bytes}"
                )
            # raw = the same entry with its prefix inline, without packing it twice
            raw = len(packed)
            if ref is not None:
                raw += inline_key + prefixes[ref][1] - ref_key - len(wire.pack(ref))
            enc.raw_bytes += raw
            enc.entry_bytes += len(data)
            by_shard[pl.shard].append((data, pl.work))
        return by_shard

    async def _store_prefixes(self, r: aredis.Redis, prefixes: dict[str, tuple[bytes, int]]) -> int:
        """SET NX each prefix (refreshing its TTL); returns the bytes newly stored."""
        if not prefixes:
            return 0
        ttl = self.settings.prefix_ttl_s
        pipe = r.pipeline(transaction=False)
        for ref, (value, _) in prefixes.items():
            pipe.set(self.keys.prefix(ref), value, nx=True, ex=ttl)
            pipe.expire(self.keys.prefix(ref), ttl)
        done = await pipe.execute()
        sizes = [len(v) for v, _ in prefixes.values()]
        return sum(n for n, new in zip(sizes, done[::2], strict=True) if new)

    async def _enqueue(self, r: aredis.Redis, by_shard: dict[int, list[tuple[bytes, int]]]) -> None:
        """XADD a chunk of entries in one pipeline that also raises each shard's load counter."""
        pipe = r.pipeline(transaction=False)
        for shard, datas in sorted(by_shard.items()):
            stream = self.keys.stream(shard)
            for data, _ in datas:
                pipe.xadd(stream, {FIELD: data})
            pipe.hincrby(self.keys.load, str(shard), sum(w for _, w in datas))
        await pipe.execute()

    async def _placer(self, r: aredis.Redis, name: str | Placer, seed: int | None) -> Placer:
        if not isinstance(name, str):
            return name
        if name == "affinity":
            block = await r.hget(self.keys.config, "block_size")
            return AffinityPlacer(self.settings, engine_block=int(block or 0))
        if name == "random":
            return RandomPlacer(seed)
        if name == "round-robin":
            return RoundRobinPlacer()
        if name == "hash":
            return HashPlacer()
        raise ValidationError(f"unknown placement {name!r} (affinity, hash, random, round-robin)")
