"""The chaos soak, short form (scripts/soak.py; docs/testing.md, "The soak"): a few thousand
requests over three shards of fake-engine worker processes and a redis-server with its AOF,
under at least 20 faults of every kind that landed; nothing lost, duplicated or phantom, read
back through the public API. And its self-check: results damaged before the accounting must
make the run fail.

The seed is new every run (``PREFIXQ_SOAK_SEED`` fixes it) and printed: a failure names it, and
``python scripts/soak.py --seed N`` runs that schedule again. The run's counts go to the fault
ledger (tests/ledger.py).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ledger import LEDGER

pytestmark = [pytest.mark.soak, pytest.mark.slow]

SOAK = Path(__file__).resolve().parent.parent / "scripts" / "soak.py"


def soak(tmp_path: Path, *args: str, timeout: float = 420) -> tuple[int, dict[str, Any], str]:
    """Run scripts/soak.py with ``args`` (its logs and inputs kept under ``tmp_path``); its exit
    code, its JSON summary and its output."""
    out = tmp_path / "soak.json"
    p = subprocess.run(
        [sys.executable, str(SOAK), *args, "--json", str(out), "--keep", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    text = p.stdout + p.stderr
    print(text[-6000:])
    assert out.exists(), f"the soak wrote no summary (exit {p.returncode}):\n{text[-4000:]}"
    return p.returncode, json.loads(out.read_text()), text


def record(out: dict[str, Any], what: str) -> None:
    """Add a soak's faults and requests to the suite's ledger (``what``: which soak)."""
    for kind, n in sorted(out["faults_by_kind"].items()):
        LEDGER.fault(f"{what}: {kind}", n)
    LEDGER.requests += out["requests"]
    LEDGER.lost += out["lost"]
    LEDGER.duplicated += out["duplicated"]


def assert_clean(rc: int, out: dict[str, Any], text: str, again: str) -> None:
    """Nothing lost, doubled, invented, misanswered or misreported; no traceback, no problem; a
    passing exit (``again``: the command that reruns it)."""
    defects = {k: out[k] for k in ("lost", "duplicated", "phantom", "misanswered", "misreported")}
    assert defects == dict.fromkeys(defects, 0), f"{defects}: {out['examples'][:10]} ({again})"
    assert not out["tracebacks"] and not out["problems"], (out["problems"], again)
    assert rc == 0, text[-3000:]


def test_the_short_soak_loses_duplicates_and_invents_no_result(tmp_path: Path) -> None:
    """Given 3,000 requests in bursts of every kind over 3 shards and at least 20 faults that
    landed (worker kill -9 and SIGTERM, duplicate workers, redis-server kill -9, maxmemory with
    kills inside, reclaim, cancel, garbage and forged entries, killed producers, stops during
    start-up; a worker lost for good, one that joins, one that drains and leaves), every request
    has exactly one result under its own id, with its own answer."""
    seed = os.environ.get("PREFIXQ_SOAK_SEED") or str(secrets.randbelow(10**6))
    rc, out, text = soak(tmp_path, "--requests", "3000", "--faults", "20", "--seed", seed)
    record(out, f"soak seed {seed}")
    again = f"rerun: python scripts/soak.py --seed {seed}"
    assert out["faults"] >= 20, f"only {out['faults']} faults landed ({again})"
    assert_clean(rc, out, text, again)


def test_the_soak_fails_when_results_are_damaged_before_its_accounting(tmp_path: Path) -> None:
    """Given a short soak with --self-check, which deletes a result, writes one result over
    another, gives one a made-up id, changes one's answer and counts one twice in its record,
    the run reports each (lost, duplicated, phantom, misanswered) and exits 1."""
    rc, out, text = soak(
        tmp_path,
        "--self-check",
        "--requests",
        "400",
        "--faults",
        "2",
        "--only",
        "garbage,duplicate_worker",
        "--duration",
        "15",
        "--seed",
        "21",
    )
    assert out["self_check"], "nothing was damaged"
    assert out["lost"] >= 2 and out["duplicated"] >= 2, out
    assert out["phantom"] >= 1 and out["misanswered"] >= 1, out
    assert rc == 1 and "FAIL" in out["line"], text[-3000:]


def test_the_soak_on_a_redis_cluster_rides_through_master_failovers(tmp_path: Path) -> None:
    """Given a short soak on a 6-node Redis Cluster (`--cluster`: min_replicas_acked=1 for every
    process), with master failovers among its faults (a shard's master killed -9, its replica
    promoted, the node restarted as a replica), every request has exactly one result under its
    own id, and the summary line counts the failovers injected. The fleet's faults (a worker lost
    for good, one that joins, one that drains) are drawn there too: a move crosses slots."""
    seed = os.environ.get("PREFIXQ_SOAK_SEED") or str(secrets.randbelow(10**6))
    rc, out, text = soak(
        tmp_path,
        "--cluster",
        "--shards",
        "4",
        "--requests",
        "500",
        "--faults",
        "4",
        "--duration",
        "30",
        "--seed",
        seed,
        timeout=300,
    )
    record(out, f"cluster soak seed {seed}")
    again = f"rerun: python scripts/soak.py --cluster --shards 4 --seed {seed}"
    assert out["failovers"] >= 1, f"no master failover landed ({again})"
    assert f"failovers injected: {out['failovers']}" in out["line"]
    assert_clean(rc, out, text, again)
