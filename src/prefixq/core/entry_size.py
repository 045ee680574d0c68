"""How large a request's stream entry may be: `check_size` refuses, at the producer, a request whose
entry a worker would refuse to decode (``max_decoded_bytes``) or read (``max_entry_bytes``), with
a cheap upper bound (`packed_bound`) so that most requests are never packed to find out."""

from __future__ import annotations

from typing import Any

from prefixq.core import wire
from prefixq.core.entries import split_prefix, to_wire
from prefixq.core.errors import ValidationError
from prefixq.core.records import Request
from prefixq.core.settings import Settings

#: what the fields a burst adds to an entry (its id, counters, deadline, priority, tenant, anchor,
#: group, ancestor) may take in msgpack beyond what `check_size` packs them as
ENVELOPE_BYTES = 512


def _bound(value: Any) -> int:
    """An upper bound of the msgpack size of a validated value (strings at most 4 bytes a
    character, numbers at most 9 bytes, container headers at most 5)."""
    if isinstance(value, str):
        return 5 + 4 * len(value)
    if isinstance(value, dict):
        return 5 + sum(_bound(k) + _bound(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return 5 + sum(map(_bound, value))
    return 9


def packed_bound(req: Request) -> int:
    """An upper bound of the msgpack size of ``req``'s entry with its prefix inline (UTF-8 is at
    most 4 bytes a character, msgpack at most 9 bytes an integer), in microseconds for a prompt:
    only messages, sampling values and the echo are walked (a few values each, as a rule)."""
    text = len(req.prompt or "") + (len(req.prefix) if isinstance(req.prefix, str) else 0)
    ids = len(req.prompt_token_ids or ()) + (len(req.prefix) if isinstance(req.prefix, list) else 0)
    for x in req.inputs or ():
        text, ids = (text + len(x), ids) if isinstance(x, str) else (text, ids + len(x))
    text += len(req.id) + len(req.model or "") + len(req.refusal or "")
    raw = 4 * text + 9 * ids + 8 * len(req.inputs or ()) + 1024
    if req.messages:
        raw += _bound(req.messages)
    if req.sampling:
        raw += _bound(req.sampling)
    if req.echo:
        raw += _bound(req.echo)
    if req.pooling:
        raw += _bound(req.pooling)
    return raw


def check_size(req: Request, settings: Settings, where: str) -> None:
    """ValidationError if ``req``'s entry (prefix inline) is one a worker refuses to decode:
    over ``max_decoded_bytes`` as msgpack (with `ENVELOPE_BYTES` for the fields a burst adds), or
    over ``max_entry_bytes`` compressed with the settings' codec. Only requests whose
    `packed_bound` is over a limit (compression adding at most a few bytes per 16 KB) are packed
    (and compressed) to find out."""
    limit, decoded = settings.max_entry_bytes, settings.max_decoded_bytes
    raw = packed_bound(req)
    small = raw + raw // 1000 + 64 <= limit
    if small and raw + ENVELOPE_BYTES <= decoded:
        return
    prefix, own = split_prefix(req)
    entry = to_wire(
        req,
        burst="",
        index=0,
        shard=0,
        enqueued=0.0,
        work=0,
        predicted_cached=0,
        prefix=prefix,
        prefix_ref=None,
        own=own,
    )
    packed = wire.pack(entry)
    if len(packed) + ENVELOPE_BYTES > decoded:
        raise ValidationError(
            f"{where}: packs into {len(packed)} bytes of msgpack (before compression), over "
            f"max_decoded_bytes={decoded} less {ENVELOPE_BYTES} for its entry's fields (a "
            "worker would refuse to decode it); shorten it or raise PREFIXQ_MAX_DECODED_BYTES on "
            "producers and workers alike"
        )
    if small:
        return
    n = len(wire.compress(packed, settings.codec, settings.codec_level))
    if n > limit:
        raise ValidationError(
            f"{where}: encodes to {n} bytes, over max_entry_bytes={limit} (a worker would refuse "
            "it); shorten it or raise PREFIXQ_MAX_ENTRY_BYTES on producers and workers alike"
        )
