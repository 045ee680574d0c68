"""The prefix map in Redis (two generations of one hash: lua/claim_prefixes.lua has the design):
`read_map` reads checkpoints' shards, `claim` claims, moves and marks them used. A claim sends its
checkpoints packed into one argument per group (8 bytes each): redis-py packs each argument of a
command in Python, and three per claim cost a producer more than the script cost Redis. Reads stay
plain HMGETs, one argument per checkpoint: a script unpacking them cost Redis more than HMGET."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import redis.asyncio as aredis

from prefixq.core.keys import Keys
from prefixq.store.lua_script import LuaScript

#: claims per call of the script (one call runs atomically: Redis serves nothing else meanwhile)
CLAIMS_PER_CALL = 4000
#: claims checkpoints and turns the generations over (lua/claim_prefixes.lua)
_CLAIM = LuaScript("claim_prefixes")


async def read_map(r: aredis.Redis, keys: Keys, cps: Sequence[bytes]) -> list[bytes | None]:
    """The shard the map holds for each of ``cps`` as stored (None: not mapped): the current
    generation's entry, else the previous generation's (read for those the current one lacks)."""
    if not cps:
        return []
    out: list[bytes | None] = await r.hmget(keys.prefix_map, list(cps))
    at = [i for i, v in enumerate(out) if v is None]
    if at:
        old = await r.hmget(keys.prefix_map_old, [cps[i] for i in at])
        for i, v in zip(at, old, strict=True):
            out[i] = v
    return out


async def claim(
    r: aredis.Redis,
    keys: Keys,
    max_entries: int,
    claims: Mapping[bytes, int],
    modes: Mapping[bytes, str],
    touched: Sequence[bytes] = (),
) -> dict[bytes, int]:
    """Claim ``claims`` (checkpoint -> shard; mode "n", the default, as HSETNX: the map's entry
    wins; "m" moves it) and mark ``touched`` used; the shard the map holds for each claim
    afterwards."""
    items = list(claims.items())
    stored: dict[bytes, int] = {}
    for start in range(0, max(len(items), 1), CLAIMS_PER_CALL):
        chunk = items[start : start + CLAIMS_PER_CALL]
        if not chunk and not touched:
            break
        groups: dict[tuple[int, str], list[bytes]] = {}
        for cp, shard in chunk:
            groups.setdefault((shard, modes.get(cp, "n")), []).append(cp)
        args: list[bytes | str | int] = [max_entries, len(groups)]
        for (shard, mode), cps in groups.items():
            args += [shard, mode, b"".join(cps)]
        if start == 0 and touched:
            args.append(b"".join(touched))
        out = await _CLAIM.acall(r, keys=[keys.prefix_map, keys.prefix_map_old], args=args)
        order = [cp for cps in groups.values() for cp in cps]
        for cp, v in zip(order, out, strict=True):
            stored[cp] = int(v)
    return stored
