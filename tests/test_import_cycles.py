"""dinopipe's modules form no import cycle, module-level or inside a function (tests/curation/test_import_graph.py
does the same for curation/).

A cycle hidden in a function-level import (``channels.decode_channels`` importing ``decode``, which imports
``channels`` at the top) works until someone moves the import to the top; the graph here counts every
``import`` statement anywhere in a module, except those under ``if TYPE_CHECKING:`` (never executed).
Every strongly connected group of modules is reported, not just the first cycle found.
"""

from __future__ import annotations

from tests._imports import cycles, import_graph

# Cycles known and accepted for now, each with the reason; the test fails when one disappears, so the entry goes.
KNOWN: dict[frozenset[str], str] = {}  # a cycle accepted for now: {frozenset(modules): why}


def test_cycle_finder_and_graph_walker(tmp_path):
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert cycles({"a": {"b"}, "b": set()}) == []
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "x.py").write_text("def f():\n    from . import y\n")  # a lazy import counts
    (pkg / "y.py").write_text("from .x import f\n")
    (pkg / "z.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .x import f\n")
    (pkg / "w.py").write_text("from .z import f\n")
    graph = import_graph(tmp_path, "p")
    assert graph["p.x"] == {"p.y"} and graph["p.z"] == set() and graph["p.w"] == {"p.z"}
    assert cycles(graph) == [frozenset({"p.x", "p.y"})]


def test_no_import_cycle_in_dinopipe():
    found = set(cycles(import_graph()))
    new = [" <-> ".join(sorted(c)) for c in found - set(KNOWN)]
    gone = [" <-> ".join(sorted(c)) for c in set(KNOWN) - found]
    assert not new, "import cycles (move the shared part to a module both can import):\n" + "\n".join(new)
    assert not gone, "a known cycle is gone: remove it from KNOWN in this file:\n" + "\n".join(gone)


def test_the_pretraining_schema_and_its_checks_import_one_way():
    """ssl/config_checks.py needs the schema's names (for annotations only); ssl/config.py must not import the
    checks back (it re-exported them: a circle that only deferred imports kept from failing)."""
    graph = import_graph()
    assert "dinopipe.ssl.config_checks" not in graph["dinopipe.ssl.config"]
    assert "dinopipe.ssl.config" not in graph["dinopipe.ssl.config_checks"]


def test_no_import_cycle_across_dinopipe_and_curation():
    """The two packages read as one graph: no cycle through both (the per-package tests cannot see one). The
    orchestration that drives both lives in one place, ``dinopipe/app/``: no other dinopipe module imports
    curation, and curation never imports the app layer (``curation/cli.py``, the ``curate`` command, included)."""
    graph = import_graph(pkg=("dinopipe", "curation"))
    assert cycles(graph) == [], cycles(graph)
    up = {m for m, deps in graph.items() if m.startswith("dinopipe.") and not m.startswith("dinopipe.app")
          and any(d.startswith("curation") for d in deps)}
    assert not up, f"dinopipe modules outside dinopipe/app importing curation: {sorted(up)}"
    into_app = {m for m, deps in graph.items() if m.startswith("curation") and
                any(d.startswith("dinopipe.app") for d in deps)}
    assert not into_app, f"curation modules importing dinopipe.app: {sorted(into_app)}"
    assert {m for m in graph if m.startswith("dinopipe.app.")} >= {"dinopipe.app.cli", "dinopipe.app.pipeline",
                                                                   "dinopipe.app.slurm"}
