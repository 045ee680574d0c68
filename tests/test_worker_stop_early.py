"""`prefixq worker --shard K` stopped while it imports (after it recorded the hold on its shard,
cli/fleet_commands.py `holding`): the stop leaves at once (`start_stop.leave_now`, as raising
inside an import can abort the process), and releases the hold first. It used to stay for
``join_hold_s``, and a ``--join`` worker started meanwhile grew the deployment by one shard,
leaving shard K with no worker."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import redis

from helpers import script_process, settings_flags, wait_until
from prefixq.core.settings import Settings

#: the real `prefixq worker` (prefixq.cli.main), whose first import after the hold
#: (prefixq.engine.embedded_model, as vLLM's would) takes a minute
SLOW_IMPORT = """
import importlib.abc, importlib.machinery, sys, time
from prefixq.cli import main

SLOW = "prefixq.engine.embedded_model"

class Slow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != SLOW:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        real = spec.loader.exec_module

        def exec_module(module):
            print("importing slowly", flush=True)
            time.sleep(60)
            real(module)

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, Slow())
sys.exit(main(["worker", *sys.argv[1:]]))
"""


def test_a_worker_stopped_inside_an_import_releases_its_shards_hold(
    settings: Settings, r: redis.Redis, tmp_path: Path
) -> None:
    """SIGTERM while the worker imports, its shard held: exit 0 within seconds, the hold gone."""
    s = settings.replace(join_hold_s=600.0)  # would outlive the test if left behind
    script = tmp_path / "slow_worker.py"
    script.write_text(SLOW_IMPORT)
    log = tmp_path / "worker.log"
    proc = script_process(script, log, "--shard", "0", *settings_flags(s))
    try:
        wait_until(lambda: "importing slowly" in log.read_text(), 60, "the slow import")
        assert r.hkeys(s.keys.joins) == [b"0"], log.read_text()
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert time.monotonic() - t0 < 2 * 2.0 + 1.0, text[-3000:]
    assert r.hgetall(s.keys.joins) == {}, text[-3000:]
    assert "SIGTERM during start-up: exiting (serving nothing yet)" in text, text[-3000:]
    assert "released the hold on shard 0" in text, text[-3000:]
