"""The layer table of DESIGN.md / ARCHITECTURE.md as a checked contract: every import in dinopipe/ and
curation/ (module level or inside a function) may only point down. A wrong-way import fails here, naming
the file, the line and the rule."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("dinopipe", "curation")

# Module (dotted prefix) -> layer group. The longest matching prefix wins.
GROUPS: dict[str, str] = {
    # 0: configs (structured dataclasses + validation); stage configs count here wherever they live
    "dinopipe.config": "config",
    "dinopipe.utils": "util",  # one home per small helper (atomic writes, normalisation, device picking)
    "dinopipe.logs": "util",  # package loggers
    "dinopipe.ssl.config": "config",
    "dinopipe.ssl.config_checks": "config",  # the pretraining config's validators (split from ssl/config.py)
    "dinopipe.ssl.distill_config": "config",
    # 1
    "dinopipe.models": "models",
    "dinopipe.data": "data",
    # 2
    "dinopipe.ssl": "ssl",
    "dinopipe": "export",  # the package's facade only (dinopipe.load, create_model); exact match, see group_of
    "dinopipe.hub": "export",
    "dinopipe.export": "export",
    # 3
    "dinopipe.train": "train",
    "dinopipe.eval": "eval",
    "dinopipe.plan": "plan",  # the analytic planner and the traced dry run (which drives the train layer)
    "curation": "curation",
    # 4: entry points and orchestration, the only place dinopipe and curation meet
    "dinopipe.app": "app",  # dinopipe/app/: the commands and the orchestration of both packages
    "dinopipe.eval.cli": "app",
    "dinopipe.eval.head_train": "train",  # the dense heads' bridge into the one training loop (train's Task)
    "dinopipe.eval.depth_run": "app",  # `eval depth`'s command: trains through head_train
    "dinopipe.eval.seg_train": "app",  # `eval seg --head`'s command: trains through head_train
    "dinopipe.eval.detect": "app",  # `eval detect`'s command: trains through head_train
    "curation.cli": "app",
}

ALL = {"util", "config", "models", "data", "ssl", "export", "train", "eval", "plan", "curation", "app"}
_BOTTOM = {"util", "config"}
ALLOWED: dict[str, set[str]] = {
    "util": _BOTTOM,
    "config": _BOTTOM,
    "models": _BOTTOM | {"models"},
    "data": _BOTTOM | {"data"},
    "ssl": _BOTTOM | {"models", "ssl"},
    "export": _BOTTOM | {"models", "export"},
    # train -> eval: pretraining runs the eval layer's kNN on its teacher (eval imports nothing of train: no cycle)
    "train": _BOTTOM | {"models", "data", "ssl", "export", "eval", "train"},
    "eval": _BOTTOM | {"models", "data", "export", "eval"},
    "plan": _BOTTOM | {"models", "data", "ssl", "export", "train", "plan"},
    "curation": _BOTTOM | {"models", "data", "export", "curation"},
    "app": ALL,
}
# Model code is single-device (STYLE.md 3): distribution lives in dinopipe/train.
FORBIDDEN_EXTERNAL = {"models": ("torch.distributed",)}
# Within a layer: the writers never import the reader (hub imports export, not the other way: no cycle).
FORBIDDEN_WITHIN = {"dinopipe.export": ("dinopipe.hub", "dinopipe")}


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def group_of(module: str) -> str | None:
    """The layer of a dinopipe/curation module (None for third-party ones). The package name ``dinopipe``
    itself matches only its facade (``__init__``), so a new top-level module gets no layer until it is added
    to GROUPS, and the test says so."""
    if module == "dinopipe":
        return GROUPS["dinopipe"]
    best = None
    for prefix, group in GROUPS.items():
        if prefix == "dinopipe":
            continue
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, group)
    return best[1] if best else None


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_module(dotted: str, root: Path) -> bool:
    p = root.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def imports_of(source: str, module: str, is_package: bool, root: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement, relative ones resolved; ``from X import name``
    counts as importing X.name when that is a module."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names if _is_module(f"{target}.{a.name}", root)]
            out += [(node.lineno, s) for s in subs] or [(node.lineno, target)]
    return out


def violations(root: Path, packages=PACKAGES) -> list[str]:
    found = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            module = module_name(path, root)
            src_group = group_of(module)
            if src_group is None:  # every module in the packages needs a layer
                found.append(f"{path.relative_to(root)}: module {module} has no layer in tests/test_layers.py")
                continue
            within = [bad for src, bads in FORBIDDEN_WITHIN.items() if _under(module, src) for bad in bads]
            for line, target in imports_of(path.read_text(), module, path.name == "__init__.py", root):
                for bad in FORBIDDEN_EXTERNAL.get(src_group, ()):
                    if _under(target, bad):
                        found.append(f"{path.relative_to(root)}:{line}: {src_group} imports {target}")
                if any(target == bad for bad in within) or any(_under(target, b) for b in within if b != "dinopipe"):
                    found.append(f"{path.relative_to(root)}:{line}: {module} imports {target} (a cycle: "
                                 f"dinopipe.hub imports dinopipe.export)")
                dst_group = group_of(target)
                if dst_group is None and target.split(".")[0] in PACKAGES:
                    found.append(f"{path.relative_to(root)}:{line}: imports {target}, which has no layer in "
                                 f"tests/test_layers.py")
                elif dst_group is not None and dst_group not in ALLOWED[src_group]:
                    found.append(f"{path.relative_to(root)}:{line}: {src_group} ({module}) imports {dst_group} "
                                 f"({target}); {src_group} may import only {sorted(ALLOWED[src_group])}")
    return found


def test_imports_point_down_the_layers():
    found = violations(REPO)
    assert not found, "wrong-way imports (the layer table: GROUPS / ALLOWED above, DESIGN.md's module map):\n" + "\n".join(found)


@pytest.mark.parametrize("where, code, rule", [
    ("dinopipe/ssl/task.py", "from ..train.checkpoint import full_state_dict\n", "ssl (dinopipe.ssl.task) imports train"),
    ("dinopipe/ssl/task.py", "def f():\n    from dinopipe import hub\n", "ssl (dinopipe.ssl.task) imports export"),
    ("dinopipe/config.py", "from .train.parallel import ParallelConfig\n", "config (dinopipe.config) imports train"),
    ("dinopipe/utils/io.py", "from ..models import create_model\n", "util (dinopipe.utils.io) imports models"),
    ("dinopipe/models/vit.py", "import torch.distributed as dist\n", "models imports torch.distributed"),
    ("dinopipe/hub.py", "from .train.checkpoint import full_state_dict\n", "export (dinopipe.hub) imports train"),
    ("curation/embed/embedder.py", "from dinopipe.train.dist import init_distributed\n",
     "curation (curation.embed.embedder) imports train"),
    ("curation/embed/embedder.py", "from dinopipe.app.cli import main\n",
     "curation (curation.embed.embedder) imports app"),
    ("dinopipe/eval/knn.py", "from ..train.loop import Trainer\n", "eval (dinopipe.eval.knn) imports train"),
    ("dinopipe/export/hf.py", "def f():\n    from ..hub import export_arch\n", "dinopipe.export.hf imports dinopipe.hub"),
])
def test_checker_catches_a_wrong_way_import(tmp_path, where, code, rule):
    """A synthetic tree: one file per package layer, plus one bad import."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    for sub in ("ssl", "models", "train", "eval", "export", "utils", "app"):
        (tmp_path / "dinopipe" / sub).mkdir()
        (tmp_path / "dinopipe" / sub / "__init__.py").write_text("")
    for f in ("dinopipe/train/checkpoint.py", "dinopipe/train/parallel.py", "dinopipe/train/dist.py",
              "dinopipe/train/loop.py", "dinopipe/hub.py", "dinopipe/app/cli.py", "dinopipe/config.py"):
        (tmp_path / f).write_text("")
    good = tmp_path / where
    if not good.parent.exists():  # a module in a sub-package (curation/embed/)
        good.parent.mkdir()
        (good.parent / "__init__.py").write_text("")
    good.write_text("from dinopipe.config import ConfigError\n" if where.startswith("curation") else "")
    assert violations(tmp_path) == []
    good.write_text(good.read_text() + code)
    [msg] = violations(tmp_path)
    assert where in msg and rule in msg, msg


def test_export_paths_users_import_keep_working():
    """The exporters live in dinopipe/export/ (the old dinopipe.export_hf / export_onnx shims are gone); the hub
    re-exports the same objects."""
    import dinopipe
    import dinopipe.export as export
    from dinopipe import hub

    assert dinopipe.load is not None and hub.load.__module__ == "dinopipe.hub"
    for name in ("save_backbone", "save_heads", "export", "export_timm", "export_dinov2", "export_dinov3",
                 "export_hf", "export_arch", "IMAGENET_MEAN", "WEIGHTS_NAME"):
        assert getattr(hub, name) is getattr(export, name), name
    package = Path(dinopipe.__file__).parent
    assert not (package / "export_hf.py").exists() and not (package / "export_onnx.py").exists()


def test_a_module_without_a_layer_is_reported(tmp_path):
    (tmp_path / "dinopipe").mkdir()
    (tmp_path / "dinopipe" / "__init__.py").write_text("from .models import create_model\n")
    (tmp_path / "dinopipe" / "newthing.py").write_text("")
    [msg] = violations(tmp_path, packages=("dinopipe",))
    assert "dinopipe/newthing.py" in msg and "has no layer" in msg


LONG = 450


def long_files_without_a_reason(root: Path) -> list[str]:
    """Files over LONG lines under dinopipe/, curation/, bench/, tests/ against ARCHITECTURE.md's table."""
    text = (root / "ARCHITECTURE.md").read_text()
    section = text.split("## Files over 450 lines, and why", 1)[1].split("\n## ", 1)[0]
    listed = {line.split("`")[1] for line in section.splitlines() if line.startswith("| `")}
    found = []
    long = set()
    for top in ("dinopipe", "curation", "bench", "tests"):
        for path in sorted((root / top).rglob("*.py")):
            rel = str(path.relative_to(root))
            if len(path.read_text().splitlines()) > LONG:
                long.add(rel)
                if rel not in listed:
                    found.append(f"{rel}: over {LONG} lines with no row in ARCHITECTURE.md's 'Files over 450 lines'")
    found += [f"{rel}: listed in ARCHITECTURE.md but no longer over {LONG} lines (drop its row)"
              for rel in sorted(listed - long)]
    return found


def test_no_file_over_450_lines_without_a_stated_reason():
    found = long_files_without_a_reason(REPO)
    assert not found, "\n".join(found)


def test_the_long_file_rule_bites(tmp_path):
    (tmp_path / "ARCHITECTURE.md").write_text("## Files over 450 lines, and why\n\n| `dinopipe/gone.py` | 500 | x |\n")
    (tmp_path / "dinopipe").mkdir()
    (tmp_path / "dinopipe" / "big.py").write_text("x = 1\n" * (LONG + 1))
    found = long_files_without_a_reason(tmp_path)
    assert len(found) == 2 and "dinopipe/big.py" in found[0] and "dinopipe/gone.py" in found[1], found
