"""The `Burst` handle that `Producer.submit` and `asubmit` return (client/burst.py): it is the id
for code that passes the id on, and it reads results, waits and cancels without the caller
assembling settings and clients again. Real Redis, the real worker loop over the fake engine."""

from __future__ import annotations

import asyncio
import json
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import redis

from helpers import FakeWorker, wait_until
from prefixq import Burst, BurstNotFound, BurstTimeout, Producer
from prefixq.client import results
from prefixq.core.settings import Settings


def reqs(n: int, secs: float = 0.0, tag: str = "q") -> list[dict[str, Any]]:
    return [
        {"id": f"{tag}{i}", "prompt": f"sleep:{secs} {tag} {i}", "max_tokens": 4} for i in range(n)
    ]


def test_submit_returns_a_burst_that_is_its_id(settings: Settings) -> None:
    """``str(burst)``, equality, hashing, JSON and f-strings see the id; the module functions
    that take an id take the handle."""
    burst = Producer(settings).submit(reqs(3))
    assert isinstance(burst, Burst) and isinstance(burst, str)
    assert type(burst.id) is str and str(burst) == burst.id == burst
    assert json.loads(json.dumps({"b": burst})) == {"b": burst.id}
    assert {burst.id: 1}[burst] == 1 and f"{burst}" == burst.id
    assert results.status(burst, settings).total == 3
    assert repr(burst) == repr(burst.id)  # messages that quote the id read as before


def test_the_handle_waits_iterates_and_collects_in_input_order(
    settings: Settings, fake_worker: Callable[..., FakeWorker]
) -> None:
    """wait() returns the finished status; iterate() and collect() give every result in input
    order, with the submitted ids."""
    fake_worker(settings)
    with Producer(settings).submit(reqs(12)) as burst:
        st = burst.wait(timeout=30)
        assert st.finished and st.done == 12 and st.failed == 0
        assert [r.id for r in burst.iterate(timeout=5)] == [f"q{i}" for i in range(12)]
        assert [r.id for r in burst.collect()] == [f"q{i}" for i in range(12)]
        assert burst.status().done == 12


def test_wait_times_out_with_what_it_got(settings: Settings) -> None:
    """No worker: wait() raises BurstTimeout naming how many results it saw."""
    burst = Producer(settings).submit(reqs(2))
    with pytest.raises(BurstTimeout, match=r"0/2 results"):
        burst.wait(timeout=0.3)


def test_cancel_through_the_handle_fails_what_has_not_run(
    settings: Settings, fake_worker: Callable[..., FakeWorker]
) -> None:
    """cancel() on a running burst: the unfinished requests get cancelled results and the
    burst's status says cancelled; a second cancel finds nothing to do."""
    fake_worker(settings.replace(max_inflight=2))
    burst = Producer(settings).submit(reqs(20, 0.3))
    wait_until(lambda: burst.status().done >= 1, 20, "a first result")
    rep = burst.cancel()
    assert rep.cancelled > 0 and not rep.already_finished
    st = burst.wait(timeout=20)
    assert st.status == "cancelled" and st.done + st.failed == 20
    assert burst.cancel().already_finished
    codes = {r.error_code for r in burst.collect()}
    assert codes <= {None, "cancelled"} and "cancelled" in codes


def test_a_cancel_through_the_handle_runs_the_producers_burst_done_hook(
    settings: Settings, r: redis.Redis
) -> None:
    """Producer(on_burst_done=RQ_ON_COMPLETE): the cancel that ends the burst enqueues its
    on_complete RQ job, once, as `prefixq cancel` does."""
    from rq import Queue
    from rq.serializers import JSONSerializer

    from prefixq.integrations.rq_callbacks import RQ_ON_COMPLETE, callback_job_id

    q = Queue(f"rq-{settings.namespace}", connection=r, serializer=JSONSerializer)
    burst = Producer(settings, on_burst_done=RQ_ON_COMPLETE).submit(
        reqs(3), on_complete="rq_targets:mark_done", rq_queue=q.name
    )
    assert burst.cancel().ended
    assert q.job_ids == [callback_job_id(settings.namespace, burst)]


def test_a_handle_built_from_an_id_reads_the_same_burst(
    settings: Settings, fake_worker: Callable[..., FakeWorker]
) -> None:
    """Burst(id, settings) (an id kept as a string, a pickled handle) reads the same results;
    an unknown id is BurstNotFound."""
    fake_worker(settings)
    burst = Producer(settings).submit(reqs(4))
    burst.wait(timeout=30)
    again = pickle.loads(pickle.dumps(burst))
    assert isinstance(again, Burst) and again == burst
    assert [x.id for x in Burst(burst.id, settings).collect()] == [f"q{i}" for i in range(4)]
    assert [x.id for x in again.collect()] == [f"q{i}" for i in range(4)]
    with pytest.raises(BurstNotFound):
        Burst("no-such-burst", settings).status()


def test_asubmit_returns_a_burst_with_async_twins(
    settings: Settings, fake_worker: Callable[..., FakeWorker]
) -> None:
    """On an event loop: asubmit's handle awaits (await_), iterates (aiterate), collects
    (acollect), reads its status (astatus) and cancels (acancel)."""
    fake_worker(settings)

    async def main() -> None:
        burst = await Producer(settings).asubmit(reqs(6))
        assert isinstance(burst, Burst)
        st = await burst.await_(timeout=30)
        assert st.finished and st.done == 6
        assert [x.id async for x in burst.aiterate(timeout=5)] == [f"q{i}" for i in range(6)]
        assert [x.id for x in await burst.acollect()] == [f"q{i}" for i in range(6)]
        assert (await burst.astatus()).done == 6
        slow = await Producer(settings).asubmit(reqs(30, 0.2, "s"))
        rep = await slow.acancel()
        assert rep.cancelled > 0
        assert (await slow.await_(timeout=20)).status == "cancelled"
        pending = await Producer(settings).asubmit(reqs(1, 30, "p"))
        with pytest.raises(BurstTimeout, match=r"0/1 results"):
            await pending.await_(timeout=0.2)
        await pending.acancel()

    asyncio.run(main())
