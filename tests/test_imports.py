"""The package's import graph: no cycle, and imports run down the layer folders; and no cycle
among the modules of scripts/ either (the soak's library below the soak's command).

Every import of a prefixq module counts — at module level, inside functions and under
``TYPE_CHECKING`` alike — so a new cycle fails here however it hides.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
#: run as scripts, with this folder on sys.path: ``soak``, ``soaklib.faults`` ...
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

#: the layer folders, bottom first, and what each may import (itself included): imports run one
#: way, down this list (docs/architecture.md, "Layers")
MAY_IMPORT: dict[str, set[str]] = {
    "core": {"core"},
    "store": {"core", "store"},
    "engine": {"core", "engine"},
    "affinity": {"core", "store", "affinity"},
    "worker": {"core", "store", "engine", "affinity", "worker"},
    "client": {"core", "store", "affinity", "client"},
    "ops": {"core", "store", "engine", "affinity", "worker", "client", "ops"},
    "openai": {"core", "store", "engine", "affinity", "worker", "client", "ops", "openai"},
    "dashboard": {
        "core", "store", "engine", "affinity", "worker", "client", "ops", "openai", "dashboard",
    },
    "bench": {"core", "store", "engine", "affinity", "worker", "client", "ops", "bench"},
    "integrations": {
        "core", "store", "engine", "affinity", "worker", "client", "ops", "openai", "dashboard",
        "bench", "integrations",
    },
    "cli": {
        "core", "store", "engine", "affinity", "worker", "client", "ops", "openai", "dashboard",
        "bench", "integrations", "cli",
    },
}  # fmt: skip
#: the top level: the public API (prefixq/__init__.py), `python -m prefixq`, and the re-export
#: that keeps the job path RQ stores in queued jobs (prefixq.rq_jobs.run_burst)
TOP_LEVEL: dict[str, set[str]] = {
    "prefixq": {"core", "client"},
    "prefixq.__main__": {"cli"},
    "prefixq.rq_jobs": {"integrations"},
}


def modules(root: Path = SRC, under: str = "prefixq") -> dict[str, Path]:
    """Dotted name -> file, for every module in ``root / under`` (named from ``root``)."""
    out = {}
    for f in (root / under).rglob("*.py"):
        parts = list(f.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def graph(mods: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """module -> the modules of ``mods`` (default: the prefixq package's) it imports."""
    mods = modules() if mods is None else mods

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
                target = resolve(name)
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


def test_the_scripts_import_graph_has_no_cycle() -> None:
    """No two modules of scripts/ import each other (scripts/soaklib/ sits below scripts/soak.py,
    as src/ is layered)."""
    mods = modules(SCRIPTS, "")
    assert {"soak", "soaklib.faults"} <= set(mods)  # the finder sees scripts/ and soaklib/
    assert cycles(graph(mods)) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The check above can fail: a planted two-module cycle is found."""
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def layer(module: str) -> str:
    """``prefixq.worker.reader`` -> ``worker``; a top-level module is its own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in MAY_IMPORT) else module


def violations(edges: dict[str, set[str]]) -> list[str]:
    """Every import that runs upwards or sideways against `MAY_IMPORT` / `TOP_LEVEL`."""
    out = []
    for m, deps in sorted(edges.items()):
        here = layer(m)
        allowed = MAY_IMPORT.get(here, TOP_LEVEL.get(m))
        if allowed is None:
            out.append(f"{m}: a module outside the layer folders")
            continue
        out += [f"{m} -> {d}" for d in sorted(deps) if layer(d) not in allowed]
    return out


def test_every_module_lives_in_a_layer_folder() -> None:
    """src/prefixq holds only the layer folders and the top-level modules named in TOP_LEVEL."""
    stray = [m for m in graph() if layer(m) not in MAY_IMPORT and m not in TOP_LEVEL]
    assert stray == []


def test_imports_run_down_the_layers() -> None:
    """No module imports a layer above its own (lazy and TYPE_CHECKING imports count): core
    imports only core, nothing outside cli/ and integrations/ imports integrations/, and so on
    down MAY_IMPORT."""
    assert violations(graph()) == []


def test_the_layer_check_finds_an_upward_import() -> None:
    """The check above can fail: a store module importing an integration, and core importing
    store, are both reported."""
    planted = {
        "prefixq.store.burst_end": {"prefixq.integrations.rq_callbacks", "prefixq.core.keys"},
        "prefixq.core.keys": {"prefixq.store.connection"},
        "prefixq.integrations.rq_callbacks": set(),
        "prefixq.store.connection": set(),
    }
    assert violations(planted) == [
        "prefixq.core.keys -> prefixq.store.connection",
        "prefixq.store.burst_end -> prefixq.integrations.rq_callbacks",
    ]
