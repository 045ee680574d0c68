"""The package's import graph: no cycle, nothing imported upwards (issue 14).

Every import of a prefixq module counts — at module level, inside functions and under
``TYPE_CHECKING`` alike — so a new cycle fails here however it hides.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

#: the bottom layer: records, bytes, keys, settings, errors, connections; imports none above it
BOTTOM = {
    "prefixq.core.errors",
    "prefixq.core.settings",
    "prefixq.core.keys",
    "prefixq.core.records",
    "prefixq.core.choices",
    "prefixq.core.sharing",
    "prefixq.core.checks",
    "prefixq.core.sampling",
    "prefixq.core.openai_lines",
    "prefixq.core.wire",
    "prefixq.core.entries",
    "prefixq.store.connection",
    "prefixq.cli.logs",
}
#: integrations and front ends: the worker core (consumers/, but for run.py, the process entry
#: point that registers integrations) imports none of them
INTEGRATIONS = ("prefixq.integrations.rq_jobs", "prefixq.integrations.rq_callbacks",
"prefixq.integrations.metrics", "prefixq.openai",
                "prefixq.bench", "prefixq.cli.main", "prefixq.cli.demo")  # fmt: skip


def modules() -> dict[str, Path]:
    out = {}
    for f in (SRC / "prefixq").rglob("*.py"):
        parts = list(f.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def graph() -> dict[str, set[str]]:
    """module -> prefixq modules it imports."""
    mods = modules()

    def resolve(name: str) -> str | None:
        while name not in mods and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in mods else None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        pkg = m if f.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(f.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                    base = f"{up}.{base}" if base else up
                names = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names
                ]
            for name in names:
                target = resolve(name) if name.startswith("prefixq") else None
                if target is not None and target != m:
                    edges[m].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycle() -> None:
    """No two prefixq modules import each other, however indirectly."""
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The check above can fail: a planted two-module cycle is found."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


@pytest.mark.parametrize("module", sorted(BOTTOM))
def test_the_bottom_layer_imports_only_the_bottom_layer(module: str) -> None:
    """Records, bytes, keys, settings, errors and connections import nothing above them."""
    assert graph()[module] <= BOTTOM, graph()[module] - BOTTOM


def test_the_worker_core_imports_no_integration() -> None:
    """consumers/ (run.py apart: it registers the integrations) imports no integration or front
    end: they plug in as middleware."""
    core = {
        m: deps
        for m, deps in graph().items()
        if m.startswith("prefixq.worker") and m != "prefixq.cli.worker_process"
    }
    bad = {m: sorted(d for d in deps if d.startswith(INTEGRATIONS)) for m, deps in core.items()}
    assert {m: d for m, d in bad.items() if d} == {}
