"""The benchmark's finite bursts, shaped as the study's workloads (docs/BENCHMARKS.md).

``no-reuse``: N requests, each on its own document. ``reuse``: D documents x Q questions,
shuffled. Documents are real English (consecutive windows of Python's bundled reference
documentation, ~4 characters per token) or, for dummy-weight models without a tokenizer, token
ids of the same lengths. Every request: greedy, ``ignore_eos``, a fixed number of output tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

CHARS_PER_TOKEN = 4
QUESTIONS = (
    "Summarise the document above in a few sentences.",
    "What is the main rule the document above describes?",
    "Give an example that follows the document above.",
    "Which terms does the document above define?",
    "What would a beginner find hardest in the document above?",
    "List the keywords the document above mentions.",
)


@dataclass(frozen=True, slots=True)
class Shape:
    doc_tokens: int = 4000
    question_tokens: int = 32
    output_tokens: int = 128
    token_ids: bool = False
    vocab: int = 32_000


def _corpus() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def _doc_text(corpus: str, i: int, chars: int) -> str:
    start = (i * chars) % max(1, len(corpus) - chars)
    return f"Document {i}.\n" + corpus[start : start + chars]


def build(
    workload: str, *, requests: int, questions: int, shape: Shape, seed: int = 0
) -> tuple[list[dict[str, Any]], list[int]]:
    """(request dicts, document index of each) for ``no-reuse`` or ``reuse``."""
    rng = random.Random(seed)
    docs = requests if workload == "no-reuse" else max(1, requests // questions)
    per_doc = 1 if workload == "no-reuse" else questions
    sampling = {"max_tokens": shape.output_tokens, "ignore_eos": True, "temperature": 0.0}
    corpus = "" if shape.token_ids else _corpus()
    reqs: list[dict[str, Any]] = []
    doc_of: list[int] = []
    for d in range(docs):
        if shape.token_ids:
            doc: Any = [rng.randrange(100, shape.vocab) for _ in range(shape.doc_tokens)]
        else:
            doc = _doc_text(corpus, d, shape.doc_tokens * CHARS_PER_TOKEN)
        for q in range(per_doc):
            rid = f"{workload}-d{d}-q{q}"
            if shape.token_ids:
                ids = [rng.randrange(100, shape.vocab) for _ in range(shape.question_tokens)]
                reqs.append({"id": rid, "prefix": doc, "prompt_token_ids": ids, **sampling})
            else:
                text = QUESTIONS[q % len(QUESTIONS)]
                pad = shape.question_tokens * CHARS_PER_TOKEN - len(text) - 8
                ask = f"\n\nQ{q}: {text}" + (" Answer fully." * max(0, pad // 14))
                reqs.append({"id": rid, "prefix": doc, "prompt": ask, **sampling})
            doc_of.append(d)
    order = list(range(len(reqs)))
    if workload == "reuse":
        rng.shuffle(order)
    return [reqs[i] for i in order], [doc_of[i] for i in order]
