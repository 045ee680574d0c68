"""The benchmark's parts that need no engine: how its workloads are built and sized, the
cached-token optimum, how evenly concurrent bursts were served, and which standalone set-up the
report calls strongest (bench/workloads.py, measures.py, setups.py, cases.summarise)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from prefixq.bench.cases import summarise
from prefixq.bench.engines import Workers, changed_settings
from prefixq.bench.measures import optimum_cached, shares, strongest
from prefixq.bench.setups import (
    host_offload_gib,
    parse_scoped,
    parse_setups,
    scoped,
    setups_for,
    sorted_order,
)
from prefixq.bench.workloads import TENANTS, WORKLOADS, Shape, Sizes, build, overflow_documents
from prefixq.cli.main import build_parser, settings_from
from prefixq.client.order import ORDERS
from prefixq.core.errors import ConfigError
from prefixq.core.inputs import normalize
from prefixq.core.settings import Settings

IDS = Shape(doc_tokens=400, question_tokens=8, output_tokens=4, token_ids=True)


@pytest.mark.parametrize("name", WORKLOADS)
def test_every_workload_builds_valid_requests_with_one_path_each(name: str) -> None:
    """Each workload's requests validate, have distinct ids, and each has its path in the
    prefix tree, whose nodes all have a depth."""
    wl = build(name, IDS, Sizes(documents=6, questions=2, system_prompts=2, system_tokens=64))
    reqs = wl.requests
    normalize(reqs, Settings())
    assert len({q["id"] for q in reqs}) == len(reqs) == len(wl.paths)
    assert all(node in wl.depth for path in wl.paths for node in path)


def test_overflow_is_sized_from_the_kv_capacity_unless_documents_are_given() -> None:
    """Given an engine that holds 10,000 tokens, overflow's documents hold at least three times
    that (and one document fewer would not); --documents overrides the sizing."""
    wl = build("overflow", IDS, Sizes(questions=3), capacity_tokens=10_000)
    assert wl.documents == overflow_documents(10_000, IDS, Sizes()) == 75
    assert wl.documents * 400 >= 3 * 10_000 > (wl.documents - 1) * 400
    assert len(wl.requests) == 75 * 3
    assert build("overflow", IDS, Sizes(documents=5), capacity_tokens=10_000).documents == 5
    assert build("reuse", IDS, Sizes(), capacity_tokens=10_000).documents == 64  # not sized


def test_multi_burst_is_three_tenants_over_the_same_documents_arriving_apart() -> None:
    """Three bursts, one per tenant, burst_gap apart, each asking its own questions about the
    same documents."""
    wl = build("multi-burst", IDS, Sizes(documents=4, burst_questions=2, burst_gap=2.5))
    assert [(b.tenant, b.at, len(b.requests)) for b in wl.bursts] == [
        (t, 2.5 * k, 8) for k, t in enumerate(TENANTS)
    ]
    docs = [{tuple(q["prefix"]) for q in b.requests} for b in wl.bursts]
    assert docs[0] == docs[1] == docs[2] and len(docs[0]) == 4
    asks = [{tuple(q["prompt_token_ids"]) for q in b.requests} for b in wl.bursts]
    assert not asks[0] & asks[1]


def test_system_prompt_chats_lead_with_the_system_prompt_then_the_document() -> None:
    """In text mode each chat is [system prompt, document, question]; documents share one of
    the system prompts; the tree's depths grow from system prompt to document."""
    text = Shape(doc_tokens=50, question_tokens=8, output_tokens=4)
    wl = build("system-prompt", text, Sizes(documents=4, questions=2, system_prompts=2))
    systems = {q["messages"][0]["content"] for q in wl.requests}
    assert len(systems) == 2 and all(len(q["messages"]) == 3 for q in wl.requests)
    assert all(q["messages"][0]["role"] == "system" for q in wl.requests)
    assert wl.depth["s0"] < wl.depth["s0/d0"] and not wl.exact  # no counter: estimated


def test_mixed_puts_decode_heavy_requests_beside_prefill_heavy_ones() -> None:
    """Mixed: D x Q short answers on documents, and decode_requests long answers on short
    prompts without a shared prefix."""
    wl = build("mixed", IDS, Sizes(documents=3, questions=2, decode_requests=5, long_output=64))
    longs = [q for q in wl.requests if "prefix" not in q]
    shorts = [q for q in wl.requests if "prefix" in q]
    assert len(longs) == 5 and {q["max_tokens"] for q in longs} == {64}
    assert len(shorts) == 6 and {q["max_tokens"] for q in shorts} == {16}


def test_the_optimum_is_one_computation_per_document_and_shard_in_whole_blocks() -> None:
    """D documents x Q questions on one shard: D x (Q - 1) x the document's whole blocks;
    split over two shards a document is computed once on each; a partial block is not cached."""
    paths = [("a",), ("b",), ("a",), ("a",), ("b",)]
    depth = {"a": 100, "b": 40}
    assert optimum_cached(paths, depth, [0] * 5, 16) == 2 * 96 + 1 * 32
    assert optimum_cached(paths, depth, [0, 0, 1, 0, 0], 16) == 96 + 32
    assert optimum_cached(paths, depth, [0] * 5, 1) == 2 * 100 + 40


def test_the_system_prompt_optimum_counts_both_levels() -> None:
    """A document after the first under a system prompt gets the system prompt's blocks; a
    repeated question gets the document's too (the two-level optimum)."""
    wl = build("system-prompt", IDS, Sizes(documents=4, questions=3, system_prompts=2,
                                            system_tokens=160))  # fmt: skip
    n = len(wl.paths)
    got = optimum_cached(wl.paths, wl.depth, [0] * n, 16)
    assert got == 4 * 2 * 560 + 2 * 1 * 160  # 4 docs x 2 repeats x (160 + 400); 2nd doc per prompt


def test_shares_count_completions_while_every_burst_has_work() -> None:
    """Completions are counted from the last burst's arrival to the first burst's end: even
    service gives a ratio near 1, one burst served first gives no overlap or a large ratio."""
    burst_of = [0, 1, 0, 1, 0, 1, 1]
    finished = [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0]
    got = shares(burst_of, finished, [0.0, 1.2])
    assert got is not None and got["window_s"] == [1.2, 3.0] and got["completed"] == [2, 2]
    assert got["ratio"] == 1.0
    serial = shares([0, 0, 1, 1], [1.0, 2.0, 3.0, 4.0], [0.0, 0.5])
    assert serial is not None and serial["ratio"] is None  # burst 1 finished nothing meanwhile
    assert shares([0, 0], [1.0, 2.0], [0.0]) is None


def _runs(thr: dict[str, list[float]]) -> list[dict[str, Any]]:
    out = []
    for mode, xs in thr.items():
        for pair, x in enumerate(xs):
            tl = {"cached_tokens": 10, "prompt_tokens": 20, "end": 1.0}
            run = {"pair": pair, "mode": mode, "throughput": x, "timeline": tl}
            if mode == "pipeline":
                run |= {"raw_bytes": 9, "stored_bytes": 3, "entry_bytes": 2}
            out.append(run)
    return out


def test_the_strongest_set_up_is_the_fastest_standalone_one_and_ratios_are_per_pair() -> None:
    """The report names the standalone set-up with the highest median throughput, and the
    pipeline's ratio against each set-up pair by pair."""
    runs = _runs(
        {
            "standalone": [10.0, 11.0, 10.5],
            "standalone-sorted": [20.0, 19.0, 21.0],
            "standalone-offload": [15.0, 15.0, 15.0],
            "pipeline": [20.0, 22.0, 21.0],
        }
    )
    modes = ["standalone", "standalone-sorted", "standalone-offload", "pipeline"]
    got = summarise(runs, modes)
    assert got["strongest"] == "standalone-sorted"
    assert got["setups"]["standalone-sorted"]["ratios"] == [1.0, 1.1579, 1.0]
    assert got["vs_strongest"] == 1.0 and got["ratios"] == [2.0, 2.0, 2.0]
    assert strongest({}) is None


def test_set_ups_and_orders_apply_to_every_workload_or_to_the_one_named() -> None:
    """--setups keeps "given" first whatever is asked; WORKLOAD:NAME applies to that workload
    only; an unknown name or workload is refused."""
    items = parse_setups("offload,sorted,overflow:offload")
    assert setups_for(items, "reuse") == ["given", "offload", "sorted"]
    assert setups_for(parse_setups("sorted,overflow:offload"), "mixed") == ["given", "sorted"]
    assert setups_for(parse_setups("sorted,overflow:offload"), "overflow") == [
        "given",
        "sorted",
        "offload",
    ]
    assert setups_for(parse_setups(""), "reuse") == ["given"]
    assert setups_for(parse_setups("sorted,offload"), "no-reuse") == ["given", "offload"]
    orders = parse_scoped("input,mixed:decode-first", ORDERS, "--orders")
    assert scoped(orders, "mixed") == ["input", "decode-first"] and scoped(orders, "x") == ["input"]
    for bad in ("given,magic", "nowhere:sorted"):
        with pytest.raises(ConfigError, match="unknown"):
            parse_setups(bad)


def test_the_sorted_set_up_groups_each_burst_on_its_own() -> None:
    """Sorted by its user: each burst's requests by document, bursts kept in their places."""
    wl = build("multi-burst", IDS, Sizes(documents=3, burst_questions=2))
    bursts = [normalize(b.requests, Settings()) for b in wl.bursts]
    order = sorted_order(bursts)
    assert sorted(order) == list(range(18))
    assert all(k * 6 <= i < (k + 1) * 6 for k in range(3) for i in order[k * 6 : (k + 1) * 6])
    for k in range(3):
        docs = [wl.paths[i] for i in order[k * 6 : (k + 1) * 6]]
        assert all(docs[j] == docs[j + 1] for j in range(0, 6, 2))


def test_offload_memory_is_a_share_of_what_the_host_has_available(tmp_path: Path) -> None:
    """40% of MemAvailable split between the offloading engines, in 0.5 GiB steps."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 99 kB\nMemAvailable:   104857600 kB\n")  # 100 GiB
    assert host_offload_gib(1, str(meminfo)) == 40.0
    assert host_offload_gib(3, str(meminfo)) == 13.0
    meminfo.write_text("MemAvailable: 1024 kB\n")
    assert host_offload_gib(1, str(meminfo)) == 0.5


def test_multi_burst_1q_asks_one_question_per_document_in_each_burst() -> None:
    """``multi-burst-1q`` is multi-burst with one question per document per burst whatever
    ``--burst-questions`` says: each burst's requests each hold a document of their own, every
    burst over the same documents (sized from the KV capacity as multi-burst's)."""
    sizes = Sizes(burst_questions=3)
    wl = build("multi-burst-1q", IDS, sizes, capacity_tokens=10_000)
    mb = build("multi-burst", IDS, sizes, capacity_tokens=10_000)
    assert wl.name == "multi-burst-1q" and len(wl.bursts) == 3
    docs = {len(b.requests) for b in wl.bursts}
    assert docs == {mb.documents} and len(mb.bursts[0].requests) == 3 * mb.documents
    for b in wl.bursts:
        prefixes = [str(q["prefix"]) for q in b.requests]
        assert len(set(prefixes)) == len(prefixes)


def test_multi_burst_mixed_asks_a_quarter_of_the_documents_twice_in_each_burst() -> None:
    """``multi-burst-mixed``: each burst asks every document once and a random quarter of them
    (its own) once more, sized as multi-burst, each request a question of its own."""
    wl = build("multi-burst-mixed", IDS, Sizes(burst_questions=3), capacity_tokens=10_000)
    mb = build("multi-burst", IDS, Sizes(), capacity_tokens=10_000)
    assert wl.documents == mb.documents and len(wl.bursts) == 3
    twice = []
    for b in wl.bursts:
        counts: dict[str, int] = {}
        for q in b.requests:
            counts[str(q["prefix"])] = counts.get(str(q["prefix"]), 0) + 1
        assert len(counts) == wl.documents and set(counts.values()) == {1, 2}
        assert sum(1 for n in counts.values() if n == 2) == round(wl.documents / 4)
        twice.append({p for p, n in counts.items() if n == 2})
        prompts = [str(q["prompt_token_ids"]) for q in b.requests]
        assert len(set(prompts)) == len(prompts)
    assert len({frozenset(t) for t in twice}) == 3  # each burst its own quarter


def test_a_bench_worker_gets_the_benchmarks_settings_as_its_flags(tmp_path: Path) -> None:
    """``prefixq bench --max-inflight 24 --no-gc-freeze --metrics-port 9100``: each worker's
    command line, parsed by the real CLI, holds max_inflight 24 and gc_freeze off beside the
    fleet fields (before: only those, so the flags were taken and ignored), and no metrics port
    (one port cannot serve two workers); settings left at their defaults are not passed."""
    argv = ["bench", "--max-inflight", "24", "--no-gc-freeze", "--metrics-port", "9100"]
    s = settings_from(build_parser().parse_args(argv)).replace(namespace="bw", shards=2)
    workers = Workers(s, "sim:llama-3.1-8b", ["max_model_len=512"], [None, None], tmp_path)
    for k in range(2):
        cmd = workers.command(k)
        assert cmd[1:4] == ["-m", "prefixq", "worker"]
        got = settings_from(build_parser().parse_args(cmd[3:]))
        assert (got.max_inflight, got.gc_freeze, got.metrics_port) == (24, False, 0)
        assert (got.namespace, got.shards) == ("bw", 2)
        assert "--metrics-port" not in cmd and "--read-count" not in cmd
        assert cmd[cmd.index("--shard") + 1] == str(k)


def test_the_report_names_the_settings_its_workers_ran_with_away_from_their_defaults() -> None:
    """``prefixq bench --no-pass-running --max-inflight 24``: the report's config says the workers
    ran with both (two runs that differ only there told apart by their reports), and nothing
    left at its default, nor the run's own namespace."""
    argv = ["bench", "--no-pass-running", "--max-inflight", "24"]
    s = settings_from(build_parser().parse_args(argv)).replace(namespace="bw", shards=2)
    assert changed_settings(s) == {"pass_running": False, "max_inflight": 24, "shards": 2}
    assert changed_settings(Settings().replace(namespace="bw")) == {}


def test_a_bench_refused_for_its_flags_or_only_planned_unpacks_no_model(tmp_path: Path) -> None:
    """``prefixq bench`` on the embedded model with a bad flag answers at once, and ``--plan``
    starts nothing: neither unpacks the model into the cache (tens of seconds on a cold one)
    before its answer."""
    from helpers import cli

    cache = tmp_path / "cache"
    cache.mkdir()
    bad = cli(None, "bench", "--cpu", "1", "--cache-dir", str(cache), "--setups", "bogus")
    assert bad.returncode != 0 and "--setups: unknown 'bogus'" in bad.stderr, bad.stderr
    plan = cli(None, "bench", "--cpu", "1", "--cache-dir", str(cache), "--plan", "131072")
    assert plan.returncode == 0 and "KV tokens each" in plan.stdout, plan.stderr
    assert not any(cache.iterdir())
