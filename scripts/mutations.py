"""Break each central guarantee of prefixq, one at a time, and show that a fast test catches it.

For every mutation: copy src/prefixq to a temporary directory, apply ONE textual replacement in a
named file of the copy (the script stops if the target text is not found exactly once, so a
mutation can never silently test nothing), run the fast tests of its guarantee against the copy
(its ``tests``; the other fast tests too only if none of those fails) (``PYTHONPATH`` points at
it first, ahead of the editable install; checked before any test runs) and record which tests
failed. The unmutated copy is run first, with every fast test: they must all pass.

    python scripts/mutations.py                 # every mutation; exit 1 if one is not caught
    python scripts/mutations.py --list          # the mutations, without running anything
    python scripts/mutations.py --check         # every target text still there? (no tests)
    python scripts/mutations.py --only zlib-inflate-whole --only lease-not-renewed
    python scripts/mutations.py --tests tests/test_delivery.py
    python scripts/mutations.py --jobs 1        # one mutant at a time (default 3 side by side)

Tests start their own redis-server (tests/conftest.py); the whole run takes a few minutes.
docs/testing.md holds the table this prints.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "prefixq"

#: the fast tests every mutation is run against
FAST_TESTS = (
    "tests/test_wire.py",
    "tests/test_delivery.py",
    "tests/test_worker_loop.py",
    "tests/test_affinity.py::test_two_producers_racing_on_the_same_documents_agree_on_one_shard_each",
)


@dataclass(frozen=True)
class Mutation:
    """Replace ``old`` (found exactly once) by ``new`` in ``path`` (relative to the package).
    ``tests``: the fast tests of its guarantee, run first; only if none of them fails are the
    other `FAST_TESTS` run too, so a mutation is never reported uncaught that another catches."""

    name: str
    guarantee: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS = (
    Mutation(
        "ack-before-record",
        "record-then-ack",
        "worker/writer.py",
        "                replies = await self.stream.record(todo)\n",
        "                await self.stream.ack(todo)\n"
        "                replies = await self.stream.record(todo)\n",
        ("tests/test_delivery.py",),
    ),
    Mutation(
        "ack-refused-records",
        "record-then-ack",
        "worker/writer.py",
        "            await self._ack([w for w, _ in done])\n",
        "            await self._ack(todo)\n",
        ("tests/test_delivery.py",),
    ),
    Mutation(
        "record-overwrites",
        "exactly-once recording (HSETNX)",
        "store/lua/record_result.lua",
        "  elseif redis.call('HSETNX', KEYS[1], index, ARGV[a + 2]) == 0 then",
        "  elseif redis.call('HSET', KEYS[1], index, ARGV[a + 2]) == 0 then",
        ("tests/test_worker_loop.py",),
    ),
    Mutation(
        "record-counts-redeliveries",
        "exactly-once recording (HSETNX)",
        "store/lua/record_result.lua",
        "  elseif redis.call('HSETNX', KEYS[1], index, ARGV[a + 2]) == 0 then",
        "  elseif redis.call('HSET', KEYS[1], index, ARGV[a + 2]) and false then",
        ("tests/test_worker_loop.py",),
    ),
    Mutation(
        "zlib-inflate-whole",
        "decode bounds (zlib)",
        "core/wire.py",
        "    out: bytes = d.decompress(payload, cap + 1)\n",
        "    out: bytes = d.decompress(payload)\n",
        ("tests/test_wire.py",),
    ),
    Mutation(
        "zstd-read-whole",
        "decode bounds (zstd, size not declared)",
        "core/wire.py",
        "    while chunk := reader.read(min(cap + 1 - total, 1 << 20)):\n",
        "    while chunk := reader.read():\n",
        ("tests/test_wire.py",),
    ),
    Mutation(
        "zstd-trust-declared",
        "decode bounds (zstd, size declared)",
        "core/wire.py",
        '    if declared > cap:\n        raise LimitExceeded(f"zstd entry declares',
        '    if False:\n        raise LimitExceeded(f"zstd entry declares',
        ("tests/test_wire.py",),
    ),
    Mutation(
        "lease-not-renewed",
        "lease renewal (heartbeat re-claims held entries)",
        "worker/heartbeat.py",
        "        await self.stream.renew(self.holding())\n",
        "        await self.stream.renew([])\n",
        ("tests/test_delivery.py",),
    ),
    Mutation(
        "reclaimer-ignores-deliveries",
        "dead-lettering by delivery count (reclaimer)",
        "worker/reclaim.py",
        "            if p.deliveries >= self.max_attempts:\n"
        "                await self._dead(p)\n"
        "            elif",
        "            if False:\n                await self._dead(p)\n            elif",
        ("tests/test_delivery.py",),
    ),
    Mutation(
        "reclaimer-off-by-one",
        "dead-lettering by delivery count (reclaimer)",
        "worker/reclaim.py",
        "            if p.deliveries >= self.max_attempts:\n"
        "                await self._dead(p)\n"
        "            elif",
        "            if p.deliveries > self.max_attempts:\n"
        "                await self._dead(p)\n"
        "            elif",
        ("tests/test_delivery.py",),
    ),
    Mutation(
        "restart-ignores-deliveries",
        "dead-lettering by delivery count (restart)",
        "worker/reclaim.py",
        "        for p in rows:\n"
        "            if p.deliveries >= self.max_attempts:\n"
        "                await self._dead(p)\n\n",
        "        for p in rows:\n            if False:\n                await self._dead(p)\n\n",
        ("tests/test_delivery.py",),
    ),
    Mutation(
        "claim-last-writer-wins",
        "atomic prefix claims (Lua HSETNX)",
        "store/lua/claim_prefixes.lua",
        "    if mode == 'm' or not had then",
        "    if true then",
        (FAST_TESTS[3],),
    ),
    Mutation(
        "claim-loser-keeps-its-shard",
        "atomic prefix claims (the loser follows the winner)",
        "affinity/prefix_map.py",
        "        lost = {cp: v for cp, v in stored.items()"
        ' if modes.get(cp) == "n" and v != local[cp]}\n',
        "        lost: dict[bytes, int] = {}\n",
        (FAST_TESTS[3],),
    ),
    Mutation(
        "doorbell-admitted-on-sight",
        "enqueue order across chunks (an intake entry waits for the lane entries sent before it)",
        "worker/gates.py",
        "        if d.before > lane.lane_read and lane.remote:\n",
        "        if False:\n",
        ("tests/test_lanes.py",),
    ),
    Mutation(
        "lane-entry-ahead-of-its-doorbell",
        "enqueue order across chunks (a lane entry waits for the intake entry sent before it)",
        "worker/gates.py",
        "    elif d.before > lane.intake_read and d.mark == drained",
        "    elif False and d.mark == drained",
        ("tests/test_scheduler.py",),
    ),
)


class MutationError(Exception):
    """Raised when a mutation cannot be applied or the unmutated tests do not pass."""


def apply(mutation: Mutation, package: Path) -> None:
    """Apply ``mutation`` to the package copy at ``package``; refuse if its target text is not
    there exactly once."""
    path = package / mutation.path
    if not path.is_file():
        raise MutationError(f"{mutation.name}: {mutation.path} does not exist")
    text = path.read_text()
    found = text.count(mutation.old)
    if found != 1:
        raise MutationError(
            f"{mutation.name}: target text found {found} times in {mutation.path} "
            f"(expected exactly once):\n{mutation.old}"
        )
    path.write_text(text.replace(mutation.old, mutation.new))


def copy_package(into: Path) -> Path:
    """A copy of src/prefixq under ``into`` (``into`` goes on PYTHONPATH); returns the copy."""
    target = into / "prefixq"
    shutil.copytree(PACKAGE, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def environment(root: Path) -> dict[str, str]:
    """The environment that makes ``import prefixq`` find the copy under ``root`` first."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_imported_from(root: Path, env: dict[str, str]) -> None:
    """Refuse to run unless ``import prefixq`` resolves to the copy (not the editable install)."""
    got = subprocess.run(
        [sys.executable, "-c", "import prefixq; print(prefixq.__file__)"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(got).resolve().is_relative_to(root.resolve()):
        raise MutationError(f"prefixq is imported from {got}, not from the copy in {root}")


def run_tests(root: Path, tests: list[str], report: Path, timeout: float) -> list[str]:
    """Run ``tests`` against the copy under ``root``; the node ids that failed or errored."""
    env = environment(root)
    check_imported_from(root, env)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "not slow and not engine",
        f"--junit-xml={report}",
        "-o",
        "junit_family=xunit2",
        *tests,
    ]
    try:
        subprocess.run(
            cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return [f"(the tests ran past {timeout:.0f}s)"]
    if not report.is_file():
        return ["(pytest wrote no report)"]
    failed = []
    for case in ET.parse(report).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname', '')}::{case.get('name', '')}")
    return [_node_id(x) for x in failed]


def _node_id(junit_name: str) -> str:
    """``tests.test_wire::test_x[zlib]`` -> ``test_wire.py::test_x[zlib]``."""
    module, _, test = junit_name.partition("::")
    return f"{module.rsplit('.', 1)[-1]}.py::{test}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--list", action="store_true", help="print the mutations and exit")
    p.add_argument(
        "--check", action="store_true", help="apply each mutation to a copy, run no tests"
    )
    p.add_argument("--only", action="append", default=[], metavar="NAME", help="repeatable")
    p.add_argument("--tests", action="append", default=[], metavar="PATH", help="repeatable")
    p.add_argument("--timeout", type=float, default=600, help="seconds per test run")
    p.add_argument(
        "--jobs", type=int, default=3, help="mutants tested at once, each its own pytest (3)"
    )
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error("--jobs: at least 1")
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    unknown = set(args.only) - {m.name for m in MUTATIONS}
    if unknown:
        p.error(f"unknown mutations: {', '.join(sorted(unknown))}")
    if args.list:
        for m in chosen:
            print(f"{m.name:30} {m.guarantee:50} {m.path}")
        return 0
    tests = list(args.tests or FAST_TESTS)
    with tempfile.TemporaryDirectory(prefix="prefixq-mutants-") as tmp:
        base = Path(tmp) / "baseline"
        for m in chosen:  # every target text is checked before anything runs
            probe = Path(tmp) / f"probe-{m.name}"
            apply(m, copy_package(probe))
        if args.check:
            print(f"all {len(chosen)} mutations apply")
            return 0
        copy_package(base)
        t0 = time.monotonic()
        broken = run_tests(base, tests, Path(tmp) / "baseline.xml", args.timeout)
        if broken:
            raise MutationError("the unmutated tests fail: " + ", ".join(broken))
        print(f"baseline: every test passes ({time.monotonic() - t0:.0f}s)", flush=True)

        def one(m: Mutation) -> tuple[Mutation, list[str], float]:
            root = Path(tmp) / m.name
            apply(m, copy_package(root))
            t0 = time.monotonic()
            first = list(args.tests or m.tests)
            failed = run_tests(root, first, Path(tmp) / f"{m.name}.xml", args.timeout)
            rest = [t for t in tests if t not in first]
            if not failed and rest:  # missed by its own tests: are the others any better?
                failed = run_tests(root, rest, Path(tmp) / f"{m.name}-rest.xml", args.timeout)
            took = time.monotonic() - t0
            print(f"{m.name}: {', '.join(failed) or 'NOT CAUGHT'} ({took:.0f}s)", flush=True)
            return m, failed, took

        # the tests mostly wait (leases, claims, a redis-server each), so mutants run side by side
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            rows = list(pool.map(one, chosen))  # the table in the mutations' order
    print()
    print("| mutation | guarantee | caught by (tests that failed) |")
    print("|---|---|---|")
    for m, failed, _ in rows:
        caught = "<br>".join(f"`{x}`" for x in failed) if failed else "**NOT CAUGHT**"
        print(f"| `{m.name}` ({m.path}) | {m.guarantee} | {caught} |")
    missed = [m.name for m, failed, _ in rows if not failed]
    if missed:
        print(f"\nNOT CAUGHT: {', '.join(missed)}")
        return 1
    print(f"\nall {len(rows)} mutations caught")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except MutationError as e:
        print(f"mutations: error: {e}", file=sys.stderr)
        sys.exit(2)
