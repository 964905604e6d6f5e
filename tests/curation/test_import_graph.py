"""curation's modules form no import cycle (module-level or inside a function), and each imports alone.

A cycle hidden in function-level imports (pipeline -> knn_steps -> pipeline) works until someone moves
an import to the top; the graph here counts every ``import`` statement anywhere in a module.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests._imports import import_graph as _graph

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def import_graph() -> dict[str, set[str]]:
    return _graph(Path(ROOT), "curation")


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
    assert "curation.core.stepfiles" in graph["curation.pipeline"]  # the walker sees relative imports
    assert "curation.pipeline" in graph["curation.cli"]


def test_no_import_cycle_in_curation():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("mod", ["curation.pipeline", "curation.index.step", "curation.dedup.knn", "curation.kmeans.dist",
                                 "curation.report.plots", "curation.core.stepfiles"])
def test_module_imports_alone(mod):
    """Each in a fresh interpreter, nothing imported before it."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", f"import {mod}"], env=env, capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]


def test_task_processes_that_read_embeddings_do_not_import_torch(tmp_path):
    """A local or srun task process of the hash pairs, index add, searches, sampling, path table, decisions and
    decisions-only writing imports its module and opens the embeddings; none of that imports torch (~350 MB of
    anonymous memory and ~1.5 s per task process, measured 379 -> 29 MB RssAnon): curation.core.embstore reads the
    shards, torch stays with the embedding runner, the pixel verifier and the k-means."""
    from curation.simulate import chain

    chain.pool_task(0, 1, str(tmp_path), 3000, 16, 5, 0, 0.01, 0.01, 4, 65536)
    code = ("import sys\n"
            "import curation.knn.shards, curation.dedup.hash_step, curation.kmeans.sampling, curation.core.table\n"
            "import curation.core.decisions, curation.write.tasks, curation.simulate.chain\n"
            "from curation.knn.shards import RowSource\n"
            f"rows = RowSource({str(tmp_path / 'embeddings' / 'descriptor')!r}).open()\n"
            "assert len(rows) == 3000 and rows.take([0, 1]).shape == (2, 16)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", r.stdout
