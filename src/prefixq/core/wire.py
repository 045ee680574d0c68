"""Bytes layer of the wire format: msgpack, a codec tag, bounded decoding.

docs/architecture.md, decision 3, says why.

An entry is one codec tag byte (`CODEC_TAGS`) followed by the payload: ``none`` (raw msgpack),
``zlib`` (a zlib stream, level 1 by default) or ``zstd`` (one frame with content size and
checksum, level 3 by default). zlib entries are made by the standard library's zlib (its bytes
are the format's reference) and inflated by ISA-L's (`isal_zlib`: the same bytes out, ~1.6 times
as fast; inflating a 16 KB prompt's entry was most of a worker's CPU per request). Decoding
trusts nothing: the entry size, the decompressed size, msgpack str/bin/array/map lengths and
nesting depth are capped by `Limits`; ext types, trailing bytes and truncated data are refused.
Every failure is a `WireError` (`LimitExceeded` for a cap).
"""

from __future__ import annotations

import re
import threading
import zlib
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import msgpack
import zstandard

from prefixq.core.errors import LimitExceeded, WireError

_inflater: ModuleType = zlib
try:  # a dependency; a machine staged by hand without it (the GPU runs) inflates as before
    from isal import isal_zlib

    _inflater = isal_zlib
except ImportError:  # pragma: no cover - the tests run with isal installed
    pass

if TYPE_CHECKING:
    from prefixq.core.settings import Settings

CODEC_TAGS: dict[str, int] = {"none": 0x00, "zlib": 0x01, "zstd": 0x02}
_TAG_BYTES = {name: bytes((tag,)) for name, tag in CODEC_TAGS.items()}
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_LEN_ERROR = re.compile(r"(\d+) exceeds max_(\w+)_len")
#: the fixed caps of `Limits`: a producer checks every value it accepts against them
#: (core/checks.py), so that a worker can decode whatever it enqueues
MAX_STR_BYTES = 16 << 20
MAX_ARRAY_LEN = 1 << 20
MAX_MAP_LEN = 4096
_LEN_FIELDS = {
    "str": ("max_str_len", "bytes"),
    "bin": ("max_str_len", "bytes"),
    "array": ("max_array_len", "items"),
}


class _Codecs(threading.local):
    """Codec state reused on the hot path, one set per thread: the Packer and zstd's
    (de)compressors are not thread-safe (zstd's release the GIL: two threads sharing one
    crashed the process), and the producer and result readers run on callers' threads too."""

    def __init__(self) -> None:
        self.packer = msgpack.Packer(use_bin_type=True)
        self.zstd_c: dict[int, zstandard.ZstdCompressor] = {}
        self.zstd_d = zstandard.ZstdDecompressor()


_CODECS = _Codecs()
#: what decompressing a corrupt entry raises (ISA-L's error is not a subclass of zlib's)
_CORRUPT: tuple[type[BaseException], ...] = (
    _inflater.error,
    zlib.error,
    zstandard.ZstdError,
    MemoryError,
)


@dataclass(frozen=True, slots=True)
class Limits:
    """Caps applied while decoding one entry; every one raises `LimitExceeded` when hit."""

    max_entry_bytes: int = 4 << 20  # encoded (tag + compressed) size
    max_decoded_bytes: int = 32 << 20  # decompressed msgpack size
    max_str_len: int = MAX_STR_BYTES  # msgpack max_str_len / max_bin_len
    max_array_len: int = MAX_ARRAY_LEN
    max_map_len: int = MAX_MAP_LEN
    max_depth: int = 32  # nesting depth of maps/arrays

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        """Limits for the entry and decoded sizes that `settings` configures."""
        return cls(
            max_entry_bytes=settings.max_entry_bytes,
            max_decoded_bytes=settings.max_decoded_bytes,
            max_str_len=min(settings.max_decoded_bytes, MAX_STR_BYTES),
        )


DEFAULT_LIMITS = Limits()


def pack(obj: object) -> bytes:
    """msgpack bytes of `obj` (bin type for bytes); WireError if it holds an unpackable value."""
    try:
        return _CODECS.packer.pack(obj)
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(f"cannot pack {type(obj).__name__}: {e}") from e


def _refuse_ext(code: int, data: bytes) -> Any:
    raise WireError(f"msgpack ext type {code} is not allowed")


def unpack(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Exactly one msgpack object from `data`, within `limits`."""
    n = len(data)
    if n > limits.max_decoded_bytes:
        raise LimitExceeded(
            f"msgpack is {n} bytes, past {limits.max_decoded_bytes} (max_decoded_bytes)"
        )
    containers = 0

    def count(o: Any) -> Any:  # list/object hook: depth <= number of containers
        nonlocal containers
        containers += 1
        return o

    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=False,
            object_hook=count,
            list_hook=count,
            ext_hook=_refuse_ext,
            max_str_len=limits.max_str_len,
            max_bin_len=limits.max_str_len,
            # containers are preallocated at their declared length: cap it by the bytes present
            max_array_len=min(limits.max_array_len, n),
            max_map_len=min(limits.max_map_len, n),
            max_ext_len=0,
        )
    except msgpack.ExtraData:
        raise WireError("trailing bytes after the msgpack object") from None
    except msgpack.StackError:
        raise LimitExceeded(f"msgpack nested past {limits.max_depth} levels (max_depth)") from None
    except msgpack.FormatError:
        raise WireError("invalid msgpack: reserved type byte 0xc1") from None
    except (ValueError, TypeError, MemoryError, RecursionError) as e:
        raise _unpack_error(str(e) or type(e).__name__, limits) from None
    if containers > limits.max_depth:
        _check_depth(obj, limits.max_depth)
    return obj


def _unpack_error(msg: str, limits: Limits) -> WireError:
    m = _LEN_ERROR.search(msg)
    if m is None:
        if "incomplete input" in msg:
            return WireError("truncated msgpack (incomplete input)")
        if "timestamp" in msg:  # ext type -1, checked by msgpack before ext_hook runs
            return WireError("msgpack ext types are not allowed (timestamp)")
        return WireError(f"invalid msgpack: {msg}")
    declared, kind = int(m.group(1)), m.group(2)
    if kind == "ext":
        return WireError("msgpack ext types are not allowed")
    field, unit = _LEN_FIELDS.get(kind, ("max_map_len", "pairs"))
    cap: int = getattr(limits, field)
    if declared > cap:
        return LimitExceeded(f"msgpack {kind} of {declared} {unit}, past {cap} ({field})")
    return WireError(
        f"truncated msgpack: {kind} declares {declared} {unit}, more than the data holds"
    )


def _check_depth(obj: Any, max_depth: int) -> None:
    """LimitExceeded if maps/arrays nest deeper than `max_depth`; iterative, level by level."""
    level = [obj] if type(obj) in (dict, list) else None
    depth = 0
    while level:
        depth += 1
        if depth > max_depth:
            raise LimitExceeded(f"msgpack nested past {max_depth} levels (max_depth)")
        nested = []
        for o in level:
            for v in o.values() if type(o) is dict else o:
                if type(v) is dict or type(v) is list:
                    nested.append(v)
        level = nested


def compress(raw: bytes, codec: str = "zlib", level: int = -1) -> bytes:
    """The tag byte of `codec` + `raw` compressed; level -1 is zlib 1, zstd 3."""
    try:
        if codec == "zlib":
            return _TAG_BYTES["zlib"] + zlib.compress(raw, 1 if level == -1 else level)
        if codec == "zstd":
            level = 3 if level == -1 else level
            c = _CODECS.zstd_c.get(level)
            if c is None:
                c = _CODECS.zstd_c[level] = zstandard.ZstdCompressor(
                    level=level, write_checksum=True
                )
            return _TAG_BYTES["zstd"] + c.compress(raw)
    except (zlib.error, zstandard.ZstdError, ValueError) as e:
        raise WireError(f"cannot compress with {codec} level {level}: {e}") from e
    if codec == "none":
        return _TAG_BYTES["none"] + raw
    raise WireError(f"unknown codec {codec!r} (expected one of {', '.join(CODEC_TAGS)})")


def decompress(data: bytes, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """The msgpack bytes inside one entry, never more than `limits.max_decoded_bytes`."""
    if not data:
        raise WireError("empty entry")
    if len(data) > limits.max_entry_bytes:
        raise LimitExceeded(
            f"entry is {len(data)} bytes, past {limits.max_entry_bytes} (max_entry_bytes)"
        )
    tag, payload, cap = data[0], data[1:], limits.max_decoded_bytes
    try:
        if tag == 0x01:
            return _inflate(payload, cap)
        if tag == 0x02:
            return _unzstd(payload, cap)
    except _CORRUPT as e:
        raise WireError(f"corrupt {'zlib' if tag == 1 else 'zstd'} entry: {e}") from None
    if tag == 0x00:
        if len(payload) > cap:
            raise LimitExceeded(f"entry is {len(payload)} bytes, past {cap} (max_decoded_bytes)")
        return payload
    raise WireError(f"unknown codec tag 0x{tag:02x}")


def decompress_head(data: bytes, n: int) -> bytes:
    """At most the first ``n`` bytes of the msgpack inside an entry, however large or broken the
    rest (a dead letter's leading fields: store/dead_letters.py); WireError if not even they
    come out. Entry size and decoded size are not checked: only ``n`` bytes are made."""
    if not data:
        raise WireError("empty entry")
    tag, payload = data[0], memoryview(data)[1:]
    try:
        if tag == 0x00:
            return bytes(payload[:n])
        if tag == 0x01:
            out: bytes = _inflater.decompressobj().decompress(payload, n)
            return out
        if tag == 0x02:  # a stream reader of its own, from this thread's decompressor
            reader = _CODECS.zstd_d.stream_reader(payload)
            chunks: list[bytes] = []
            got = 0
            while got < n and (chunk := reader.read(n - got)):
                chunks.append(chunk)
                got += len(chunk)
            return b"".join(chunks)
    except _CORRUPT as e:
        raise WireError(f"corrupt entry: {e}") from None
    raise WireError(f"unknown codec tag 0x{tag:02x}")


def _inflate(payload: bytes, cap: int) -> bytes:
    d = _inflater.decompressobj()
    out: bytes = d.decompress(payload, cap + 1)
    if len(out) > cap or d.unconsumed_tail:
        raise LimitExceeded(f"zlib entry inflates past {cap} bytes (max_decoded_bytes)")
    # All input was consumed below the cap, so nothing is left buffered for flush() to return.
    if not d.eof:
        raise WireError("truncated zlib entry")
    if d.unused_data:
        raise WireError(f"{len(d.unused_data)} bytes of trailing garbage after the zlib stream")
    return out


def _unzstd(payload: bytes, cap: int) -> bytes:
    end = _zstd_frame_end(payload)
    if end < len(payload):
        raise WireError(f"{len(payload) - end} bytes of trailing garbage after the zstd frame")
    declared = zstandard.frame_content_size(payload)  # -1 when the frame does not say
    if declared > cap:
        raise LimitExceeded(f"zstd entry declares {declared} bytes, past {cap} (max_decoded_bytes)")
    # decompress(max_output_size=) trusts a declared size, so read through a bounded stream.
    reader = _CODECS.zstd_d.stream_reader(payload)
    if declared >= 0:
        out = reader.read(declared + 1)
        if len(out) != declared:
            raise WireError(f"zstd frame declares {declared} bytes but holds {len(out)}")
        return out
    chunks: list[bytes] = []
    total = 0
    while chunk := reader.read(min(cap + 1 - total, 1 << 20)):
        total += len(chunk)
        if total > cap:
            raise LimitExceeded(f"zstd entry inflates past {cap} bytes (max_decoded_bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def _zstd_frame_end(p: bytes) -> int:
    """Offset just past the zstd frame that starts `p`, from its block headers (the stream
    reader silently returns short data for a truncated frame)."""
    if p[:4] != _ZSTD_MAGIC:
        raise WireError("truncated zstd entry" if _ZSTD_MAGIC.startswith(p) else "bad zstd magic")
    try:
        pos = zstandard.frame_header_size(p)
    except zstandard.ZstdError:
        raise WireError("truncated zstd frame header") from None
    checksum = 4 if p[4] & 0x04 else 0
    n = len(p)
    while pos + 3 <= n:
        header = int.from_bytes(p[pos : pos + 3], "little")
        kind = (header >> 1) & 3
        if kind == 3:
            raise WireError("corrupt zstd entry: reserved block type")
        pos += 3 + (1 if kind == 1 else header >> 3)
        if header & 1:  # last block
            if pos + checksum > n:
                break
            return pos + checksum
    raise WireError("truncated zstd entry")


def encode(obj: object, codec: str = "zlib", level: int = -1) -> bytes:
    """One entry: `obj` as msgpack, compressed with `codec`, behind its tag byte."""
    return compress(pack(obj), codec, level)


#: payloads whose msgpack is shorter travel uncompressed (`encode_compact`): below this, zlib's
#: header and checksum outweigh what it saves (a 118-byte short request packs into 123 bytes), and
#: compressing and inflating cost ~6 and ~2 us of CPU each
COMPRESS_FROM = 256


def encode_compact(obj: object, codec: str = "zlib", level: int = -1) -> bytes:
    """`encode`, but a payload that packs into fewer than `COMPRESS_FROM` bytes goes
    uncompressed (codec none), whatever ``codec`` says."""
    raw = pack(obj)
    return compress(raw, "none" if len(raw) < COMPRESS_FROM else codec, level)


def decode(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Any:
    """The object inside one entry; `WireError` (or `LimitExceeded`) for anything unsafe."""
    return unpack(decompress(data, limits), limits)
