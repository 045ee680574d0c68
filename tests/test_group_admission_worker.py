"""Whole-group admission (``group_admission``, worker/groups.py) on a worker against a real
redis-server: several bursts and tenants on one shard at once, every request answered once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import redis

from fake_engine import FakeEngine
from prefixq.client import Producer, results
from prefixq.core.settings import Settings

DOC = "a document about the tides and the moon, long enough to be stored as a prefix. " * 4


def _burst(tag: str, docs: int, per_doc: int) -> list[dict[str, Any]]:
    return [
        {"id": f"{tag}-d{d}-q{q}", "prefix": f"{tag} {d}: {DOC}", "prompt": f" question {q}?"}
        for d in range(docs)
        for q in range(per_doc)
    ]


def test_whole_groups_with_several_bursts_and_tenants_on_one_shard(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: Callable[..., Any]
) -> None:
    """Given a worker admitting whole groups, when two tenants' bursts wait in its queue before it
    starts and two more arrive while it serves, then every request of the four is answered once
    and the worker stays up (before: with more than one lane to take from, the room left was read
    as entries of a lane's stock, and the worker died of an IndexError at its first pick)."""
    s = make_settings(group_admission=True, prefix_store_min_chars=16)

    async def submit(tag: str, tenant: str) -> str:
        return await Producer(s).asubmit(_burst(tag, 4, 3), order="grouped", tenant=tenant)

    async def two(a: str, b: str) -> list[str]:
        return list(await asyncio.gather(submit(a, "t1"), submit(b, "t2")))

    before = asyncio.run(two("a", "b"))
    with fake_worker(s) as fw:
        during = asyncio.run(two("c", "d"))
        for burst in (*before, *during):
            st = results.wait(burst, s, timeout=60)
            assert (st.done, st.failed) == (12, 0), (burst, st)
            got = results.collect(burst, s)
            assert len({x.index for x in got}) == 12 and all(x.error is None for x in got)
        assert fw.running and fw.error is None


def test_a_tenant_capped_below_its_groups_or_its_stock_is_served_whole(
    make_settings: Callable[..., Settings], r: redis.Redis, fake_worker: Callable[..., Any]
) -> None:
    """Given a worker whose only tenant is capped (at 1, below its stock of read-ahead; at 2, below
    its documents' groups of 5, with whole-group admission), when a burst of that tenant is
    submitted, then every request is answered once, the cap holds, and the worker stays up
    (before: a cap filled by the stock asked Redis for COUNT 0, and XREADGROUP's DataError ended
    the worker; a group larger than the cap waited for room that nothing in flight would free,
    and the shard stalled for good)."""
    for cap, whole, per_doc in ((1, False, 1), (2, True, 5)):
        s = make_settings(group_admission=whole, tenant_caps=f"t1={cap}", prefix_store_min_chars=16)
        engine = FakeEngine(max_num_seqs=8)
        with fake_worker(s, engine=engine) as fw:
            burst = Producer(s).submit(_burst(f"c{cap}", 40 // per_doc, per_doc), tenant="t1").id
            t0 = time.monotonic()
            while results.status(burst, s).done < 40 and time.monotonic() - t0 < 60:
                time.sleep(0.01)
            got = results.collect(burst, s)
            assert len({x.index for x in got}) == 40 and all(x.error is None for x in got), cap
            assert 1 <= engine.peak_active <= cap, (cap, engine.peak_active)
            assert fw.running and fw.error is None
