"""The mutation check (scripts/mutations.py) as tests: every central guarantee, broken in a copy
of the package, is caught by at least one fast test (docs/testing.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "scripts/mutations.py")


def mutations(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, SCRIPT, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_every_mutation_still_finds_its_target_text() -> None:
    """Each mutation's target text is in the package exactly once (a refactor that moves it
    fails here, at once, rather than in the slow run)."""
    p = mutations("--check", timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "mutations apply" in p.stdout


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_every_mutation_of_a_central_guarantee_is_caught_by_a_fast_test() -> None:
    """scripts/mutations.py applies each mutation to a copy of src/prefixq and runs the fast
    tests against it: it exits 0 only when the unmutated tests pass and every mutation makes at
    least one of them fail."""
    p = mutations(timeout=3500)
    print(p.stdout)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "NOT CAUGHT" not in p.stdout
    assert "mutations caught" in p.stdout
