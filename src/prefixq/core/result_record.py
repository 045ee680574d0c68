"""The output record: `Result`, what one request came to (`Timings` of its stages, an
``error_code`` of `ERROR_CODES` when it failed), mapped to the short-keyed dict that `wire` packs
and to the documented JSONL line. `prefixq.core.records` holds the input record, `Request`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prefixq.core.choices import Choice, TokenLogprob
from prefixq.core.embeddings import unpack_vector
from prefixq.core.errors import (
    EngineAborted,
    EngineError,
    EngineRefused,
    ValidationError,
    WireError,
)

#: the type each field of a recorded result must have when present (`Result.from_wire`)
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "x": str,
    "f": str,
    "e": str,
    "k": int,
    "pt": int,
    "ct": int,
    "ot": int,
    "pc": int,
    "ti": (list, tuple),
    "t": (list, tuple),
    "w": str,
    "ec": str,
    "u": str,
    "md": str,
    "ef": str,
    "em": (list, tuple),
    "ch": (list, tuple),
}


def _int(x: Any) -> int:
    if not isinstance(x, int) or isinstance(x, bool):
        raise TypeError(f"{type(x).__name__} where an int belongs")
    return x


@dataclass(slots=True)
class Timings:
    """Epoch seconds of each stage of one request."""

    enqueued: float = 0.0
    admitted: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0


#: machine-readable classes of `Result.error` (`Result.error_code`): the request was cancelled
#: with its burst; its burst's deadline passed before it was admitted; it was refused as invalid
#: (by validation or by the engine: too long a prompt, a token id outside the vocabulary); the
#: engine failed it; it was dead-lettered after ``max_attempts`` deliveries (or undecodable);
#: something unexpected failed in prefixq itself
ERROR_CODES = (
    "cancelled",
    "expired",
    "invalid_request",
    "engine_error",
    "dead_lettered",
    "internal_error",
)


#: the error of a request that its burst's end stopped before it finished, by reason (the
#: reason is its ``error_code``): a cancel, or the burst's deadline
ENDED_ERRORS = {
    "cancelled": "cancelled: the burst was cancelled before this request finished",
    "expired": "expired: the burst's deadline passed before this request finished",
}


def error_code_of(err: BaseException) -> str:
    """The `ERROR_CODES` entry for an exception that failed one request."""
    if isinstance(err, ValidationError | WireError | EngineRefused):
        return "invalid_request"
    if isinstance(err, EngineAborted):
        return "cancelled"
    if isinstance(err, EngineError):
        return "engine_error"
    return "internal_error"


@dataclass(slots=True)
class Result:
    """The outcome of one request; ``error`` is None on success, else the reason, and
    ``error_code`` one of `ERROR_CODES`.

    ``choices`` is empty unless the request asked for ``n`` > 1 or for logprobs; then it holds
    all ``n`` choices in order, and choice 0 is also in ``text``, ``token_ids`` and
    ``finish_reason``. ``output_tokens`` counts the tokens of every choice. ``endpoint`` (the
    OpenAI url the line named, None for a plain line) and ``model`` (its body's ``model``) are
    what an OpenAI output object needs. An embeddings request's result holds one vector per input
    in ``embeddings`` (little-endian float32 bytes: `prefixq.core.embeddings.pack_vector`) and
    the request's ``encoding_format`` for its output line; ``prompt_tokens`` sums its inputs'.
    """

    id: str
    index: int
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    shard: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    predicted_cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)
    worker: str = ""
    error_code: str | None = None
    choices: list[Choice] = field(default_factory=list)
    endpoint: str | None = None
    model: str | None = None
    #: what the output object repeats of the request's body (`Request.echo`)
    echo: dict[str, Any] | None = None
    embeddings: list[bytes] | None = None
    encoding_format: str | None = None

    @classmethod
    def failed(
        cls, request_id: str, index: int, code: str, error: str, *, worker: str, now: float
    ) -> Result:
        """The one constructor of a request's failed result that no engine served (cancelled,
        expired, dead-lettered: ``code`` of `ERROR_CODES`); `Entry.failed` adds what the
        stream entry knows."""
        res = cls(id=request_id, index=index, error=error, error_code=code, worker=worker)
        res.timings.finished = now
        return res

    def to_wire(self) -> dict[str, Any]:
        """Short-keyed dict for `wire.encode`."""
        t = self.timings
        d: dict[str, Any] = {
            "id": self.id,
            "i": self.index,
            "x": self.text,
            "f": self.finish_reason,
            "e": self.error,
            "k": self.shard,
            "pt": self.prompt_tokens,
            "ct": self.cached_tokens,
            "ot": self.output_tokens,
            "pc": self.predicted_cached_tokens,
            "ti": self.token_ids,
            "t": [t.enqueued, t.admitted, t.first_token, t.finished],
            "w": self.worker,
        }
        if self.error_code is not None:
            d["ec"] = self.error_code
        if self.choices:
            d["ch"] = [self._choice_wire(c) for c in self.choices]
        if self.endpoint is not None:
            d["u"] = self.endpoint
        if self.model is not None:
            d["md"] = self.model
        if self.echo:
            d["eo"] = self.echo
        if self.embeddings is not None:
            d["em"] = self.embeddings
        if self.encoding_format is not None:
            d["ef"] = self.encoding_format
        return d

    def _choice_wire(self, c: Choice) -> list[Any]:
        """``[index, text, token ids, finish reason, logprobs]``; text and token ids are None
        when they are the result's own (choice 0 is not stored twice)."""
        same = c.text == self.text and c.token_ids == self.token_ids
        return [
            c.index,
            None if same else c.text,
            None if same else c.token_ids,
            c.finish_reason,
            None if c.logprobs is None else [t.to_wire() for t in c.logprobs],
        ]

    @classmethod
    def from_wire(cls, d: Any) -> Result:
        """Inverse of `to_wire` (results written before a field existed decode with its
        default). A value of another shape (a map written over in Redis, a field of another
        type) is a WireError saying which: never a result that reads as a success."""
        if not isinstance(d, Mapping):
            raise WireError(f"a recorded result is a {type(d).__name__}, not a map")
        for key, types in _FIELD_TYPES.items():
            v = d.get(key)
            if v is not None and (not isinstance(v, types) or isinstance(v, bool)):
                raise WireError(f"a recorded result's field {key!r} is a {type(v).__name__}")
        if not isinstance(d.get("id"), str) or not isinstance(d.get("i"), int):
            raise WireError("a recorded result has no id or index")
        try:
            return cls._from_checked(d)
        except (TypeError, ValueError, IndexError, KeyError, AttributeError) as e:
            raise WireError(f"a recorded result is malformed: {type(e).__name__}: {e}") from None

    @classmethod
    def _from_checked(cls, d: Mapping[str, Any]) -> Result:
        t = d.get("t") or [0.0, 0.0, 0.0, 0.0]
        res = cls(
            id=d["id"],
            index=d["i"],
            text=d.get("x", ""),
            finish_reason=d.get("f"),
            error=d.get("e"),
            shard=d.get("k", 0),
            prompt_tokens=d.get("pt", 0),
            cached_tokens=d.get("ct", 0),
            output_tokens=d.get("ot", 0),
            predicted_cached_tokens=d.get("pc", 0),
            token_ids=[_int(x) for x in d.get("ti") or ()],
            timings=Timings(*(float(x) for x in t)),
            worker=d.get("w", ""),
            error_code=d.get("ec"),
            endpoint=d.get("u"),
            model=d.get("md"),
            echo=d.get("eo") if isinstance(d.get("eo"), dict) else None,
            encoding_format=d.get("ef"),
        )
        if d.get("em") is not None:
            res.embeddings = [bytes(v) for v in d["em"]]
        for c in d.get("ch") or ():
            res.choices.append(
                Choice(
                    index=_int(c[0]),
                    text=res.text if c[1] is None else str(c[1]),
                    token_ids=[_int(x) for x in (res.token_ids if c[2] is None else c[2])],
                    finish_reason=c[3],
                    logprobs=None if c[4] is None else [TokenLogprob.from_wire(x) for x in c[4]],
                )
            )
        return res

    def to_json(self, *, token_ids: bool = False) -> dict[str, Any]:
        """The documented output record (one JSONL line); ``id`` is null for a request whose id
        its burst has no record of (docs/delivery.md, "Cancel and deadlines")."""
        t = self.timings
        out: dict[str, Any] = {
            "id": self.id or None,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "error_code": self.error_code,
            "shard": self.shard,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            "timings": {
                "enqueued": t.enqueued,
                "admitted": t.admitted,
                "first_token": t.first_token,
                "finished": t.finished,
            },
        }
        if self.choices:
            out["choices"] = [c.to_json(token_ids=token_ids) for c in self.choices]
        if self.embeddings is not None:
            out["embeddings"] = [unpack_vector(v) for v in self.embeddings]
        if token_ids:
            out["token_ids"] = self.token_ids
        return out
