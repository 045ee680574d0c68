"""lua/claim_prefixes.lua on a real Redis, against a model of its contract: a claim in mode "n"
takes an absent checkpoint and follows a present one, mode "m" always takes it, every checkpoint
named is written to the map's current generation unless there already, a generation fills to half
the bound before it becomes the previous one (the previous one dropped whole), and both together
never hold more than ``max entries``; calls of more checkpoints than one batch of the script's
commands behave as small ones. And what placing documents x 4 costs Redis, in commands."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import pytest
import redis

from prefixq.affinity.placement import Item
from prefixq.affinity.prefix_map import AffinityPlacer
from prefixq.cli.redis_server import RedisServer
from prefixq.core.keys import Keys
from prefixq.core.settings import Settings
from prefixq.store.connection import lua


def _claim(
    r: redis.Redis,
    keys: Keys,
    maxn: int,
    claims: list[tuple[bytes, int, str]],
    touched: list[bytes],
) -> list[int]:
    """The script called with one group per claim (its contract allows any grouping: the
    placer's groups are tested through it below)."""
    args: list[bytes | str | int] = [maxn, len(claims)]
    for cp, shard, mode in claims:
        args += [shard, mode, cp]
    out = r.register_script(lua("claim_prefixes"))(
        keys=[keys.prefix_map, keys.prefix_map_old], args=[*args, b"".join(touched)]
    )
    return [int(v) for v in out]


class _Model:
    """The two generations as the script's comment describes them."""

    def __init__(self, maxn: int) -> None:
        self.maxn, self.young, self.old = maxn, dict[bytes, int](), dict[bytes, int]()

    def get(self, cp: bytes) -> int | None:
        return self.young.get(cp, self.old.get(cp))

    def claim(self, claims: list[tuple[bytes, int, str]], touched: list[bytes]) -> list[int]:
        cps = [cp for cp, _, _ in claims] + touched
        had = {cp: self.get(cp) for cp in cps}
        adds = sum(1 for cp in cps if cp not in self.young)
        if adds and len(self.young) + adds > self.maxn // 2:
            self.old, self.young = self.young, {}
        out = []
        for cp, shard, mode in claims:
            v = shard if mode == "m" or had[cp] is None else had[cp]
            self.young[cp] = v
            out.append(v)
        for cp in touched:
            if had[cp] is not None:
                self.young[cp] = had[cp]  # type: ignore[assignment]
        if len(self.young) > self.maxn // 2:
            self.old = {}
            for cp in reversed(cps):
                if len(self.young) <= self.maxn:
                    break
                self.young.pop(cp, None)
        return out


@pytest.mark.parametrize("n", [3, 2500])
def test_claims_moves_touches_and_bound_match_the_contract(
    make_settings: Callable[..., Settings], r: redis.Redis, n: int
) -> None:
    """Calls mixing new claims, claims of held checkpoints (in either generation), moves and
    touches return and store what the model does, call after call (generations turn over), and
    the two generations never hold more than the bound."""
    keys = Keys(make_settings().namespace)
    rng = random.Random(n)
    pool = [rng.getrandbits(64).to_bytes(8, "little") for _ in range(4 * n)]
    maxn = 3 * n
    model = _Model(maxn)
    for _ in range(8):
        picked = rng.sample(pool, n + n // 2)
        claims = [(cp, rng.randrange(4), rng.choice("nnm")) for cp in picked[:n]]
        touched = picked[n:]
        out = _claim(r, keys, maxn, claims, touched)
        assert out == model.claim(claims, touched)
        young = {cp: int(v) for cp, v in r.hgetall(keys.prefix_map).items()}
        old = {cp: int(v) for cp, v in r.hgetall(keys.prefix_map_old).items()}
        assert (young, old) == (model.young, model.old)
        assert len(young) + len(old) <= maxn


def test_one_call_larger_than_the_bound_keeps_the_map_within_it(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """A single call of more checkpoints than the whole bound leaves at most the bound (the
    previous generation dropped, then the call's last ones), and still answers every claim."""
    keys = Keys(make_settings().namespace)
    cps = [i.to_bytes(8, "little") for i in range(1, 2501)]
    r.hset(keys.prefix_map_old, mapping={cps[0]: 3})
    out = _claim(r, keys, 1000, [(cp, 1, "n") for cp in cps], [])
    assert out == [3] + [1] * 2499
    assert r.hlen(keys.prefix_map) == 1000 and not r.exists(keys.prefix_map_old)
    assert r.hmget(keys.prefix_map, cps[:1000]) == [b"3"] + [b"1"] * 999


def test_a_checkpoint_used_again_stays_while_fewer_than_half_the_bound_came_after_it(
    make_settings: Callable[..., Settings], r: redis.Redis
) -> None:
    """The approximate LRU's promise: a checkpoint claimed or used stays mapped while at most
    ``max / 2`` other checkpoints were written after it; one never used again goes once the map
    has turned over twice."""
    keys = Keys(make_settings().namespace)
    maxn, hot, cold = 100, b"hot-0001", b"cold-001"
    _claim(r, keys, maxn, [(hot, 2, "n"), (cold, 1, "n")], [])
    others = iter(range(10**6))
    for step in range(40):
        new = [(next(others).to_bytes(8, "little"), 0, "n") for _ in range(7)]
        if step % 7 == 6:  # the hot one is used every 49 new checkpoints (< 50)
            _claim(r, keys, maxn, new, [hot])
        else:
            _claim(r, keys, maxn, new, [])
        assert r.hlen(keys.prefix_map) + r.hlen(keys.prefix_map_old) <= maxn
        held = r.hget(keys.prefix_map, hot) or r.hget(keys.prefix_map_old, hot)
        assert held == b"2", step  # still mapped, to its shard
    # 280 others came after the cold one: gone from both generations
    assert r.hget(keys.prefix_map, cold) is None and r.hget(keys.prefix_map_old, cold) is None


def _docs_x4(rng: random.Random, docs: int) -> list[Item]:
    items = []
    for _ in range(docs):
        doc = [rng.getrandbits(64) for _ in range(186)]
        for _ in range(4):
            own = [rng.getrandbits(64)]
            items.append(Item(doc + own, 187 * 16, 16.0, 186, 0))
    return items


def test_placing_documents_x4_costs_the_map_one_write_per_new_checkpoint_none_per_use(
    make_settings: Callable[..., Settings],
) -> None:
    """Documents x 4 through the placer, on a private Redis: the map costs no sorted-set member
    per checkpoint (a ZADD per claim and per use was over a third of its Redis time), and placing
    questions about documents the map holds writes nothing to it."""
    rng = random.Random(7)
    first = _docs_x4(rng, 60)
    again = [  # the same documents, a new question each
        Item([*it.blocks[:-1], rng.getrandbits(64)], it.tokens, 16.0, it.prefix_blocks, 0)
        for it in first[::4]
    ]
    with RedisServer() as srv:
        s = make_settings(redis_url=srv.url)  # one shard: no load guard moves
        r = redis.Redis.from_url(srv.url)

        async def place(items: list[Item]) -> dict[str, dict[str, float]]:
            import redis.asyncio as aredis

            ar = aredis.Redis.from_url(srv.url)
            try:
                r.config_resetstat()
                await AffinityPlacer(s).place(ar, items, 1)
                return {k.removeprefix("cmdstat_"): v for k, v in r.info("commandstats").items()}
            finally:
                await ar.aclose()

        try:
            cost = asyncio.run(place(first))
            assert "zadd" not in cost and "zpopmin" not in cost
            new = r.hlen(Keys(s.namespace).prefix_map)
            assert new == 60 * 24 + 60 * 4  # 24 per document, 1 per question
            assert cost["hset"]["calls"] <= 2  # batches of 1,000 checkpoints
            cost = asyncio.run(place(again))
            assert "zadd" not in cost
            assert cost["hset"]["calls"] == 1  # the new questions' own checkpoints only
            assert r.hlen(Keys(s.namespace).prefix_map) == new + 60
        finally:
            r.close()
