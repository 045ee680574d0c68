"""Entries of one burst: which prefixes are stored once, the encoded entries, their byte counts.

A shared prefix (a document, a system prompt) long enough (``prefix_store_min_chars``) and used by
two or more requests of the burst is stored once, content-addressed (`Keys.prefix`), and the
entries refer to it by digest; a prefix used once travels inline (a separate key would only add a
write and a read). Uses are counted over the whole burst by a cheap fingerprint of each prefix
(the groups of `prefixq.client.order.Peek`, computed once per request before the burst's head
goes out), before the encoding of the burst's body; the burst's small head carries its prefixes
inline. What the encoder keeps between chunks grows with the distinct prefixes (a use count and
a digest each), never with the requests.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from prefixq.core import wire
from prefixq.core.entries import digest, to_wire
from prefixq.core.errors import ValidationError
from prefixq.core.records import Request
from prefixq.core.settings import Settings
from prefixq.core.sharing import DEFAULT_PRIORITY, DEFAULT_TENANT

#: a prefix object (`entries.split_prefix`) and the request's own part
Parts = tuple[dict[str, Any] | None, dict[str, Any]]


@dataclass(slots=True)
class Sizes:
    """Byte counts of a burst (kept on its record)."""

    #: the entries as they would be with every prefix inline, uncompressed
    raw: int = 0
    #: the encoded entries
    entries: int = 0
    #: prefixes stored by this burst (not already in Redis)
    prefixes_new: int = 0
    #: prefixes the burst refers to that were already stored
    prefixes_reused: int = 0
    #: distinct prefixes the burst stored or referred to
    prefixes: int = 0


@dataclass(slots=True)
class Encoded:
    """One chunk, ready to send: entries by shard, and the prefixes they refer to."""

    #: shard -> [(entry bytes, estimated work)]
    by_shard: dict[int, list[tuple[bytes, int]]] = field(default_factory=dict)
    #: digest -> compressed prefix, first referred to in this chunk
    new_prefixes: dict[str, bytes] = field(default_factory=dict)


def _fingerprint(value: Any) -> tuple[Any, ...]:
    """A cheap content key of a prefix's value (text, token ids or messages): equal values get
    equal keys, in every process (its last item is the group's pass key: client/shared_pass.py);
    a collision only makes a single-use prefix travel by reference."""
    if isinstance(value, str):
        return ("x", len(value), xxhash.xxh3_64_intdigest(value.encode("utf-8", "surrogatepass")))
    try:
        return ("t", len(value), xxhash.xxh3_64_intdigest(array("q", value).tobytes()))
    except (TypeError, OverflowError, ValueError):  # messages, or not token ids at all
        return ("m", xxhash.xxh3_64_intdigest(wire.pack(value)))


def pass_key(fingerprint: Hashable) -> int | None:
    """A prefix group's key in the shared pass (client/shared_pass.py): the 64-bit content hash
    that ends its `_fingerprint`, the same in every process."""
    last = fingerprint[-1] if isinstance(fingerprint, tuple) and fingerprint else None
    return last if isinstance(last, int) else None


class EntryEncoder:
    """Encodes one burst's entries, chunk by chunk."""

    def __init__(self, settings: Settings, *, burst: str, enqueued: float) -> None:
        self.s = settings
        self.burst = burst
        self.enqueued = enqueued
        self.deadline: float | None = None
        self.priority = DEFAULT_PRIORITY
        self.tenant = DEFAULT_TENANT
        self.sizes = Sizes()
        self._uses: Counter[Hashable] = Counter()
        #: digest -> packed size, of the prefixes already decided by reference
        self._stored: dict[str, int] = {}
        #: the last prefix value packed, its digest and packed size (consecutive requests of a
        #: group often hold the same object)
        self._last: tuple[Any, str, int] | None = None
        self._inline_key = len(wire.pack("x"))
        self._ref_key = len(wire.pack("xr"))

    def count(self, keys: Iterable[Hashable | None]) -> None:
        """Count the uses of each long prefix (call once, over the whole burst): ``keys`` are
        the requests' prefix fingerprints, None for a request without a long one."""
        self._uses.update(k for k in keys if k is not None)

    @property
    def uses(self) -> Mapping[Hashable, int]:
        """Each long prefix's uses in the burst (`count`), in the order they first came."""
        return self._uses

    def long_enough(self, size: int) -> bool:
        """Whether a prefix of `prefix_size` ``size`` may be stored once."""
        return size >= self.s.prefix_store_min_chars

    def _digest(self, prefix: dict[str, Any]) -> tuple[str, int, bytes | None]:
        """(digest, packed size, packed bytes unless the same object was just packed)."""
        ((_, value),) = prefix.items()
        last = self._last
        if last is not None and last[0] is value:
            return last[1], last[2], None
        packed = wire.pack(prefix)
        d = digest(packed)
        self._last = (value, d, len(packed))
        return d, len(packed), packed

    def encode(
        self,
        reqs: list[Request],
        parts: list[Parts],
        placed: list[Any],
        start: int,
        *,
        keys: Sequence[Hashable | None] | None = None,
        inline: bool = False,
    ) -> Encoded:
        """Entries for requests ``start .. start + len(reqs)``; ``keys`` their prefix
        fingerprints (as counted); ``inline``: every prefix travels inline and entries are not
        compressed (the head: read within milliseconds and deleted once acked, so storing its
        prefixes once or compressing it would only delay the engines' start); an entry that packs
        into fewer than `wire.COMPRESS_FROM` bytes is never compressed. ValidationError for
        an entry over ``max_entry_bytes``, or over ``max_decoded_bytes`` before compression
        (naming its 1-based position in the burst)."""
        s, out = self.s, Encoded()
        codec = "none" if inline else s.codec
        for k, (q, (prefix, own), pl) in enumerate(zip(reqs, parts, placed, strict=True)):
            i = start + k
            ref: str | None = None
            extra = 0  # what the prefix adds to the raw size when it travels by reference
            key = keys[k] if keys is not None else None
            # shared: another request of the burst has the prefix; only then is it stored once
            # (`ref`) and marks a group (the shared pass and the worker's KV budget keep room
            # for nothing else)
            shared = key is not None and self._uses[key] > 1
            if prefix is not None and not inline and shared:
                ref, size, packed = self._digest(prefix)
                if ref not in self._stored:
                    self._stored[ref] = size
                    if packed is None:
                        packed = wire.pack(prefix)
                    value = wire.compress(packed, s.codec, s.codec_level)
                    self._check(len(value), i, q, "its shared prefix", size)
                    out.new_prefixes[ref] = value
                extra = self._inline_key + size - self._ref_key - len(wire.pack(ref))
            # a long prefix of its own carries its pass key all the same (`lone`): the worker's
            # pass window follows it (a later burst over the same documents starts there)
            pk = pass_key(key) if key is not None else None
            group, lone = (pk, None) if shared else (None, pk)
            entry = to_wire(
                q,
                prefix=None if ref is not None else prefix,
                prefix_ref=ref,
                burst=self.burst,
                index=i,
                shard=pl.shard,
                enqueued=self.enqueued,
                work=pl.work,
                predicted_cached=pl.predicted_cached,
                anchor=pl.anchor,
                group=group,
                lone_key=lone,
                ancestor=(
                    (pl.ancestor, pl.ancestor_tokens)
                    if group is not None and pl.ancestor is not None
                    else None
                ),
                own=own,
                deadline=self.deadline,
                priority=self.priority,
                tenant=self.tenant,
            )
            packed_entry = wire.pack(entry)
            small = len(packed_entry) < wire.COMPRESS_FROM
            data = wire.compress(packed_entry, "none" if small else codec, s.codec_level)
            if len(data) > s.max_entry_bytes and codec != s.codec:  # too big unless compressed
                data = wire.compress(packed_entry, s.codec, s.codec_level)
            self._check(len(data), i, q, "it", len(packed_entry))
            self.sizes.raw += len(packed_entry) + extra
            self.sizes.entries += len(data)
            out.by_shard.setdefault(pl.shard, []).append((data, pl.work))
        return out

    def stored(self, new: dict[str, bytes], fresh: list[bool]) -> None:
        """Account for prefixes sent with ``SET NX`` (``fresh``: whether each was new)."""
        for value, was_new in zip(new.values(), fresh, strict=True):
            self.sizes.prefixes += 1
            if was_new:
                self.sizes.prefixes_new += len(value)
            else:
                self.sizes.prefixes_reused += len(value)

    def _check(self, n: int, i: int, q: Request, what: str, packed: int) -> None:
        """ValidationError unless a worker can decode what encodes to ``n`` bytes, ``packed``
        bytes of msgpack (`entry_size.check_size` refused such a request already, as a rule)."""
        if n > self.s.max_entry_bytes:
            raise ValidationError(
                f"request {i + 1} ({q.id!r}): {what} encodes to {n} bytes, over "
                f"max_entry_bytes={self.s.max_entry_bytes}"
            )
        if packed > self.s.max_decoded_bytes:
            raise ValidationError(
                f"request {i + 1} ({q.id!r}): {what} packs into {packed} bytes of msgpack, over "
                f"max_decoded_bytes={self.s.max_decoded_bytes}"
            )
