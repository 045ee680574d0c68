"""The benchmark's finite bursts: `build` makes one of `WORKLOADS` (the table of docs/BENCHMARKS.md
gives each with its defaults, `Sizes`), sizing overflow and the multi-burst ones from the engines'
KV capacity. Documents are windows of Python's bundled reference documentation (~4 characters a
token) or, for dummy-weight models, random token ids of the same lengths; every request is greedy
with ``ignore_eos`` and a fixed output. Each request carries its path in the prefix tree and each
node its depth in tokens (`Workload.paths`, `Workload.depth`): what bench/measures.py computes the
cached-token optimum from.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from prefixq.core.sharing import DEFAULT_PRIORITY

CHARS_PER_TOKEN = 4
QUESTIONS = (
    "Summarise the document above in a few sentences.",
    "What is the main rule the document above describes?",
    "Give an example that follows the document above.",
    "Which terms does the document above define?",
    "What would a beginner find hardest in the document above?",
    "List the keywords the document above mentions.",
)
WORKLOADS = (
    "no-reuse",
    "reuse",
    "overflow",
    "multi-burst",
    "multi-burst-1q",
    "multi-burst-mixed",
    "system-prompt",
    "mixed",
    "zipf",
)
#: workloads whose requests share prefixes (enqueue orders and the sorted set-up matter)
SHARING = frozenset(WORKLOADS) - {"no-reuse"}
#: the workloads of several bursts over one corpus (sized from the KV capacity)
MULTI_BURSTS = ("multi-burst", "multi-burst-1q", "multi-burst-mixed")
TENANTS = ("tenant-a", "tenant-b", "tenant-c")
#: counts a rendered prompt's tokens (text mode with the model's tokenizer); None: estimate
Counter = Callable[[Any], int]


@dataclass(frozen=True, slots=True)
class Shape:
    doc_tokens: int = 4000
    question_tokens: int = 32
    output_tokens: int = 128
    token_ids: bool = False
    vocab: int = 32_000


@dataclass(frozen=True, slots=True)
class Sizes:
    """How many of what, per workload (the CLI's flags; defaults in docs/BENCHMARKS.md)."""

    requests: int = 64
    #: documents of reuse, multi-burst, system-prompt and mixed; None: 64 (overflow and
    #: multi-burst: sized from the KV capacity)
    documents: int | None = None
    questions: int = 4
    #: overflow: the documents hold this many times the engines' KV capacity
    overflow: float = 3.0
    burst_questions: int = 2
    #: multi-burst: the share of each burst's documents asked one question more (its own
    #: random subset; the rest get ``burst_questions``)
    burst_more: float = 0.0
    burst_gap: float = 3.0
    #: multi-burst: bursts (tenant-a, tenant-b, ...), and the share of the documents each burst
    #: after the first asks about (a random subset; 1: all)
    bursts: int = 3
    burst_share: float = 1.0
    #: multi-burst: each burst's priority, in order (high, normal, low; missing: normal)
    burst_priorities: tuple[str, ...] = ()
    system_prompts: int = 4
    system_tokens: int = 2000
    decode_requests: int = 64
    decode_prompt_tokens: int = 64
    long_output: int = 512
    short_output: int = 16
    #: zipf: requests in all, over the documents with Zipf-distributed group sizes
    zipf_requests: int = 1536
    zipf_exponent: float = 1.0


@dataclass
class Burst:
    """One burst of a workload: its requests, its tenant, when it arrives (s after the start),
    its priority."""

    requests: list[dict[str, Any]]
    tenant: str = "default"
    at: float = 0.0
    priority: str = DEFAULT_PRIORITY


@dataclass
class Workload:
    name: str
    bursts: list[Burst]
    #: per request (bursts in order), its nodes in the prefix tree, root first ((): none)
    paths: list[tuple[str, ...]] = field(default_factory=list)
    #: per node, tokens from the start of the prompt to the end of the node
    depth: dict[str, int] = field(default_factory=dict)
    #: the depths are counted exactly (token ids, or the model's tokenizer), not estimated
    exact: bool = True
    documents: int = 0

    @property
    def requests(self) -> list[dict[str, Any]]:
        return [q for b in self.bursts for q in b.requests]


def overflow_documents(capacity_tokens: int, shape: Shape, sizes: Sizes) -> int:
    """Documents whose tokens hold ``sizes.overflow`` times ``capacity_tokens`` (at least 2)."""
    return max(2, math.ceil(sizes.overflow * capacity_tokens / max(1, shape.doc_tokens)))


def build(
    name: str,
    shape: Shape,
    sizes: Sizes,
    *,
    capacity_tokens: int = 0,
    count: Counter | None = None,
    seed: int = 0,
) -> Workload:
    """The workload ``name``; ``capacity_tokens`` (the engines' KV cache, summed) sizes overflow
    and multi-burst when ``sizes.documents`` is None; ``count`` counts a prompt's tokens in text
    mode (else they are estimated at `CHARS_PER_TOKEN`)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")
    make = _Maker(shape, random.Random(seed), count)
    docs = sizes.documents
    if docs is None:
        sized = name in ("overflow", *MULTI_BURSTS) and capacity_tokens > 0
        docs = overflow_documents(capacity_tokens, shape, sizes) if sized else 64
    if name == "no-reuse":
        wl = make.documents("no-reuse", [1] * sizes.requests, shuffle=False)
    elif name in ("reuse", "overflow"):
        wl = make.documents(name, [sizes.questions] * docs, shuffle=True)
    elif name == "multi-burst":
        wl = make.multi_burst(name, docs, sizes)
    elif name == "multi-burst-1q":  # analyses that ask one question per document each
        wl = make.multi_burst(name, docs, replace(sizes, burst_questions=1))
    elif name == "multi-burst-mixed":  # one question per document, two on a quarter of them
        wl = make.multi_burst(name, docs, replace(sizes, burst_questions=1, burst_more=0.25))
    elif name == "system-prompt":
        wl = make.system_prompt(docs, sizes)
    elif name == "zipf":
        counts = zipf_counts(docs, sizes.zipf_requests, sizes.zipf_exponent)
        wl = make.documents("zipf", counts, shuffle=True)
    else:
        wl = make.mixed(docs, sizes)
    wl.documents = docs
    return wl


class _Maker:
    """Documents, system prompts and questions of one shape, from one random generator."""

    def __init__(self, shape: Shape, rng: random.Random, count: Counter | None) -> None:
        self.shape, self.rng, self.count = shape, rng, count
        self.corpus = "" if shape.token_ids else _corpus()
        self.sampling = {"max_tokens": shape.output_tokens, "ignore_eos": True, "temperature": 0.0}

    # ---- pieces ------------------------------------------------------------------------------
    def _ids(self, n: int) -> list[int]:
        return [self.rng.randrange(100, self.shape.vocab) for _ in range(n)]

    def doc(self, i: int, tokens: int | None = None) -> Any:
        n = tokens or self.shape.doc_tokens
        if self.shape.token_ids:
            return self._ids(n)
        return _doc_text(self.corpus, i, n * CHARS_PER_TOKEN)

    def system(self, k: int, tokens: int) -> Any:
        if self.shape.token_ids:
            return self._ids(tokens)
        rules = _doc_text(self.corpus, 7919 * (k + 1), tokens * CHARS_PER_TOKEN, "Rules")
        return f"You are assistant {k}. Follow these rules.\n" + rules

    def question(self, q: int, tokens: int | None = None) -> Any:
        n = tokens or self.shape.question_tokens
        if self.shape.token_ids:
            return self._ids(n)
        text = QUESTIONS[q % len(QUESTIONS)]
        pad = n * CHARS_PER_TOKEN - len(text) - 8
        return f"\n\nQ{q}: {text}" + (" Answer fully." * max(0, pad // 14))

    def request(self, rid: str, prefix: Any, ask: Any, **sampling: Any) -> dict[str, Any]:
        s = self.sampling | sampling
        if self.shape.token_ids:
            if prefix is None:
                return {"id": rid, "prompt_token_ids": ask, **s}
            return {"id": rid, "prefix": prefix, "prompt_token_ids": ask, **s}
        if prefix is None:
            return {"id": rid, "prompt": ask, **s}
        return {"id": rid, "prefix": prefix, "prompt": ask, **s}

    def tokens(self, prefix: Any) -> int:
        """Tokens of a prefix as the engine sees it (exact for ids and with a counter)."""
        if isinstance(prefix, list) and (not prefix or isinstance(prefix[0], int)):
            return len(prefix)
        if self.count is not None:
            return self.count(prefix)
        if isinstance(prefix, list):  # messages
            return sum(len(m["content"]) for m in prefix) // CHARS_PER_TOKEN
        return len(prefix) // CHARS_PER_TOKEN

    @property
    def exact(self) -> bool:
        return self.shape.token_ids or self.count is not None

    # ---- workloads ---------------------------------------------------------------------------
    def documents(self, name: str, counts: Sequence[int], *, shuffle: bool) -> Workload:
        """Document ``d`` asked ``counts[d]`` questions."""
        reqs: list[dict[str, Any]] = []
        paths: list[tuple[str, ...]] = []
        depth: dict[str, int] = {}
        for d, per_doc in enumerate(counts):
            doc = self.doc(d)
            depth[f"d{d}"] = self.tokens(doc)
            for q in range(per_doc):
                reqs.append(self.request(f"{name}-d{d}-q{q}", doc, self.question(q)))
                paths.append((f"d{d}",))
        if shuffle:
            reqs, paths = _shuffled(self.rng, reqs, paths)
        return Workload(name, [Burst(reqs)], paths, depth, self.exact)

    def multi_burst(self, name: str, docs: int, sizes: Sizes) -> Workload:
        texts = [self.doc(d) for d in range(docs)]
        depth = {f"d{d}": self.tokens(t) for d, t in enumerate(texts)}
        bursts: list[Burst] = []
        paths: list[tuple[str, ...]] = []
        for b in range(sizes.bursts):
            tenant = TENANTS[b] if b < len(TENANTS) else f"tenant-{b}"
            reqs: list[dict[str, Any]] = []
            ps: list[tuple[str, ...]] = []
            asked: Sequence[int] = range(docs)
            if b and sizes.burst_share < 1:
                k = max(1, round(docs * sizes.burst_share))
                asked = range(docs) if k >= docs else sorted(self.rng.sample(range(docs), k))
            more: set[int] = set()
            if sizes.burst_more > 0:
                k = min(len(asked), round(len(asked) * sizes.burst_more))
                more = set(self.rng.sample(list(asked), k))
            per = sizes.burst_questions + 1  # question numbers per burst: its own questions
            for d in asked:
                doc = texts[d]
                for q in range(sizes.burst_questions + (d in more)):
                    qn = b * per + q
                    reqs.append(self.request(f"mb{b}-d{d}-q{q}", doc, self.question(qn)))
                    ps.append((f"d{d}",))
            reqs, ps = _shuffled(self.rng, reqs, ps)
            given = sizes.burst_priorities
            priority = given[b] if b < len(given) else DEFAULT_PRIORITY
            bursts.append(Burst(reqs, tenant, round(b * sizes.burst_gap, 3), priority))
            paths += ps
        return Workload(name, bursts, paths, depth, self.exact)

    def system_prompt(self, docs: int, sizes: Sizes) -> Workload:
        reqs: list[dict[str, Any]] = []
        paths: list[tuple[str, ...]] = []
        depth: dict[str, int] = {}
        systems = [self.system(k, sizes.system_tokens) for k in range(sizes.system_prompts)]
        for d in range(docs):
            k = d % sizes.system_prompts
            sys_, doc = systems[k], self.doc(d)
            if self.shape.token_ids:
                prefix: Any = sys_ + doc
                head: Any = sys_
            else:
                head = [{"role": "system", "content": sys_}]
                prefix = [*head, {"role": "user", "content": "Document:\n" + doc}]
            depth.setdefault(f"s{k}", self.tokens(head))
            depth[f"s{k}/d{d}"] = self.tokens(prefix)
            for q in range(sizes.questions):
                rid = f"system-prompt-s{k}-d{d}-q{q}"
                ask = self.question(q)
                if self.shape.token_ids:
                    reqs.append(self.request(rid, prefix, ask))
                else:
                    msgs = [*prefix, {"role": "user", "content": ask.strip()}]
                    reqs.append({"id": rid, "messages": msgs, **self.sampling})
                paths.append((f"s{k}", f"s{k}/d{d}"))
        reqs, paths = _shuffled(self.rng, reqs, paths)
        return Workload("system-prompt", [Burst(reqs)], paths, depth, self.exact)

    def mixed(self, docs: int, sizes: Sizes) -> Workload:
        wl = self.documents("mixed", [sizes.questions] * docs, shuffle=False)
        reqs, paths = wl.bursts[0].requests, wl.paths
        for q in reqs:
            q["max_tokens"] = sizes.short_output
        for k in range(sizes.decode_requests):
            ask = self.question(k, sizes.decode_prompt_tokens)
            if not self.shape.token_ids:
                ask = f"Task {k}: write a long essay. " + ask
            reqs.append(self.request(f"mixed-long-{k}", None, ask, max_tokens=sizes.long_output))
            paths.append(())
        reqs, paths = _shuffled(self.rng, reqs, paths)
        return Workload("mixed", [Burst(reqs)], paths, wl.depth, self.exact)


def zipf_counts(docs: int, total: int, exponent: float) -> list[int]:
    """Requests per document of the ``zipf`` workload (groups that differ widely in size, the
    requests shuffled): ``total`` split in proportion to ``1 / (d + 1) ** exponent``,
    largest remainders first, every document at least one (so ``max(total, docs)`` in all)."""
    weights = [1.0 / (d + 1) ** exponent for d in range(docs)]
    spare = max(0, total - docs)
    raw = [spare * w / sum(weights) for w in weights]
    counts = [1 + int(x) for x in raw]
    by_rest = sorted(range(docs), key=lambda d: int(raw[d]) - raw[d])
    for d in by_rest[: max(total, docs) - sum(counts)]:
        counts[d] += 1
    return counts


def _shuffled(
    rng: random.Random, reqs: list[dict[str, Any]], paths: list[tuple[str, ...]]
) -> tuple[list[dict[str, Any]], list[tuple[str, ...]]]:
    order = list(range(len(reqs)))
    rng.shuffle(order)
    return [reqs[i] for i in order], [paths[i] for i in order]


def _corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def _doc_text(corpus: str, i: int, chars: int, label: str = "Document") -> str:
    start = (i * chars) % max(1, len(corpus) - chars)
    return f"{label} {i}.\n" + corpus[start : start + chars]
