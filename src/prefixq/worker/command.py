"""The command line of a `prefixq worker` process, for whoever starts one (the supervisor, the
demo, the benchmark, the tests)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from prefixq.core.settings import Settings


def worker_command(
    settings: Settings,
    shard: int,
    model: str = "",
    *,
    name: str = "",
    gpu: str | None = None,
    engine_args: Sequence[str] = (),
    fields: Sequence[str] = ("redis_url", "namespace", "shards"),
) -> list[str]:
    """argv for a ``prefixq worker`` process of this interpreter, passing ``fields`` of
    ``settings`` as flags (the rest comes from the environment)."""
    cmd = [sys.executable, "-m", "prefixq", "worker", "--shard", str(shard)]
    if model:
        cmd += ["--model", model]
    if name:
        cmd += ["--name", name]
    if gpu is not None:
        cmd += ["--gpu", gpu]
    for f in fields:
        flag, value = f.replace("_", "-"), getattr(settings, f)
        if isinstance(value, bool):  # the CLI's --flag / --no-flag
            cmd.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            cmd += ["--" + flag, str(value)]
    for a in engine_args:
        cmd += ["--engine-arg", a]
    return cmd
