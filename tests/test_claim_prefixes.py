"""lua/claim_prefixes.lua on a real Redis, against a model of its contract: a claim in mode "n"
takes an absent checkpoint and follows a present one, mode "m" always takes it, every checkpoint
named gets the call's time as its LRU score, and the map keeps its newest ``max entries``; calls
of more checkpoints than one batch of the script's commands behave as small ones."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import redis

from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.store.connection import lua


def _claim(
    r: redis.Redis,
    keys: Keys,
    now: int,
    maxn: int,
    claims: list[tuple[bytes, int, str]],
    touched: list[bytes],
) -> list[int]:
    args: list[bytes | str | int] = [now, maxn, len(claims)]
    for cp, shard, mode in claims:
        args += [cp, shard, mode]
    out = r.register_script(lua("claim_prefixes"))(
        keys=[keys.prefix_map, keys.prefix_lru], args=[*args, *touched]
    )
    return [int(v) for v in out]


@pytest.mark.parametrize("n", [3, 2500])
def test_claims_moves_touches_and_bound_match_the_contract(
    make_settings: Callable[..., Settings], r: redis.Redis, n: int
) -> None:
    """Given a map holding some checkpoints, a call mixing new claims, claims of held
    checkpoints, moves and touches returns and stores what HSETNX / HSET / ZADD one by one would,
    and evicts the least recently used past the bound."""
    keys = Keys(make_settings().namespace)
    rng = random.Random(n)
    cps = [rng.getrandbits(64).to_bytes(8, "little") for _ in range(3 * n)]
    held = {cp: rng.randrange(4) for cp in cps[:n]}
    r.hset(keys.prefix_map, mapping=held)
    r.zadd(keys.prefix_lru, dict.fromkeys(held, 1))
    claims = [(cp, rng.randrange(4), rng.choice("nm")) for cp in cps[n // 2 : 2 * n]]
    touched = cps[2 * n : 2 * n + n // 2]
    maxn = 2 * n

    out = _claim(r, keys, 5, maxn, claims, touched)

    model = dict(held)
    expected = []
    for cp, shard, mode in claims:
        if mode == "m" or cp not in model:
            model[cp] = shard
        expected.append(model[cp])
    assert out == expected
    scores = dict.fromkeys(held, 1) | {cp: 5 for cp, _, _ in claims} | dict.fromkeys(touched, 5)
    keep = sorted(scores, key=lambda cp: (scores[cp], cp))[len(scores) - maxn :]
    assert {cp: int(s) for cp, s in r.zrange(keys.prefix_lru, 0, -1, withscores=True)} == {
        cp: scores[cp] for cp in keep
    }
    stored = {cp: int(v) for cp, v in r.hgetall(keys.prefix_map).items()}
    assert stored == {cp: model[cp] for cp in keep if cp in model}
