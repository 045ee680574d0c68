"""A stop while the demo starts (prefixq.cli.demo; docs/delivery.md, "SIGTERM and SIGINT"): the
demo started as a background job of a non-interactive shell (``./dev demo &``: SIGINT ignored)
still stops on SIGINT, wherever its start is — its imports, its private redis-server, its worker —
and leaves nothing running. (Split from test_faults_startup.py, the worker's own start.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _ignores_sigint(pid: int) -> bool:
    """Whether process ``pid`` ignores SIGINT (its SigIgn mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    raise AssertionError(f"no SigIgn line for {pid}")


def test_the_demo_started_with_sigint_ignored_stops_on_sigint_and_so_does_its_worker(
    tmp_path: Path,
) -> None:
    """Given the demo in a background job of a non-interactive shell (``./dev demo &``: SIGINT
    ignored), its worker (here a stand-in that unblocks the stop signals, as `prefixq worker`
    does) starts with SIGINT's default action, and SIGINT stops the demo, which stops its
    worker (it ignored SIGINT, and so did its worker, until SIGKILL)."""
    demo = tmp_path / "demo.py"
    demo.write_text(
        textwrap.dedent(f"""
        import signal, sys, time
        from prefixq.cli import demo
        print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN, flush=True)
        worker = "import signal, time; signal.pthread_sigmask(signal.SIG_UNBLOCK, {{2, 15}}); " \
            "time.sleep(120)"
        with demo._interrupts(), open({str(tmp_path / "worker.log")!r}, "wb") as out:
            proc = demo._start_worker([sys.executable, "-c", worker], out)
            try:
                print(proc.pid, flush=True)
                time.sleep(120)
            finally:
                demo._stop(proc)
                print("stopped", proc.returncode, flush=True)
        """)
    )
    shell = subprocess.Popen(
        ["bash", "-c", f"{sys.executable} {demo} & echo $!; wait $!"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert shell.stdout is not None
    try:
        parent = int(shell.stdout.readline())
        assert shell.stdout.readline().strip() == "True", "a background job ignores SIGINT"
        child = int(shell.stdout.readline())
        time.sleep(0.3)  # the stand-in's interpreter up
        ignored = _ignores_sigint(child)
        os.kill(parent, signal.SIGINT)
        rest, _ = shell.communicate(timeout=30)
    finally:
        for pid in (locals().get("child"), locals().get("parent")):
            if pid and Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)
        if shell.poll() is None:
            shell.kill()
            shell.wait()
    print(f"  demo's worker ignored SIGINT: {ignored}; after SIGINT: {rest.strip()!r}")
    assert not ignored, "the demo's worker inherited an ignored SIGINT"
    assert "stopped -15" in rest, "SIGINT stopped the demo, and the demo stopped its worker"
    assert shell.returncode != 0  # the demo ended by its KeyboardInterrupt


def test_a_sigint_while_the_demo_starts_its_redis_server_stops_it_and_leaves_no_server(
    tmp_path: Path,
) -> None:
    """Given the demo started with SIGINT ignored and no Redis at its URL, when SIGINT comes
    while it starts its private redis-server, the demo ends by its KeyboardInterrupt and no
    redis-server is left (before: the demo's handlers came after that start, so the SIGINT was
    ignored and the demo went on)."""
    script = tmp_path / "demo_start.py"
    script.write_text(
        textwrap.dedent("""
        import os, signal, sys
        from prefixq.cli import demo
        from prefixq.cli.redis_server import RedisServer, free_port
        from prefixq.core.settings import Settings
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job's
        real = RedisServer.start
        def start(self, timeout=10.0):
            print("server", self.dir, flush=True)
            real(self, timeout)
            print("pid", self.proc.pid, flush=True)
            os.kill(os.getpid(), signal.SIGINT)  # the stop lands in the start
            import time; time.sleep(0.5)
            return self
        RedisServer.start = start
        def not_reached(*a, **kw):
            print("went on", flush=True)
            raise SystemExit(3)
        demo.resolve_model = not_reached
        import prefixq.engine.embedded_model as em
        em.resolve_model = not_reached
        url = f"redis://127.0.0.1:{free_port()}/0"
        try:
            demo.run_demo(Settings(redis_url=url))
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            sys.exit(130)
        """)
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    out = done.stdout
    pid = int(out.split("pid ", 1)[1].split()[0]) if "pid " in out else 0
    folder = out.split("server ", 1)[1].split()[0] if "server " in out else ""
    alive = bool(pid) and Path(f"/proc/{pid}").exists()
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert "interrupted" in out and "went on" not in out, (done.returncode, out, done.stderr)
    assert pid and not alive, "the demo's redis-server was left running"
    assert folder and not Path(folder).exists(), "its folder was left"


def test_a_sigint_while_the_demo_imports_stops_it_though_sigint_was_ignored(
    tmp_path: Path,
) -> None:
    """Given the demo started with SIGINT ignored (a background job of a non-interactive shell),
    when SIGINT comes while it still imports its command (~0.8 s, before its own handlers), it
    exits 0 at once: it has started nothing (before: the SIGINT was ignored and the demo went on
    to start Redis and its vLLM worker)."""
    script = tmp_path / "demo_import.py"
    script.write_text(
        textwrap.dedent("""
        import os, signal, sys, time
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job's
        class Slow:  # the stop lands while the command's module imports
            def find_spec(self, name, path, target=None):
                if name == "prefixq.cli.main":
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(1.0)
                    print("went on", flush=True)
                    os._exit(3)
                return None
        sys.meta_path.insert(0, Slow())
        from prefixq.cli import main
        sys.exit(main(["demo"]))
        """)
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "went on" not in done.stdout, (done.returncode, done.stderr)
