"""One benchmark case end to end on real Redis with a fake engine (timing is not what is
checked): several bursts submitted at their arrivals under their tenants, the standalone set-ups
fed the same arrivals (sorted by document for the sorted set-up), and the summary's set-ups,
optimum and shares (bench/cases.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import redis

from fake_engine import FakeEngine
from helpers import FakeWorker, control_command
from prefixq.bench.cases import Bursts, Env, run_case
from prefixq.bench.timeline import Stamp
from prefixq.bench.workloads import Burst, Workload
from prefixq.client import Producer
from prefixq.core.inputs import normalize
from prefixq.core.records import Request
from prefixq.core.settings import Settings
from prefixq.store.connection import async_client


class FakeStandalone:
    """Engines that answer at once and remember what they were handed, and when."""

    def __init__(self) -> None:
        self.seen: list[list[tuple[str, float]]] = []
        self.kv_tokens = [1000]

    async def start(self) -> None:
        pass

    async def run(
        self,
        requests: list[Request],
        shards: list[int],
        at: list[float] | None = None,
        order: list[int] | None = None,
    ) -> tuple[float, float, list[Stamp]]:
        t0 = time.time()
        got: dict[int, Stamp] = {}
        seen: list[tuple[str, float]] = []
        for i in order if order is not None else range(len(requests)):
            delay = t0 + (at[i] if at else 0.0) - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.time()
            seen.append((requests[i].id, now - t0))
            got[i] = Stamp(now, now, now + 0.001, 10, 0)
        self.seen.append(seen)
        return t0, time.time(), [got[i] for i in range(len(requests))]

    async def reset_prefix_cache(self) -> None:
        pass

    async def close(self) -> None:
        pass


def _workload() -> Workload:
    docs = {d: f"document {d} " * 60 for d in "ab"}
    bursts, paths = [], []
    for k, tenant in enumerate(("t-a", "t-b", "t-c")):
        reqs = []
        for n, d in enumerate("abab"):
            reqs.append({"id": f"b{k}-{n}", "prefix": docs[d], "prompt": f"sleep:0.01 {n}",
                         "max_tokens": 2})  # fmt: skip
            paths.append((d,))
        bursts.append(Burst(reqs, tenant, 0.3 * k))
    return Workload("multi-burst", bursts, paths, {"a": 180, "b": 180}, exact=False)


def test_a_multi_burst_case_gives_every_set_up_the_same_arrivals(
    make_settings: Callable[..., Settings],
    fake_worker: Callable[..., FakeWorker],
    r: redis.Redis,
) -> None:
    """Given three bursts 0.3 s apart, the pipeline submits each at its arrival under its tenant
    and its requests land on the shards the standalone set-ups were given; the standalone
    engines get each burst no earlier than its arrival, the sorted set-up each burst grouped by
    document; the summary names the strongest set-up, the optimum and each run's shares."""
    s = make_settings(prefix_store_min_chars=16)
    fw = fake_worker(s, name="bench-s0")
    eng = FakeStandalone()
    wl = _workload()
    b = Bursts(wl, [normalize(x.requests, s) for x in wl.bursts])

    async def main() -> dict[str, Any]:
        ar = async_client(s)
        try:
            async with Producer(s) as producer:
                workers = type("W", (), {"names": [fw.name]})()
                env = Env(s, ar, {"given": eng, "sorted": eng}, workers, producer, print, 16)
                return await run_case(env, b, "affinity", "grouped", 2, ["given", "sorted"])
        finally:
            await ar.aclose()

    got = asyncio.run(main())
    assert got["modes"] == ["standalone", "standalone-sorted", "pipeline"]
    assert got["strongest"] in ("standalone", "standalone-sorted")
    assert set(got["setups"]) == {"standalone", "standalone-sorted"}
    assert len(got["ratios"]) == 2 and len(got["setups"]["standalone-sorted"]["ratios"]) == 2
    # each document computed once per shard: 3 bursts x 4 requests on 2 documents
    assert got["optimum_cached_tokens"] == (12 - 2) * 176
    pipes = [x for x in got["runs"] if x["mode"] == "pipeline"]
    assert all(x["placement_mismatches"] == 0 and x["shares"] is not None for x in pipes)
    assert all(len(x["shares"]["completed"]) == 3 for x in pipes)
    tenants = {
        m[b"tenant"].decode()
        for key in r.scan_iter(match=f"{s.namespace}:{{b*}}:meta")
        if (m := r.hgetall(key))
    }
    assert {"t-a", "t-b", "t-c"} <= tenants
    assert len(eng.seen) == 4  # two pairs of two set-ups
    for seen in eng.seen:
        for rid, t in seen:
            assert t >= 0.3 * int(rid[1]) - 0.005, (rid, t)
    sorted_runs = [seen for seen in eng.seen if seen[0][0] == "b0-0" and seen[1][0] == "b0-2"]
    assert sorted_runs, "the sorted set-up's first burst starts with document a's two requests"


def test_the_bench_switches_a_live_workers_admission_order_and_back(
    make_settings: Callable[..., Settings], fake_worker: Callable[..., FakeWorker]
) -> None:
    """`admission:whole-groups` and `admission:resident-first` on the control stream switch a
    running worker's scheduler (worker/groups.py); `admission:kv-history` its KV budget and pass
    window (worker/kv_budget.py); `admission:fair` switches all of them back (to the settings'
    budget, none by default); `admission:kv-history-off` turns a budget the settings set off."""

    s = make_settings(kv_history_tokens=0)  # no budget in the settings: fair is none
    engine = FakeEngine()
    engine.kv_tokens = 1000  # type: ignore[attr-defined]  # a cache the budget can be sized on
    fw = fake_worker(s, name="adm", engine=engine)
    assert fw.worker is not None
    sched = fw.worker.sched
    assert not sched.whole_groups and sched.resident is None and sched.window > 0

    control_command(s, "admission:whole-groups", [fw.name])
    assert sched.whole_groups and sched.resident is None
    control_command(s, "admission:resident-first", [fw.name])
    assert not sched.whole_groups and sched.resident is not None
    control_command(s, "admission:fair", [fw.name])
    assert not sched.whole_groups and sched.resident is None
    # kv-history: fair shares, half the engine's cache for its prefixes, the pass's window
    # widened to match; fair again: the settings' budget (none) and window
    budget, marks = fw.worker.admission.budget, fw.worker.heartbeat.marks
    assert budget.capacity == 0 and marks.window == s.pass_window
    control_command(s, "admission:kv-history", [fw.name])
    assert not sched.whole_groups and sched.resident is None
    assert budget.share == 0.5 and abs(marks.window - 0.4) < 1e-9
    assert budget.capacity == 500
    control_command(s, "admission:fair", [fw.name])
    assert budget.share == 0 and budget.capacity == 0 and marks.window == s.pass_window
    # the other shares the bench measures: the budget and the window follow the share
    control_command(s, "admission:kv-history-70", [fw.name])
    assert budget.share == 0.7 and budget.capacity == 700 and abs(marks.window - 0.24) < 1e-9
    control_command(s, "admission:kv-history-30", [fw.name])
    assert budget.share == 0.3 and budget.capacity == 300 and abs(marks.window - 0.56) < 1e-9
    # a history in tokens, sized on this engine's cache: 32,768 of 1,000 leaves the floor, 0.7
    control_command(s, "admission:kv-history-32k", [fw.name])
    assert budget.share == 0.7 and budget.capacity == 700 and abs(marks.window - 0.24) < 1e-9
    control_command(s, "admission:fair", [fw.name])
    assert budget.share == 0 and budget.capacity == 0 and marks.window == s.pass_window
    # a worker whose settings keep 32,768 tokens: fair is that budget, kv-history-off none
    s32 = s.replace(kv_history_tokens=32768)
    engine32 = FakeEngine()
    engine32.kv_tokens = 1000  # type: ignore[attr-defined]
    fw32 = fake_worker(s32, name="adm32", engine=engine32)
    assert fw32.worker is not None
    budget32, marks32 = fw32.worker.admission.budget, fw32.worker.heartbeat.marks
    assert budget32.share == 0.7 and budget32.capacity == 700
    control_command(s32, "admission:kv-history-off", [fw32.name])
    assert budget32.share == 0 and budget32.capacity == 0 and marks32.window == s.pass_window
    control_command(s32, "admission:fair", [fw32.name])
    assert budget32.share == 0.7 and budget32.capacity == 700
    assert abs(marks32.window - 0.24) < 1e-9


def _multi_burst(
    s: Settings, worker: str, sizes: Any, workload: str = "multi-burst", **config: Any
) -> dict[str, Any]:
    """The bench's multi-burst case (or ``workload``'s: `_workload`) on the fake worker ``worker``
    and a fake standalone engine, with ``sizes`` and the rest of `BenchConfig` as ``config``
    says."""
    from prefixq.bench.runner import BenchConfig, _workload
    from prefixq.bench.workloads import Shape

    cfg = BenchConfig(
        model="fake", gpus=[None], engine_args=[], workloads=[workload], pairs=1,
        sizes=sizes, shape=Shape(doc_tokens=40, question_tokens=4, output_tokens=2),
        setups=["given"], **config,
    )  # fmt: skip

    async def main() -> dict[str, Any]:
        ar = async_client(s)
        try:
            async with Producer(s) as producer:
                workers = type("W", (), {"names": [worker]})()
                env = Env(s, ar, {"given": FakeStandalone()}, workers, producer, print, 16)
                out = await _workload(cfg, env, workload, 1000, None)
                assert env.producer is producer
                return out
        finally:
            await ar.aclose()

    return asyncio.run(main())


def test_the_bench_measures_multi_burst_with_the_shared_pass_off_beside_the_default(
    make_settings: Callable[..., Settings], fake_worker: Callable[..., FakeWorker]
) -> None:
    """``--pass-off multi-burst`` (bench/runner.py): the workload's case runs again with the
    producers' shared pass off, reported beside the default; ``--bursts`` and ``--burst-share``
    shape the bursts (four here, the later ones over half the documents)."""
    from prefixq.bench.workloads import Sizes

    s = make_settings(prefix_store_min_chars=16)
    fw = fake_worker(s, name="bench-s0")
    sizes = Sizes(documents=6, burst_questions=1, burst_gap=0.2, bursts=4, burst_share=0.5)
    got = _multi_burst(s, fw.name, sizes, pass_off=["multi-burst"])
    assert [b["requests"] for b in got["bursts"]] == [6, 3, 3, 3]
    assert [b["tenant"] for b in got["bursts"]] == ["tenant-a", "tenant-b", "tenant-c", "tenant-3"]
    assert set(got["pass_off"]) == {"on", "off"}
    assert got["pass_off"]["off"]["pipeline"]["median_throughput"] > 0


def test_a_high_priority_burst_arriving_mid_pass_is_submitted_and_reported_with_its_priority(
    make_settings: Callable[..., Settings], fake_worker: Callable[..., FakeWorker]
) -> None:
    """``--burst-priorities normal,high`` (issue 36's variant: a high-priority burst arriving
    mid-pass): the bench submits the second burst as ``high`` (the worker's engine gets it at
    the high band's engine priority), records each burst's priority, and reports each burst's
    arrival to its last result; an unknown priority is a clear error."""
    import pytest
    from rich.console import Console

    from prefixq.bench.command import _priorities
    from prefixq.bench.report import table
    from prefixq.bench.workloads import Sizes
    from prefixq.core.errors import ConfigError
    from prefixq.worker.engine_order import SPAN

    assert _priorities(" normal, high ,") == ("normal", "high")
    with pytest.raises(ConfigError, match="--burst-priorities: unknown urgent"):
        _priorities("normal,urgent")
    s = make_settings(prefix_store_min_chars=16)
    fw = fake_worker(s, name="bench-s0")
    sizes = Sizes(documents=4, burst_questions=1, burst_gap=0.2, bursts=2,
                  burst_priorities=("normal", "high"))  # fmt: skip
    got = _multi_burst(s, fw.name, sizes)
    assert [b["priority"] for b in got["bursts"]] == ["normal", "high"]
    prios = [p for rid, p in fw.engine.priorities if not rid.startswith("warmup")]
    assert sum(p < -SPAN // 2 for p in prios) == 4  # the high burst's four, in the high band
    assert sum(p >= -SPAN // 2 for p in prios) == 4
    spans = got["placements"]["affinity"]["shares"]["pipeline"][0]["took_s"]
    assert len(spans) == 2 and all(x > 0 for x in spans)
    console = Console(record=True, width=200)
    table({"config": {}, "environment": {}, "workloads": {"multi-burst": got}}, console)
    assert "each burst's arrival to its last result" in console.export_text()


def test_an_admission_case_keeps_the_workers_gc_figures_and_takes_every_budget_share(
    make_settings: Callable[..., Settings], fake_worker: Callable[..., FakeWorker]
) -> None:
    """``--admissions multi-burst:kv-history-70`` runs a case of its own with the worker's budget
    at 0.7, back to fair after it; the case keeps the workers' GC figures (issue 32's whole-heap
    step falls due between cases and shows in the next case's figures: they were dropped from
    every case but the default's). An unknown share's name is a clear error."""
    import pytest

    from prefixq.bench.command import _admissions
    from prefixq.bench.workloads import Sizes
    from prefixq.core.errors import ConfigError

    assert _admissions("multi-burst:kv-history-30,kv-history-70") == [
        "multi-burst:kv-history-30",
        "kv-history-70",
    ]
    with pytest.raises(ConfigError, match="--admissions: unknown 'kv-history-50'"):
        _admissions("kv-history-50")
    s = make_settings(prefix_store_min_chars=16, kv_history_tokens=0)  # fair: no budget
    engine = FakeEngine()
    engine.kv_tokens = 1000  # type: ignore[attr-defined]
    fw = fake_worker(s, name="bench-s0", engine=engine)
    assert fw.worker is not None
    sizes = Sizes(documents=4, burst_questions=1, burst_gap=0.2, bursts=2)
    got = _multi_burst(s, fw.name, sizes, admissions=["multi-burst:kv-history-70"])
    assert set(got["admissions"]) == {"fair", "kv-history-70"}
    # each case reports the budget its worker ran at (fair: the settings', none here)
    ((fair,), (held,)) = (got["admissions"][a]["kv_budget"] for a in ("fair", "kv-history-70"))
    assert fair["kv_budget_share"] == 0 and fair["kv_budget_tokens"] == 0
    assert held["kv_budget_share"] == 0.7 and held["kv_budget_tokens"] == 700
    from rich.console import Console

    from prefixq.bench.report import table

    console = Console(record=True, width=300)
    table({"config": {}, "environment": {}, "workloads": {"multi-burst": got}}, console)
    lines = console.export_text().splitlines()
    (line,) = [x for x in lines if x.startswith("multi-burst / admission kv-history-70")]
    assert "; KV budget 0.70 of the cache, " in line, line
    (line,) = [x for x in lines if x.startswith("multi-burst / admission fair")]
    assert "KV budget" not in line, line
    for view in got["admissions"].values():
        assert view["pipeline"]["median_throughput"] > 0
        (by_gen,) = view["gc_frozen_by_gen"]
        assert {"idle_max_step_ms", "whole_heap_freed", "whole_heap_skipped"} <= set(by_gen)
        assert len(view["gc_max_pause_ms_frozen"]) == 1
    assert fw.worker.admission.budget.share == 0  # fair again after the case


def test_the_kv_budgets_admissions_are_measured_on_requests_that_share_nothing_too(
    make_settings: Callable[..., Settings], fake_worker: Callable[..., FakeWorker]
) -> None:
    """The KV budget holds requests of their own too (each its own prefix), so
    ``--admissions kv-history-off`` measures ``no-reuse`` beside the default; an admission that
    orders groups (whole-groups) has nothing to order there and is not run (named for no-reuse
    alone, a clear error); ``--plan`` lists the same cases."""
    import pytest

    from prefixq.bench.command import _admissions
    from prefixq.bench.plan import estimate
    from prefixq.bench.runner import BenchConfig
    from prefixq.bench.setups import admissions_for
    from prefixq.bench.workloads import Sizes
    from prefixq.core.errors import ConfigError

    adms = ["kv-history-off", "whole-groups", "reuse:kv-history-70", "fair"]
    assert _admissions(",".join(adms)) == adms  # for every workload: each where it applies
    with pytest.raises(ConfigError, match=r"no-reuse's requests share no prefix.*whole-groups"):
        _admissions("no-reuse:kv-history-off,no-reuse:whole-groups")
    assert admissions_for(adms, "no-reuse") == ["kv-history-off"]
    assert admissions_for(adms, "reuse") == ["kv-history-off", "whole-groups", "kv-history-70"]
    cfg = BenchConfig(
        model="fake", gpus=[None], engine_args=[], workloads=["no-reuse"], pairs=1,
        admissions=adms,
    )  # fmt: skip
    plan = [c["order"] for c in estimate(cfg, 131072)["cases"] if c["workload"] == "no-reuse"]
    assert plan == ["decode-first", "decode-first+kv-history-off"], plan
    s = make_settings(kv_history_tokens=32768)  # the budget on, for kv-history-off to differ
    engine = FakeEngine()
    engine.kv_tokens = 1000  # type: ignore[attr-defined]
    fw = fake_worker(s, name="bench-s0", engine=engine)
    assert fw.worker is not None
    got = _multi_burst(s, fw.name, Sizes(requests=6), "no-reuse", admissions=adms)
    assert set(got["admissions"]) == {"fair", "kv-history-off"}
    ((fair,), (off,)) = (got["admissions"][a]["kv_budget"] for a in ("fair", "kv-history-off"))
    assert fair["kv_budget_share"] == 0.7 and off["kv_budget_share"] == 0
    assert got["admissions"]["kv-history-off"]["pipeline"]["median_throughput"] > 0
    assert fw.worker.admission.budget.share == 0.7  # the settings' budget again after it
