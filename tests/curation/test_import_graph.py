"""curation's modules form no import cycle (module-level or inside a function), and each imports alone.

A cycle hidden in function-level imports (pipeline -> a step -> pipeline) works until someone moves
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


# curation/ by room (ARCHITECTURE.md, "curation by step"), top to bottom: a room imports only the rooms listed
# for it, so no arrow points back up. A step imports core, config and the engines; two stated exceptions: the
# eval images (decontaminate) and the seed images (rebalance) are embedded by the pool's own embedder.
ENGINES = {"knn", "kmeans", "verify"}
STEPS = {"embed", "dedup", "decontaminate", "rebalance", "write", "report"}
BOTTOM = {"core", "config"}
ROOM_MAY = {
    "config": set(), "plan_rates": set(), "core": set(),
    "knn": BOTTOM, "kmeans": BOTTOM | {"knn"}, "verify": BOTTOM | {"knn"},
    **{step: BOTTOM | ENGINES for step in STEPS},
    "index": BOTTOM | {"knn", "dedup", "decontaminate", "rebalance"},  # the three steps' indexes, built once
    "pipeline": BOTTOM | ENGINES | STEPS | {"index"},
    "plan": BOTTOM | ENGINES | {"rebalance", "plan_rates"},
    "simulate": BOTTOM | ENGINES | STEPS | {"index", "pipeline"},
    "cli": BOTTOM | ENGINES | STEPS | {"index", "pipeline", "plan", "simulate"},
}
STEP_EXCEPTIONS = {("decontaminate", "embed"), ("rebalance", "embed")}


def room_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "curation"


def room_violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for src, targets in sorted(graph.items()):
        a = room_of(src)
        for dst in sorted(targets):
            b = room_of(dst)
            if a == b or a == "curation" or b == "curation" or (a, b) in STEP_EXCEPTIONS:
                continue
            if a not in ROOM_MAY:
                found.append(f"{src}: room {a!r} is not in ROOM_MAY (tests/curation/test_import_graph.py)")
            elif b not in ROOM_MAY[a]:
                found.append(f"{src} imports {dst}: {a} may import only {sorted(ROOM_MAY[a])}")
    return found


def test_each_room_imports_only_the_rooms_below_it():
    found = room_violations(import_graph())
    assert not found, "\n".join(found)
    arrows = {(room_of(s), room_of(d)) for s, ts in import_graph().items() for d in ts} - {(r, r) for r in ROOM_MAY}
    assert len(arrows) <= 70, sorted(arrows)  # issue 52's goal for the picture


def test_room_rule_catches_a_step_importing_another_step():
    graph = {"curation.dedup.step": {"curation.write.tasks", "curation.core.runner"},
             "curation.knn.index": {"curation.kmeans.sampling"}, "curation.decontaminate.nearest": {"curation.embed.embeddings"}}
    found = room_violations(graph)
    assert len(found) == 2 and "dedup may import only" in found[0] and "knn may import only" in found[1], found
