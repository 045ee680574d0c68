"""The docs match the code: the configuration table, the commands, the links, the public API."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import prefixq

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_readme_configuration_table_is_generated_from_settings() -> None:
    """The README's table is exactly what scripts/settings_table.py prints from Settings."""
    table = subprocess.run(
        [sys.executable, str(ROOT / "scripts/settings_table.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert table in README


def test_readme_names_the_two_commands_and_ci_runs_the_test_one() -> None:
    """`./dev demo` and `./dev test` are in the README; .ci/run calls `./dev test`."""
    assert "./dev demo" in README and "./dev test" in README
    assert re.search(r"^\./dev test$", (ROOT / ".ci/run").read_text(), re.M)


def test_every_linked_doc_exists() -> None:
    """Every relative link in README and docs/ points at a file that exists."""
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(((?!https?:)[^)#]+)\)", md.read_text()):
            assert (md.parent / target).exists(), f"{md.name} links to missing {target}"


def test_public_api_is_what_all_says() -> None:
    """`prefixq.__all__` names exactly the public, importable API."""
    exported = {n for n in dir(prefixq) if n[0].isupper()}
    assert set(prefixq.__all__) == exported | {"__version__"}
    assert {"Producer", "Settings", "Request", "Result", "PrefixqError"} <= exported
    for name in prefixq.__all__:
        assert hasattr(prefixq, name), name


def test_every_dotted_prefixq_name_in_the_docs_exists() -> None:
    """`prefixq.module.name` in README, docs/ and examples/README.md names something importable
    (examples/README.md named `prefixq.rq_jobs.callback_job_id`, which lives in callbacks)."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "examples/README.md"]
    missing = []
    for doc in docs:
        for name in set(re.findall(r"`(prefixq(?:\.[A-Za-z_]\w*)+)", doc.read_text())):
            parts = name.split(".")
            for i in range(len(parts), 0, -1):
                try:
                    obj: object = importlib.import_module(".".join(parts[:i]))
                except ImportError:
                    continue
                break
            for attr in parts[i:]:
                if not hasattr(obj, attr):
                    missing.append(f"{doc.name}: {name}")
                    break
                obj = getattr(obj, attr)
    assert not missing, missing


def test_dev_help_is_exit_0_and_an_unknown_command_says_so_exit_2() -> None:
    """`./dev --help` printed the help and exited 1; `./dev bogus` printed it with no word of
    what was wrong, exit 1. Help is 0 now, and an unknown command a usage error (2) naming it."""
    for arg in ("help", "-h", "--help"):
        p = subprocess.run(["bash", "dev", arg], cwd=ROOT, capture_output=True, text=True)
        assert p.returncode == 0 and "./dev test" in p.stdout, (arg, p.stderr)
    p = subprocess.run(["bash", "dev", "bogus"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2 and "dev: unknown command 'bogus'" in p.stderr
