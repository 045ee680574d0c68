"""Enqueue orders on their own (client/order.py): which permutation each order makes of a burst,
from what it peeks at each request, with no Redis (tests/test_producer.py checks the streams)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from prefixq.bench.workloads import Shape, Sizes, build
from prefixq.client.order import ORDERS, Peek, enqueue_order, peek, peeks
from prefixq.core.records import Request
from prefixq.core.settings import Settings


def _ids(reqs: list[dict[str, Any]], order: str) -> list[str]:
    return [reqs[i]["id"] for i in enqueue_order(order, peeks(reqs, order))]


def test_every_order_is_a_permutation_of_the_burst() -> None:
    """Whatever the order, each request is enqueued exactly once."""
    docs = ["doc A " * 50, "doc B " * 50]
    reqs: list[dict[str, Any]] = [
        {"id": f"r{i}", "prefix": docs[i % 2], "prompt": "?", "max_tokens": 1 + i} for i in range(9)
    ] + [{"id": "solo", "prompt": "no prefix"}, {"id": "bad", "prefix": object(), "prompt": "x"}]
    for order in ORDERS:
        assert sorted(enqueue_order(order, peeks(reqs, order))) == list(range(len(reqs))), order


def test_depth_first_puts_documents_under_one_system_prompt_together() -> None:
    """Given chats whose leading messages are one of two system prompts then a document, shuffled,
    depth-first enqueues every document of one system prompt (each with its questions together)
    before any of the other's; grouped keeps the documents in order of first appearance."""
    systems = [{"role": "system", "content": f"rules {k} " * 200} for k in range(2)]
    docs = [{"role": "user", "content": f"document {d} " * 100} for d in range(4)]
    plan = [(0, 0), (1, 1), (0, 2), (1, 3), (0, 0), (1, 1), (0, 2), (1, 3)]  # (system, doc)
    reqs = [
        {"id": f"s{k}d{d}q{i}", "messages": [systems[k], docs[d], {"role": "user", "content": "?"}]}
        for i, (k, d) in enumerate(plan)
    ]
    got = _ids(reqs, "depth-first")
    systems_seen = [x[1] for x in got]
    assert systems_seen in (list("00001111"), list("11110000"))
    docs_seen = [x[3] for x in got]
    assert all(docs_seen[i] == docs_seen[i + 1] for i in range(0, 8, 2))  # each doc's pair
    assert [x[3] for x in _ids(reqs, "grouped")] == list("00112233")


def test_depth_first_walks_token_id_prefixes_that_share_leading_blocks_together() -> None:
    """Token-id prefixes sharing a long leading part (a system prompt's ids before a document's)
    are adjacent in depth-first order, and two bursts over the same prefixes get the same order."""
    system = [[7] * 2000, [9] * 2000]
    reqs = [
        {"id": f"s{d % 2}d{d}", "prefix": system[d % 2] + [d] * 500, "prompt_token_ids": [1]}
        for d in range(6)
    ]
    got = _ids(reqs, "depth-first")
    assert [x[1] for x in got] in (list("000111"), list("111000"))
    again = _ids(list(reversed(reqs)), "depth-first")
    assert again == got


def test_decode_first_puts_decode_heavy_groups_ahead_of_prefill_heavy_ones() -> None:
    """Given long documents with short answers and short prompts with long answers, mixed,
    decode-first enqueues the short prompts first (in input order), then each document's
    questions together; the estimate counts a group's shared prefix once."""
    doc = "word " * 4000
    reqs: list[dict[str, Any]] = []
    for i in range(6):
        if i % 2:
            reqs.append({"id": f"long{i}", "prompt": "write", "max_tokens": 512})
        else:
            reqs.append({"id": f"q{i}", "prefix": doc, "prompt": "?", "max_tokens": 16})
    assert _ids(reqs, "decode-first") == ["long1", "long3", "long5", "q0", "q2", "q4"]


@pytest.mark.parametrize("name", ["no-reuse", "reuse", "overflow", "multi-burst", "system-prompt"])
def test_decode_first_is_grouped_where_the_groups_are_alike(name: str) -> None:
    """On the benchmark's workloads whose answers all have one budget decode-first enqueues
    exactly the grouped order, so the GPU runs of grouped hold for it (docs/BENCHMARKS.md)."""
    for b in build(name, Shape(token_ids=True), Sizes(), capacity_tokens=131_072).bursts:
        reqs = b.requests
        assert enqueue_order("decode-first", peeks(reqs, "decode-first")) == enqueue_order(
            "grouped", peeks(reqs, "grouped")
        )


def test_decode_first_on_the_mixed_workload_starts_every_long_answer_then_groups() -> None:
    """The benchmark's mixed burst (shuffled): its 64 requests for 512-token answers first, in
    input order, then the documents' questions in the grouped order (the order measured on the
    H200 as decode-first: docs/BENCHMARKS.md)."""
    mixed = build("mixed", Shape(token_ids=True), Sizes()).bursts[0].requests
    got = _ids(mixed, "decode-first")
    longs = [q["id"] for q in mixed if q["max_tokens"] == Sizes().long_output]
    rest = [q for q in mixed if q["max_tokens"] != Sizes().long_output]
    assert len(longs) == Sizes().decode_requests
    assert got == longs + _ids(rest, "grouped")


@pytest.mark.parametrize("seed", range(20))
def test_decode_first_keeps_input_order_where_no_answer_is_several_times_the_short_ones(
    seed: int,
) -> None:
    """Answers of 1 to 3.9 times the smallest budget (the fairness test's bursts of 12 to 16
    tokens are such a burst), with and without shared documents: decode-first is grouped, so a
    burst's own requests keep their order and bursts sharing the workers stay fair."""
    rng = random.Random(seed)
    low = rng.randint(1, 300)
    docs = [f"doc {d} " * 300 for d in range(3)]
    reqs: list[dict[str, Any]] = []
    for i in range(rng.randint(1, 40)):
        q: dict[str, Any] = {"id": f"r{i}", "prompt": "?" * rng.randint(1, 400)}
        q["max_tokens"] = rng.randint(low, int(low * 3.9))
        if rng.random() < 0.5:
            q["prefix"] = rng.choice(docs)
        reqs.append(q)
    assert _ids(reqs, "decode-first") == _ids(reqs, "grouped")


def test_decode_first_starts_the_longest_answer_first_and_moves_a_whole_group() -> None:
    """Long answers go first longest first (its decode is the longest chain of engine steps);
    a document one of whose questions asks a long answer moves with all its questions; a
    request too odd to look at counts for no budget."""
    doc = "document " * 500
    reqs: list[dict[str, Any]] = [
        {"id": "a", "prompt": "x", "max_tokens": 16},
        {"id": "d1", "prefix": doc, "prompt": "short?", "max_tokens": 16},
        {"id": "b", "prompt": "x", "max_tokens": 512},
        {"id": "c", "prompt": "x", "max_tokens": 2048},
        {"id": "e", "prompt": "x", "max_tokens": 20},
        {"id": "odd", "prefix": [object()], "prompt": "x"},  # not packable: Peek()
        {"id": "d2", "prefix": doc, "prompt": "long?", "max_tokens": 600},
        {"id": "f", "prompt": "x", "max_tokens": 16},
        {"id": "g", "prompt": "x", "max_tokens": 63},  # under 4 x 16
    ]
    assert _ids(reqs, "decode-first") == ["c", "d1", "d2", "b", "a", "e", "odd", "f", "g"]


@pytest.mark.parametrize("longs", [1, 30, 60, 89])
def test_decode_first_moves_long_answers_whether_they_are_few_or_most_of_the_burst(
    longs: int,
) -> None:
    """A burst of 100 where some ask 512 tokens and the rest 16, shuffled: the long ones first
    (in input order), however many (short answers left beside them would end the burst with
    the long ones still running); a single 1-token answer among 256-token ones moves nothing."""
    rng = random.Random(longs)
    budgets = [512] * longs + [16] * (100 - longs)
    rng.shuffle(budgets)
    reqs = [{"id": f"r{i}", "prompt": "x", "max_tokens": b} for i, b in enumerate(budgets)]
    got = _ids(reqs, "decode-first")
    assert got == [q["id"] for q in reqs if q["max_tokens"] == 512] + [
        q["id"] for q in reqs if q["max_tokens"] == 16
    ]
    odd = [{"id": f"s{i}", "prompt": "x", "max_tokens": 1 if i == 7 else 256} for i in range(50)]
    assert _ids(odd, "decode-first") == [q["id"] for q in odd]


def test_the_default_order_is_decode_first() -> None:
    """A burst that names no order is enqueued decode-first (settings' enqueue_order)."""
    assert Settings().enqueue_order == "decode-first"


def test_decode_first_reads_the_output_budget_of_openai_lines_and_requests() -> None:
    """An OpenAI line's body.max_completion_tokens and a Request's sampling count as what the
    request asks; a request naming none asks the default."""
    line = {"custom_id": "a", "body": {"messages": [{"role": "user", "content": "hi"}],
                                       "max_completion_tokens": 700}}  # fmt: skip
    assert peek(line, "decode-first").output == 700
    req = Request(id="b", prompt="hi", sampling={"max_tokens": 9})
    assert peek(req, "decode-first").output == 9
    assert peek({"id": "c", "prompt": "hi"}, "decode-first").output == 256


@pytest.mark.parametrize("order", ["grouped", "depth-first", "decode-first"])
def test_a_prefix_shared_by_object_is_looked_at_once_and_equal_copies_group_together(
    order: str,
) -> None:
    """Requests holding the same document object, or equal copies of it, are one group."""
    doc = "shared " * 300
    reqs = [
        {"id": "a", "prefix": doc, "prompt": "1"},
        {"id": "x", "prompt": "alone"},
        {"id": "b", "prefix": "".join(["shared "] * 300), "prompt": "2"},
        {"id": "c", "prefix": doc, "prompt": "3"},
    ]
    p = peeks(reqs, order)
    assert p[0].group == p[2].group == p[3].group is not None and p[1].group is None
    got = _ids(reqs, order)
    assert "".join(x for x in got if x != "x") == "abc"


def test_input_order_still_groups_for_counting_prefix_uses() -> None:
    """Input order keeps the burst as given, and its peeks still carry each request's group and
    prefix size (the producer counts a prefix's uses from them to store it once)."""
    doc = "p" * 999
    reqs = [{"id": "a", "prefix": doc, "prompt": "?"}, {"id": "b", "prompt": "!"}]
    got = peeks(reqs, "input")
    assert got[0].group is not None and got[0].size == 999 and got[1] == Peek()
    assert enqueue_order("input", got) == [0, 1]


ODD = [
    {"id": "a", "messages": [{"role": "system", "content": 7}, {"role": "user", "content": "x"}]},
    {"id": "b", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    {"id": "c", "prefix": [{"content": 5}], "prompt": "?"},
    {"id": "d", "prefix": [1, "a", None], "prompt": "?"},
    {"id": "e", "body": {"messages": [{"content": {"nested": 1}}]}},
    {"id": "f", "messages": [5, None], "max_tokens": float("inf")},
]


@pytest.mark.parametrize("order", ORDERS)
def test_an_odd_request_is_a_group_of_its_own_in_every_order(order: str) -> None:
    """Ordering runs before validation: a request too odd to look at (a message content that is
    a number, a prefix of mixed types) is a group of its own, never an exception (validation
    refuses it later, tests/test_faults_input.py), and the burst still gets a permutation."""
    reqs = [*ODD, {"id": "ok", "prefix": "doc " * 200, "prompt": "?"}]
    looks = peeks(reqs, order)
    assert looks[0] == Peek()  # its prefix's size cannot be counted: no group, no counts
    assert looks[-1].group is not None
    assert sorted(enqueue_order(order, looks)) == list(range(len(reqs)))
