"""Chained block hashes of a prompt's prefix: ``h_i = H(seed, h_{i-1}, block_i)``, 64-bit xxh3.

With a tokenizer the blocks are ``block_size`` token ids (the engine's KV block), so a hash names
exactly the KV blocks vLLM can reuse; without one they are ``block_chars`` characters of the same
rendered text. Only whole blocks are hashed: a partial last block is never cached by vLLM either.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import xxhash


def seed_of(model: str) -> int:
    """The chain's seed: a hash of the model name, so two models never share a map entry."""
    return xxhash.xxh3_64_intdigest(model.encode())


def token_blocks(tokens: Sequence[int], block_size: int, seed: int) -> list[int]:
    """Chained hashes of each whole block of token ids."""
    buf = array("I", tokens).tobytes()
    step = block_size * 4
    return chain(buf, step, len(tokens) // block_size, seed)


def char_blocks(text: str, block_chars: int, seed: int) -> list[int]:
    """Chained hashes of each whole block of characters (UTF-32, so blocks align on characters)."""
    buf = text.encode("utf-32-le")
    return chain(buf, block_chars * 4, len(text) // block_chars, seed)


def chain(buf: bytes | memoryview, step: int, n: int, seed: int, start: int = 0) -> list[int]:
    """Chained hashes of ``n`` blocks of ``step`` bytes of ``buf`` from offset ``start``, from
    ``seed``. The loop is the cost of a long prompt's placement (one call per block, ~190 for a
    16 KB prompt): bytes are sliced (a copy of a few hundred bytes is cheaper than a memoryview
    object) and the seed passed by position (no keyword parsing)."""
    if isinstance(buf, memoryview):
        buf = buf.tobytes()
    digest = xxhash.xxh3_64_intdigest
    out: list[int] = []
    append = out.append
    h = seed
    for i in range(start, start + n * step, step):
        h = digest(buf[i : i + step], h)
        append(h)
    return out


def chat_text(messages: list[dict[str, Any]]) -> str:
    """A stable rendering of chat messages for character blocks (no tokenizer at hand)."""
    return "".join(f"<|{m.get('role')}|>{m.get('content')}\n" for m in messages)
