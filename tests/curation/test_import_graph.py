"""curation's modules form no import cycle (module-level or inside a function), and each imports alone.

A cycle hidden in function-level imports (pipeline -> knn_steps -> pipeline) works until someone moves
an import to the top; the graph here counts every ``import`` statement anywhere in a module.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "curation")


def _modules() -> dict[str, str]:
    mods = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                mods[name.removesuffix(".__init__")] = path
    return mods


def _targets(mod: str, path: str, node, mods: dict) -> set[str]:
    """curation modules an import statement loads (``from .x import y``: x, and x.y when it is a module)."""
    pkg = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in mods}
    if node.level:
        base = pkg
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        target = f"{base}.{node.module}" if node.module else base
    else:
        target = node.module or ""
    out = {target} if target in mods else set()
    out |= {f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods}
    return out


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for mod, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        deps = set()
        for node in ast.walk(tree):  # every import, also those inside functions
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps |= _targets(mod, path, node, mods)
        # a package's own __init__ is loaded before any submodule: not an edge back
        graph[mod] = {d for d in deps if d != mod and not mod.startswith(d + ".")}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(u):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in state:
                found = visit(v)
                if found:
                    return found
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state:
            found = visit(u)
            if found:
                return found
    return None


def test_graph_walker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    graph = import_graph()
    assert "curation.stepfiles" in graph["curation.pipeline"]  # the walker sees relative imports
    assert "curation.pipeline" in graph["curation.cli"]


def test_no_import_cycle_in_curation():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("mod", ["curation.pipeline", "curation.knn_steps", "curation.dist_kmeans",
                                 "curation.report", "curation.stepfiles"])
def test_module_imports_alone(mod):
    """Each in a fresh interpreter, nothing imported before it."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", f"import {mod}"], env=env, capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
