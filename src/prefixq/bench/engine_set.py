"""A standalone set-up's engines, whichever way they run: `Engines`, the base of
`bench.engines.Standalone` (every engine in this process) and `bench.standalone.ProcessStandalone`
(a process each), whose one `run` hands a burst over and checks what came back; each kind says
only how its engines take the requests (`Engines._hand_over`). Also `engine_request`: the prompt
exactly as a worker builds it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from prefixq.bench.timeline import Stamp
from prefixq.core.errors import SetupError
from prefixq.core.records import Request
from prefixq.engine.protocol import EngineRequest


def engine_request(req: Request, rid: str) -> EngineRequest:
    """The prompt exactly as a worker builds it (prefix + prompt, or prefix ids + ids)."""
    if req.prompt_token_ids is not None:
        ids = (req.prefix if isinstance(req.prefix, list) else []) + req.prompt_token_ids
        return EngineRequest(request_id=rid, prompt_token_ids=ids, sampling=req.sampling)
    text = (req.prefix if isinstance(req.prefix, str) else "") + (req.prompt or "")
    return EngineRequest(request_id=rid, prompt=text, sampling=req.sampling)


@dataclass(frozen=True, slots=True)
class Handed:
    """One request as the set-up hands it over: its index in the burst, its shard (the engine
    that takes it), its arrival (seconds after the start; 0: at once) and what the engine gets."""

    index: int
    shard: int
    at: float
    request: EngineRequest


@dataclass(frozen=True, slots=True)
class Answered:
    """What an engine did with one request: its index in the burst, when (`Stamp`), and how
    many tokens it returned."""

    index: int
    stamp: Stamp
    tokens: int


class Engines(ABC):
    """One set-up's engines."""

    _runs = 0

    @property
    @abstractmethod
    def kv_tokens(self) -> list[int]:
        """Each engine's KV cache in tokens, as vLLM sized it."""

    @abstractmethod
    async def start(self) -> None:
        """Start the engines one after another (engines sharing a GPU profile its memory)."""

    async def run(
        self,
        requests: list[Request],
        shards: list[int],
        at: list[float] | None = None,
        order: list[int] | None = None,
    ) -> tuple[float, float, list[Stamp]]:
        """Hand every request to its shard's engine, at once or at its arrival (``at``: seconds
        after the start), in ``order`` (default: as given); (start, end, per-request stamps in the
        requests' order)."""
        self._runs += 1
        idx = order if order is not None else range(len(requests))
        handed = [
            Handed(
                i,
                shards[i],
                at[i] if at else 0.0,
                engine_request(requests[i], f"sa{self._runs}-{i}"),
            )
            for i in idx
        ]
        t0, t1, got = await self._hand_over(handed)
        short = sum(1 for a in got if a.tokens != requests[a.index].sampling.get("max_tokens"))
        if short:
            raise SetupError(f"standalone: {short} requests returned fewer tokens than asked")
        return t0, t1, [a.stamp for a in sorted(got, key=lambda a: a.index)]

    @abstractmethod
    async def _hand_over(self, handed: list[Handed]) -> tuple[float, float, list[Answered]]:
        """Give each of ``handed`` to its engine, in that order, each at its arrival; (start,
        end, what the engines answered)."""

    @abstractmethod
    async def reset_prefix_cache(self) -> None:
        """Drop every engine's cached prefix blocks."""

    @abstractmethod
    async def close(self) -> None:
        """Stop the engines."""
