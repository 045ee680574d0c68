"""The wire bytes layer: every codec round-trips; every bad entry fails as a bounded WireError."""

from __future__ import annotations

import contextlib
import functools
import io
import tracemalloc
import zlib
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixq.core import wire
from prefixq.core.errors import LimitExceeded, WireError
from prefixq.core.settings import Settings

MiB = 1 << 20
GiB = 1 << 30
CAP = wire.DEFAULT_LIMITS.max_decoded_bytes
CODECS = list(wire.CODEC_TAGS)
SAMPLE = {"v": 1, "id": "req-1", "p": "You are a helpful assistant. " * 40, "s": {"stop": ["\n"]}}
quick = settings(database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | st.binary(max_size=40)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.text(max_size=8) | st.integers(-100, 100), inner, max_size=5)
    ),
    max_leaves=30,
)


def depth(obj: Any) -> int:
    """Nesting depth of maps/arrays, counted the way `Limits.max_depth` counts it."""
    if isinstance(obj, dict):
        return 1 + max(map(depth, obj.values()), default=0)
    if isinstance(obj, list):
        return 1 + max(map(depth, obj), default=0)
    return 0


def nested_lists(levels: int) -> Any:
    obj: Any = None
    for _ in range(levels):
        obj = [obj]
    return obj


@functools.cache
def zlib_zeros(mib: int) -> bytes:
    """A zlib entry of `mib` MiB of zeros, ~1 KB per MiB, built without compressing them all.

    After a full flush deflate restarts from scratch, so every further MiB of zeros compresses to
    the same bytes; the adler32 of n zero bytes is (n mod 65521) << 16 | 1.
    """
    c = zlib.compressobj(9)
    head = c.compress(bytes(MiB)) + c.flush(zlib.Z_FULL_FLUSH)
    again = c.compress(bytes(MiB)) + c.flush(zlib.Z_FULL_FLUSH)
    last_block = c.flush()[:-4]
    adler = ((mib * MiB) % 65521) << 16 | 1
    return b"\x01" + head + again * (mib - 1) + last_block + adler.to_bytes(4, "big")


@functools.cache
def zstd_zeros(size: int, *, declare: bool) -> bytes:
    """A zstd entry of `size` zeros, streamed 1 MiB at a time, declaring its size or not."""
    compressor = zstandard.ZstdCompressor(level=1)
    zeros = bytes(MiB)
    if not declare:
        obj = compressor.compressobj()
        return b"\x02" + b"".join(obj.compress(zeros) for _ in range(size // MiB)) + obj.flush()
    sink = io.BytesIO()
    with compressor.stream_writer(sink, size=size, closefd=False) as writer:
        for _ in range(size // MiB):
            writer.write(zeros)
    return b"\x02" + sink.getvalue()


# round trips


@pytest.mark.parametrize("codec", CODECS)
@quick
@given(obj=values)
def test_every_codec_round_trips_msgpack_values(codec: str, obj: Any) -> None:
    """decode(encode(x, codec)) == x for any value within the depth limit."""
    entry = wire.encode(obj, codec)
    assert entry[0] == wire.CODEC_TAGS[codec]
    if depth(obj) <= wire.DEFAULT_LIMITS.max_depth:
        assert wire.decode(entry) == obj
    else:
        with pytest.raises(LimitExceeded, match="max_depth"):
            wire.decode(entry)


@pytest.mark.parametrize(("codec", "level"), [("zlib", 9), ("zlib", 0), ("zstd", 19), ("zstd", 1)])
def test_explicit_levels_round_trip(codec: str, level: int) -> None:
    """Any valid level of a codec decodes the same way."""
    assert wire.decode(wire.encode(SAMPLE, codec, level)) == SAMPLE


def test_default_zlib_level_is_1() -> None:
    """Level -1 means zlib level 1, the study's choice for text-heavy prompts."""
    packed = wire.pack(SAMPLE)
    assert wire.compress(packed) == b"\x01" + zlib.compress(packed, 1)


def test_zstd_frames_declare_size_and_checksum() -> None:
    """zstd entries say their content size and carry a checksum."""
    params = zstandard.get_frame_parameters(wire.encode(SAMPLE, "zstd")[1:])
    assert params.content_size == len(wire.pack(SAMPLE))
    assert params.has_checksum


def test_zstd_frame_without_declared_size_decodes() -> None:
    """A streamed multi-block zstd frame that does not declare its size decodes in full."""
    raw = bytes(range(256)) * 4096
    obj = zstandard.ZstdCompressor().compressobj()
    frame = b"".join(
        obj.compress(raw[i : i + 65536]) + obj.flush(1) for i in range(0, len(raw), 65536)
    )
    frame += obj.flush()
    assert zstandard.frame_content_size(frame) == -1
    assert wire.decompress(b"\x02" + frame) == raw


@pytest.mark.parametrize("codec", CODECS)
def test_decoded_size_exactly_at_the_cap_is_accepted(codec: str) -> None:
    """An entry that inflates to exactly max_decoded_bytes decodes."""
    raw = wire.pack("x" * 997)
    assert len(raw) == 1000
    assert wire.decompress(wire.compress(raw, codec), wire.Limits(max_decoded_bytes=1000)) == raw


def test_limits_from_settings_follow_the_size_settings() -> None:
    """Limits take the entry and decoded caps from Settings and keep strings within them."""
    limits = wire.Limits.from_settings(Settings(max_entry_bytes=1000, max_decoded_bytes=5000))
    assert (limits.max_entry_bytes, limits.max_decoded_bytes, limits.max_str_len) == (
        1000,
        5000,
        5000,
    )
    assert wire.Limits.from_settings(Settings()) == wire.DEFAULT_LIMITS


# refused at encode time


def test_unknown_codec_name_is_refused() -> None:
    """encode with a codec that has no tag raises WireError naming it."""
    with pytest.raises(WireError, match="unknown codec 'lz4'"):
        wire.encode(SAMPLE, "lz4")


def test_bad_level_is_refused() -> None:
    """A level the codec rejects raises WireError, not zlib.error."""
    with pytest.raises(WireError, match="zlib level 42"):
        wire.encode(SAMPLE, "zlib", 42)


def test_unpackable_value_is_refused() -> None:
    """A value msgpack cannot represent raises WireError naming the problem."""
    with pytest.raises(WireError, match=r"cannot pack.*set"):
        wire.encode({"x": {1, 2}})


# refused at decode time: framing


def test_empty_entry_is_refused() -> None:
    """Zero bytes is not an entry."""
    with pytest.raises(WireError, match="empty entry"):
        wire.decode(b"")


def test_unknown_codec_tag_is_refused() -> None:
    """A first byte that is no codec tag raises WireError naming the tag."""
    entry = wire.encode(SAMPLE, "zlib")
    with pytest.raises(WireError, match="unknown codec tag 0x07"):
        wire.decode(b"\x07" + entry[1:])


def test_wrong_codec_tag_is_refused() -> None:
    """A zlib payload behind the zstd tag (or the reverse) is refused, not misread."""
    with pytest.raises(WireError, match="bad zstd magic"):
        wire.decode(b"\x02" + wire.encode(SAMPLE, "zlib")[1:])
    with pytest.raises(WireError, match="corrupt zlib entry"):
        wire.decode(b"\x01" + wire.encode(SAMPLE, "zstd")[1:])


@pytest.mark.parametrize("codec", CODECS)
def test_truncated_entry_is_refused(codec: str) -> None:
    """Every proper prefix of an entry is reported as truncated."""
    entry = wire.encode(SAMPLE, codec)
    for cut in range(1, len(entry)):
        with pytest.raises(WireError, match="truncated"):
            wire.decode(entry[:cut])


def test_truncated_zstd_frame_without_declared_size_is_refused() -> None:
    """The zstd stream reader returns short data silently for a cut frame; decode does not."""
    obj = zstandard.ZstdCompressor().compressobj()
    frame = b"\x02" + obj.compress(wire.pack(SAMPLE)) + obj.flush()
    assert zstandard.frame_content_size(frame[1:]) == -1
    for cut in range(1, len(frame)):
        with pytest.raises(WireError, match="truncated"):
            wire.decode(frame[:cut])


@pytest.mark.parametrize(
    ("codec", "cause"),
    [("none", "trailing bytes"), ("zlib", "trailing garbage"), ("zstd", "trailing garbage")],
)
def test_trailing_garbage_is_refused(codec: str, cause: str) -> None:
    """Bytes after the end of the compressed stream or the msgpack object are refused."""
    with pytest.raises(WireError, match=cause):
        wire.decode(wire.encode(SAMPLE, codec) + b"\x00junk")


def test_second_zstd_frame_is_refused() -> None:
    """Two concatenated zstd frames are one frame plus trailing garbage."""
    entry = wire.encode(SAMPLE, "zstd")
    with pytest.raises(WireError, match="trailing garbage"):
        wire.decode(entry + entry[1:])


@pytest.mark.parametrize("codec", ["zlib", "zstd"])
def test_corrupt_checksum_is_refused(codec: str) -> None:
    """A flipped bit in the trailing checksum is caught by the codec."""
    entry = bytearray(wire.encode(SAMPLE, codec))
    entry[-1] ^= 0x01
    with pytest.raises(WireError, match=f"corrupt {codec} entry"):
        wire.decode(bytes(entry))


def test_entry_larger_than_max_entry_bytes_is_refused() -> None:
    """The encoded size is checked before anything is decompressed."""
    entry = wire.encode(b"\x00" * (4 * MiB), "none")
    with pytest.raises(LimitExceeded, match=f"past {4 * MiB} \\(max_entry_bytes\\)"):
        wire.decode(entry)
    with pytest.raises(LimitExceeded, match="max_entry_bytes"):
        wire.decode(wire.encode(SAMPLE, "zlib"), wire.Limits(max_entry_bytes=10))


# refused at decode time: decompression bombs


def test_zlib_bomb_is_refused_at_the_cap() -> None:
    """1 GiB of zeros in a ~1 MB zlib entry stops at max_decoded_bytes."""
    bomb = zlib_zeros(GiB // MiB)
    assert len(bomb) < 2 * MiB
    with pytest.raises(LimitExceeded, match=f"zlib entry inflates past {CAP} bytes"):
        wire.decode(bomb)


def test_zlib_bomb_builder_makes_valid_streams() -> None:
    """The bomb is a genuine zlib stream: a small one inflates to exactly its zeros."""
    assert zlib.decompress(zlib_zeros(3)[1:]) == bytes(3 * MiB)


def test_zstd_bomb_declaring_its_size_is_refused_from_the_header() -> None:
    """A 1 GiB zstd frame that declares its size is refused before decompressing."""
    bomb = zstd_zeros(GiB, declare=True)
    assert zstandard.frame_content_size(bomb[1:]) == GiB
    with pytest.raises(LimitExceeded, match=f"declares {GiB} bytes, past {CAP}"):
        wire.decode(bomb)


def test_zstd_bomb_without_declared_size_is_refused_at_the_cap() -> None:
    """A 1 GiB zstd frame with no declared size stops at max_decoded_bytes."""
    bomb = zstd_zeros(GiB, declare=False)
    assert zstandard.frame_content_size(bomb[1:]) == -1
    with pytest.raises(LimitExceeded, match=f"zstd entry inflates past {CAP} bytes"):
        wire.decode(bomb)


def peak_bytes(fn: Callable[[], object]) -> int:
    """The most memory Python allocations held while ``fn`` ran (tracemalloc counts every
    allocation through Python's allocators: bytes objects, zlib's buffers and state)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        with contextlib.suppress(WireError):
            fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    "bomb",
    [
        lambda: zlib_zeros(GiB // MiB),
        lambda: zstd_zeros(GiB, declare=False),
        lambda: zstd_zeros(GiB, declare=True),
    ],
    ids=["zlib", "zstd-streamed", "zstd-declared"],
)
def test_a_1_gib_bomb_never_takes_more_memory_than_the_cap_allows(
    bomb: Callable[[], bytes],
) -> None:
    """The decode bound is a bound on memory, not only on the answer: refusing a 1 GiB bomb with
    an 8 MiB cap allocates at most a small multiple of the cap (zlib's output buffer may double
    once), never the bomb's size (inflating it whole and checking after peaks at 1-2 GiB)."""
    data, cap = bomb(), 8 * MiB
    limits = wire.Limits(max_decoded_bytes=cap, max_str_len=cap)
    with pytest.raises(LimitExceeded):
        wire.decode(data, limits)
    peak = peak_bytes(lambda: wire.decode(data, limits))
    print(f"peak {peak / MiB:.1f} MiB decoding a 1 GiB bomb ({len(data)} bytes) with an 8 MiB cap")
    assert peak < 3 * cap


@pytest.mark.parametrize("codec", CODECS)
def test_decoded_size_one_past_the_cap_is_refused(codec: str) -> None:
    """One byte over max_decoded_bytes is refused by every codec."""
    entry = wire.encode("x" * 998, codec)
    with pytest.raises(LimitExceeded, match=r"past 1000.*max_decoded_bytes"):
        wire.decode(entry, wire.Limits(max_decoded_bytes=1000))


# refused at decode time: msgpack


def test_deeply_nested_msgpack_is_refused() -> None:
    """100k nested arrays come back as LimitExceeded, not a crash or RecursionError."""
    with pytest.raises(LimitExceeded, match="max_depth"):
        wire.decode(b"\x00" + b"\x91" * 100_000 + b"\xc0")


def test_nesting_just_past_max_depth_is_refused() -> None:
    """max_depth levels decode; one more is refused."""
    assert wire.decode(wire.encode(nested_lists(32))) == nested_lists(32)
    with pytest.raises(LimitExceeded, match="nested past 32 levels"):
        wire.decode(wire.encode(nested_lists(33)))


def test_many_shallow_containers_are_not_mistaken_for_depth() -> None:
    """Hundreds of sibling maps are fine: depth counts nesting, not containers."""
    obj = {"messages": [{"role": "user", "content": str(i)} for i in range(500)]}
    assert wire.decode(wire.encode(obj)) == obj


def test_oversized_map_is_refused() -> None:
    """A map with more than max_map_len pairs is refused."""
    with pytest.raises(LimitExceeded, match="map of 4097 pairs, past 4096 \\(max_map_len\\)"):
        wire.decode(wire.encode(dict.fromkeys(range(4097), 0)))


def test_oversized_array_is_refused() -> None:
    """An array with more than max_array_len items is refused."""
    with pytest.raises(LimitExceeded, match="array of 11 items, past 10 \\(max_array_len\\)"):
        wire.decode(wire.encode(list(range(11))), wire.Limits(max_array_len=10))


@pytest.mark.parametrize(("value", "kind"), [("x" * 11, "str"), (b"x" * 11, "bin")])
def test_oversized_string_is_refused(value: str | bytes, kind: str) -> None:
    """A str or bin longer than max_str_len is refused."""
    with pytest.raises(LimitExceeded, match=f"{kind} of 11 bytes, past 10 \\(max_str_len\\)"):
        wire.decode(wire.encode([value]), wire.Limits(max_str_len=10))


def test_array_declaring_more_items_than_bytes_is_refused_cheaply() -> None:
    """Nested arrays claiming 1M items each in a few bytes fail fast, without huge allocations."""
    with pytest.raises(WireError, match="truncated msgpack: array declares") as caught:
        wire.decode(b"\x00" + b"\xdd\x00\x0f\xff\xff" * 1000)
    assert not isinstance(caught.value, LimitExceeded)


@pytest.mark.parametrize(
    "ext",
    [msgpack.ExtType(5, b"xy"), msgpack.ExtType(5, b""), msgpack.Timestamp(1, 2)],
    ids=["ext", "empty-ext", "timestamp"],
)
def test_ext_types_are_refused(ext: object) -> None:
    """msgpack ext types (timestamps included) are never decoded."""
    with pytest.raises(WireError, match="ext type"):
        wire.decode(b"\x00" + msgpack.packb({"x": ext}))


@pytest.mark.parametrize(
    ("raw", "cause"),
    [
        (b"\xc1", "reserved type byte"),
        (b"\xa2\xff\xfe", "utf-8"),
        (b"\x81\x91\x01\x02", "unhashable"),
    ],
    ids=["reserved", "bad-utf8", "list-key"],
)
def test_invalid_msgpack_is_refused(raw: bytes, cause: str) -> None:
    """msgpack that does not parse to a plain value raises WireError with the reason."""
    with pytest.raises(WireError, match=cause):
        wire.decode(b"\x00" + raw)


# anything at all


@quick
@given(tag=st.sampled_from([0, 1, 2, 7]), payload=st.binary(max_size=300))
def test_arbitrary_bytes_raise_only_wire_error(tag: int, payload: bytes) -> None:
    """decode of arbitrary bytes returns a value or raises WireError, nothing else."""
    with contextlib.suppress(WireError):
        wire.decode(bytes([tag]) + payload)


@quick
@given(codec=st.sampled_from(CODECS), obj=values, data=st.data())
def test_damaged_entries_raise_only_wire_error(codec: str, obj: Any, data: st.DataObject) -> None:
    """decode of a valid entry with bytes changed or cut returns a value or raises WireError."""
    entry = bytearray(wire.encode(obj, codec))
    for _ in range(data.draw(st.integers(1, 4))):
        entry[data.draw(st.integers(1, len(entry) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(entry)))
    with contextlib.suppress(WireError):
        wire.decode(bytes(entry[:cut]))


@pytest.mark.parametrize("codec", CODECS)
def test_encode_compact_leaves_small_payloads_uncompressed(codec: str) -> None:
    """A payload packing into fewer than COMPRESS_FROM bytes goes with codec none (zlib would make
    it longer); a larger one with the codec asked for; both decode to what was encoded."""
    small, large = {"p": "x" * 10}, {"p": "x" * 2 * wire.COMPRESS_FROM}
    assert len(wire.pack(small)) < wire.COMPRESS_FROM <= len(wire.pack(large))
    assert wire.encode_compact(small, codec)[0] == wire.CODEC_TAGS["none"]
    assert wire.encode_compact(large, codec)[0] == wire.CODEC_TAGS[codec]
    for obj in (small, large):
        assert wire.decode(wire.encode_compact(obj, codec)) == obj
