"""The parts of a result that hold several completions: `Choice` and its per-token
`TokenLogprob` (a neutral form that OpenAI chat and completions logprobs are both made from)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["MIN_LOGPROB", "Choice", "TokenLogprob"]

#: the logprob reported for a token the engine gives -inf (JSON has no infinity; vLLM's OpenAI
#: server clamps the same way)
MIN_LOGPROB = -9999.0


@dataclass(slots=True)
class TokenLogprob:
    """One output token with its log probability and the most likely tokens at its position.

    ``token`` is the token's text as the engine's tokenizer decodes it alone (None when the
    engine runs without a tokenizer, ``skip_tokenizer_init``); ``top`` holds up to the requested
    number of alternatives, most likely first, as ``(token id, text, logprob)``.
    """

    token_id: int
    token: str | None
    logprob: float
    top: list[tuple[int, str | None, float]] = field(default_factory=list)

    def to_wire(self) -> list[Any]:
        return [self.token_id, self.token, self.logprob, [x for t in self.top for x in t]]

    @classmethod
    def from_wire(cls, d: list[Any]) -> TokenLogprob:
        flat = d[3] or []
        top = [(flat[i], flat[i + 1], flat[i + 2]) for i in range(0, len(flat) - 2, 3)]
        return cls(token_id=d[0], token=d[1], logprob=d[2], top=top)

    def to_json(self) -> dict[str, Any]:
        return {
            "token_id": self.token_id,
            "token": self.token,
            "logprob": self.logprob,
            "top_logprobs": [{"token_id": i, "token": t, "logprob": lp} for i, t, lp in self.top],
        }


@dataclass(slots=True)
class Choice:
    """One of the ``n`` completions of a request; ``logprobs`` has one `TokenLogprob` per output
    token when the request asked for logprobs, else None."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None

    def to_json(self, *, token_ids: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "index": self.index,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "logprobs": None if self.logprobs is None else [t.to_json() for t in self.logprobs],
        }
        if token_ids:
            out["token_ids"] = self.token_ids
        return out
