"""A submitted burst's requests on their way to entries (`BurstRequests`): validated (parsed) a
chunk at a time, placed and encoded (encoding.py's `EntryEncoder`), and dropped once their entries
are sent, so that a submit holds at most one chunk of parsed requests beyond what its caller
holds; and the burst's request ids, which its record is created with before most requests are
parsed (`raw_id`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import redis.asyncio as aredis

from prefixq.affinity.placement import Placed, Placer
from prefixq.client.encoding import Encoded, EntryEncoder, Parts
from prefixq.client.items import ItemBuilder
from prefixq.client.request_file import RequestFile
from prefixq.core.entries import split_prefix
from prefixq.core.errors import ValidationError
from prefixq.core.inputs import IdCheck, normalize_one
from prefixq.core.openai_lines import is_openai_line
from prefixq.core.records import Request, id_text
from prefixq.core.settings import Settings


def raw_id(raw: Request | Mapping[str, Any], index: int) -> str:
    """The id request ``index`` of a burst gets once parsed (`Request.from_json`: ``custom_id`` of
    an OpenAI batch line, else ``id``, else its index), read without parsing it."""
    if isinstance(raw, Request):
        return raw.id
    rid = raw.get("custom_id") if is_openai_line(raw) else raw.get("id")
    if rid is None:
        return str(index)
    return str(rid) if isinstance(rid, str) else id_text(rid, f"requests[{index}]")


class BurstRequests:
    """The requests of one submit, by input index: ``validate`` a chunk, ``encode`` it, ``drop``
    it once sent."""

    def __init__(
        self,
        raw: Sequence[Request | Mapping[str, Any]],
        settings: Settings,
        *,
        r: aredis.Redis,
        items: ItemBuilder,
        enc: EntryEncoder,
    ) -> None:
        self.raw, self.s, self.r, self.items, self.enc = raw, settings, r, items, enc
        self.n = len(raw)
        #: a file checked as a whole already, whose requests are read again as they are encoded
        self.file = raw if isinstance(raw, RequestFile) else None
        #: each request's prefix fingerprint when its prefix is long enough to store once
        self.prefix_keys: list[Hashable | None] = []
        #: requests validated and not sent yet (each is dropped once its entry is sent)
        self.reqs: list[Request | None] = [None] * self.n
        self.parts: list[Parts | None] = [None] * self.n
        self.ids = IdCheck()
        #: the burst's kind of work (`Request.task`), set by its first request validated: a
        #: burst holds one kind, placed on the shards that serve it (affinity/serving.py)
        self.task: str | None = None

    def validate(self, idx: Sequence[int]) -> None:
        """Validate (and parse) requests ``idx`` not validated yet: each on its own (its entry's
        size included: `entry_size.check_size`), and its id across the burst; a checked file's are
        only read again."""
        for i in idx:
            if self.reqs[i] is not None:
                continue
            if self.file is not None:
                q = self.file[i]
            else:
                q = normalize_one(self.raw[i], i, self.s)  # its entry's size too
                self.ids.add(i, [q.id])
            if self.task is None:
                self.task = q.task
            elif q.task != self.task:
                where = f"line {self.file.line(i)}" if self.file is not None else f"requests[{i}]"
                raise ValidationError(
                    f"{where}: a burst holds one kind of work ({self.task} before it, "
                    f"{q.task} here): submit embeddings and generation requests apart"
                )
            self.reqs[i], self.parts[i] = q, split_prefix(q)

    async def encode(
        self, idx: Sequence[int], placer: Placer, shards: int, *, inline: bool = False
    ) -> tuple[Encoded, list[Placed]]:
        """Place and encode requests ``idx`` (validated)."""
        reqs, parts = self._validated(idx)
        items = [self.items.build(q, p[0]) for q, p in zip(reqs, parts, strict=True)]
        placed = await placer.place(self.r, items, shards)
        encoded = Encoded()
        keys = self.prefix_keys
        for q, part, pl, i in zip(reqs, parts, placed, idx, strict=True):
            # indexes need not touch
            one = self.enc.encode([q], [part], [pl], i, keys=[keys[i]], inline=inline)
            encoded.new_prefixes.update(one.new_prefixes)
            for shard, rows in one.by_shard.items():
                encoded.by_shard.setdefault(shard, []).extend(rows)
        return encoded, placed

    def _validated(self, idx: Sequence[int]) -> tuple[list[Request], list[Parts]]:
        reqs, parts = [], []
        for i in idx:
            q, p = self.reqs[i], self.parts[i]
            assert q is not None and p is not None, f"request {i} not validated"
            reqs.append(q)
            parts.append(p)
        return reqs, parts

    def drop(self, idx: Sequence[int]) -> None:
        """Requests ``idx`` are sent: what a submit holds stays one chunk of parsed requests."""
        for i in idx:
            self.reqs[i] = self.parts[i] = None

    def id_list(self) -> list[str]:
        """The burst's request ids in input order (a checked file's, or each request's: parsed
        already, or the id its parse will give it, since a cancel may need them before they are
        validated)."""
        if self.file is not None:
            return list(self.file.ids)
        return [self._raw_id(i) for i in range(self.n)]

    def _raw_id(self, i: int) -> str:
        q = self.reqs[i]
        return q.id if q is not None else raw_id(self.raw[i], i)
