"""One object for a curation output folder's layout (curation/core/layout.py): no other module joins the folder's
names again, and the layout gives the paths the steps have always written (the folder a rerun resumes from)."""

from __future__ import annotations

import ast
from pathlib import Path

from curation.core.layout import RunLayout

ROOT = Path(__file__).resolve().parents[2]
NAMES = {"embeddings", "steps", "knn", "decisions", "shards", "report", "copy_model.json", "decisions.tsv",
         "manifest.json"}


def joins_of_layout_names(root: Path) -> list[str]:
    """``os.path.join(x, "<a layout name>", ...)`` anywhere in curation/ outside layout.py."""
    found = []
    for path in sorted((root / "curation").rglob("*.py")):
        if path.name == "layout.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and ast.unparse(node.func) == "os.path.join" and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in NAMES):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_joins_the_output_folders_names_again():
    found = joins_of_layout_names(ROOT)
    assert not found, "use curation.core.layout.RunLayout:\n" + "\n".join(found)


def test_the_checker_finds_a_join(tmp_path):
    (tmp_path / "curation").mkdir()
    (tmp_path / "curation" / "x.py").write_text("import os\np = os.path.join(out_dir, 'embeddings', 'model')\n")
    [msg] = joins_of_layout_names(tmp_path)
    assert "curation/x.py:2" in msg


def test_the_layout_is_the_folder_the_steps_write(tmp_path):
    lay = RunLayout(str(tmp_path))
    assert lay.embeddings("descriptor") == str(tmp_path / "embeddings" / "descriptor")
    assert lay.steps("dedup", "status.npy") == str(tmp_path / "steps" / "dedup" / "status.npy")
    assert lay.step_json("dedup") == str(tmp_path / "steps" / "dedup.json")
    assert lay.knn("pool") == str(tmp_path / "knn" / "pool")
    assert (lay.manifest, lay.decisions_tsv, lay.copy_model) == tuple(
        str(tmp_path / n) for n in ("manifest.json", "decisions.tsv", "copy_model.json"))
