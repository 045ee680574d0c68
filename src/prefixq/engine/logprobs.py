"""vLLM's per-token logprobs as prefixq's `TokenLogprob` records (what the adapter, vllm_engine.py,
puts in a choice when a request asks for logprobs)."""

from __future__ import annotations

from typing import Any

from prefixq.core.choices import MIN_LOGPROB, TokenLogprob

__all__ = ["logprobs_of"]


def logprobs_of(comp: Any, k: int) -> list[TokenLogprob]:
    """vLLM's per-position logprobs (a list of ``{token id: Logprob}``, or FlatLogprobs, which
    index the same way) -> one `TokenLogprob` per output token, with the ``k`` most likely
    alternatives (vLLM's dict holds the sampled token, whatever its rank, plus ranks 1..k)."""
    out: list[TokenLogprob] = []
    lps = comp.logprobs
    if lps is None:
        return out
    for pos, tid in enumerate(comp.token_ids):
        if pos >= len(lps):
            break
        at = lps[pos] or {}
        chosen = at.get(tid)
        top = sorted(
            (v.rank, t, v) for t, v in at.items() if v.rank is not None and 1 <= v.rank <= k
        )
        out.append(
            TokenLogprob(
                token_id=int(tid),
                token=None if chosen is None else chosen.decoded_token,
                logprob=_clamp(chosen.logprob) if chosen is not None else MIN_LOGPROB,
                top=[(int(t), v.decoded_token, _clamp(v.logprob)) for _, t, v in top[:k]],
            )
        )
    return out


def _clamp(lp: float) -> float:
    """-inf (and NaN) -> `MIN_LOGPROB`: JSON has neither."""
    return float(lp) if lp > MIN_LOGPROB else MIN_LOGPROB
