"""The mutation check (scripts/mutations.py) as a test: every central guarantee, broken in a copy
of the package, is caught by at least one fast test (docs/testing.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.mark.timeout(3600)
def test_every_mutation_of_a_central_guarantee_is_caught_by_a_fast_test() -> None:
    """scripts/mutations.py applies each mutation to a copy of src/prefixq and runs the fast
    tests against it: it exits 0 only when the unmutated tests pass and every mutation makes at
    least one of them fail."""
    p = subprocess.run(
        [sys.executable, str(ROOT / "scripts/mutations.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3500,
        check=False,
    )
    print(p.stdout)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "NOT CAUGHT" not in p.stdout
    assert "mutations caught" in p.stdout
