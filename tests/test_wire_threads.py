"""The wire codecs used from several threads at once (core/wire.py): a threaded service submits
and reads results on threads of its own, and `Producer.submit` moves a submit onto a thread when
called inside an event loop. zstd's (de)compressors release the GIL, so one shared by two
threads corrupted frames or crashed the process; each thread now has its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
import redis

from helpers import queued_entries
from prefixq.client import Producer
from prefixq.core import wire
from prefixq.core.entries import Entry
from prefixq.core.settings import Settings

WORDS = " ".join(f"w{i}" for i in range(2000))


@pytest.mark.parametrize("codec", ["zstd", "zlib"])
def test_six_threads_packing_compressing_and_decoding_at_once_round_trip(codec: str) -> None:
    """In a child process (a crash is an exit status there, not a dead test run), 6 threads each
    pack, compress and decode 300 entries of a few KB at once: every one comes back equal."""
    code = textwrap.dedent(
        f"""
        import threading
        from prefixq.core import wire
        bad = []
        def work(k):
            for i in range(300):
                obj = {{"k": k, "i": i, "p": "{WORDS[:6000]}" + str(i) * (i % 50)}}
                try:
                    got = wire.decode(wire.compress(wire.pack(obj), "{codec}"))
                except Exception as e:
                    bad.append(repr(e)); continue
                if got != obj:
                    bad.append("differs")
        ts = [threading.Thread(target=work, args=(k,)) for k in range(6)]
        [t.start() for t in ts]; [t.join() for t in ts]
        print(len(bad), sorted(set(bad))[:2])
        """
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    assert p.stdout.startswith("0 "), p.stdout


def test_submits_from_threads_with_zstd_write_entries_that_decode(
    settings: Settings, r: redis.Redis
) -> None:
    """Given codec zstd, 4 threads submitting bursts of 32 few-KB requests at once all succeed,
    and every entry they wrote decodes (a shared compressor failed submits with 'Src size is
    incorrect' and cancelled their bursts)."""
    s = settings.replace(codec="zstd", shards=1)
    errors: list[str] = []

    def submit(k: int) -> None:
        try:
            for _ in range(3):
                reqs = [{"id": f"q{i}", "prompt": f"{k} {i} {WORDS}"} for i in range(32)]
                Producer(s).submit(reqs)
        except Exception as e:
            errors.append(repr(e))

    ts = [threading.Thread(target=submit, args=(k,)) for k in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert errors == []
    entries = [f[b"d"] for _, f in queued_entries(r, s) if b"d" in f]
    assert len(entries) == 4 * 3 * 32
    got = sorted(Entry.from_wire(wire.decode(d)).id for d in entries)
    assert got == sorted(f"q{i}" for _ in range(4 * 3) for i in range(32))
