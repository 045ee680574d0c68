"""Chained block hashes: the memo for shared prefixes gives exactly the plain chain."""

from __future__ import annotations

import random

from prefixq.affinity.blocks import char_blocks, chat_text, token_blocks
from prefixq.client.items import ItemBuilder
from prefixq.core.entries import split_prefix
from prefixq.core.records import Request
from prefixq.core.settings import Settings

RNG = random.Random(1)
DOC = " ".join(RNG.choice(["alpha", "beta", "gamma", "délta", "ε"]) for _ in range(800))
IDS = [RNG.randrange(1000) for _ in range(4000)]


def test_memoized_prefix_chains_equal_plain_chains_for_text_chats_and_token_ids() -> None:
    """Questions sharing a prefix (text, chat, token ids), hashed twice through one builder,
    give the same blocks as hashing each whole prompt from scratch."""
    b = ItemBuilder(Settings(shards=2))
    for q in ("short", "a longer question " * 20):
        r = Request(id="p", prefix=DOC, prompt=q)
        for _ in range(2):
            assert b.build(r, split_prefix(r)[0]).blocks == char_blocks(DOC + q, 64, b.seed)
        m = Request(
            id="m", messages=[{"role": "system", "content": DOC}, {"role": "user", "content": q}]
        )
        assert m.messages is not None
        expected = char_blocks(chat_text(m.messages), 64, b.seed)
        assert b.build(m, split_prefix(m)[0]).blocks == expected
    for tail in ([1, 2, 3], list(range(40))):
        t = Request(id="t", prefix=IDS, prompt_token_ids=tail)
        assert b.build(t, None).blocks == token_blocks(IDS + tail, 16, b.seed)


def test_different_prefixes_give_different_chains() -> None:
    """Changing one character of the prefix changes every block hash from there on."""
    b = ItemBuilder(Settings(shards=2))
    one = b.build(Request(id="a", prefix=DOC, prompt="?"), None).blocks
    other = b.build(Request(id="b", prefix="X" + DOC[1:], prompt="?"), None).blocks
    assert len(one) == len(other) and all(x != y for x, y in zip(one, other, strict=True))
