"""One object for a training run folder's layout (dinopipe/utils/run_layout.py): no module joins the folder's names
again, and a run's writers and readers agree on it (a checkpoint `dinopipe.load` finds where the loop saved it)."""

from __future__ import annotations

import ast
from pathlib import Path

from dinopipe.utils.run_layout import TrainLayout

ROOT = Path(__file__).resolve().parents[2]
NAMES = {"metrics.jsonl", "checkpoints", "export", "config.yaml"}


def joins_of_run_names(root: Path) -> list[str]:
    """``x / "<name>"`` or ``os.path.join(x, "<name>")`` in dinopipe/ outside run_layout.py."""
    found = []
    for path in sorted((root / "dinopipe").rglob("*.py")):
        if path.name == "run_layout.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            named = None
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant):
                named = node.right.value
            elif (isinstance(node, ast.Call) and ast.unparse(node.func) == "os.path.join" and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant)):
                named = node.args[1].value
            if named in NAMES:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_joins_the_run_folders_names_again():
    found = joins_of_run_names(ROOT)
    assert not found, "use dinopipe.utils.run_layout.TrainLayout:\n" + "\n".join(found)


def test_the_checker_finds_a_join(tmp_path):
    (tmp_path / "dinopipe").mkdir()
    (tmp_path / "dinopipe" / "x.py").write_text("from pathlib import Path\np = Path(run) / 'checkpoints'\n")
    [msg] = joins_of_run_names(tmp_path)
    assert "dinopipe/x.py:2" in msg


def test_the_readers_find_what_the_layout_names(tmp_path):
    """A run folder laid out by TrainLayout is what dinopipe.load's locator reads: its latest DCP checkpoint."""
    from dinopipe.export.readers import dcp_dir

    lay = TrainLayout(tmp_path)
    ckpt = lay.checkpoints / "step_00000007"
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_bytes(b"")
    lay.latest.write_text("step_00000007\n")
    assert dcp_dir(tmp_path) == ckpt
    assert (lay.metrics, lay.config, lay.export("teacher")) == (
        tmp_path / "metrics.jsonl", tmp_path / "config.yaml", tmp_path / "export" / "teacher")
