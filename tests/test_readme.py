"""Every shell command in README.md and docs/*.md is checked so the README cannot rot: referenced files exist, `make`
targets exist, stage commands' configs and key=value overrides are valid for their schema (a renamed key
fails here), subcommand flags parse, and the cheap commands (models, config, plan) really run. The
expensive ones run elsewhere with tiny settings (test_pipeline: `make quickstart`'s command; tests/train:
pretrain/distill; tests/curation: curate; test_slurm: the Slurm scripts)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from dinopipe.config import load_config

REPO = Path(__file__).resolve().parents[1]
# The README and every page under docs/ (the detail moved there): their commands are checked alike.
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README = "\n".join(p.read_text() for p in DOC_FILES)


def readme_commands() -> list[str]:
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        text = re.sub(r"\\\n\s*", " ", block)  # join continuation lines
        for line in text.splitlines():
            line = line.split(" # ")[0].strip()
            if line and not line.startswith("#"):
                cmds.append(line)
    return cmds


COMMANDS = readme_commands()


def _tokens(cmd: str) -> list[str]:
    toks = shlex.split(cmd)
    while toks and re.match(r"^[A-Z_]+=", toks[0]):  # CONFIG=... sbatch ...
        toks = toks[1:]
    return toks


def _schema(stage: str):
    if stage == "pretrain" or stage == "plan":
        from dinopipe.ssl.config import PretrainConfig
        return PretrainConfig
    if stage == "distill":
        from dinopipe.ssl.distill_config import DistillConfig
        return DistillConfig
    if stage == "pipeline":
        from dinopipe.app.pipeline import PipelineConfig
        return PipelineConfig
    if stage == "curate":
        from curation.config import CurationConfig
        return CurationConfig
    if stage == "slurm":
        from dinopipe.app.slurm import SlurmConfig
        return SlurmConfig
    return None


def _config_and_overrides(args: list[str]) -> tuple[str | None, list[str]]:
    config, overrides, i = None, [], 0
    while i < len(args):
        a = args[i]
        if a == "--config":
            config, i = args[i + 1], i + 2
            continue
        if a.startswith("--"):
            i += 1 if "=" in a or i + 1 >= len(args) or args[i + 1].startswith("-") or "=" in args[i + 1] else 2
            continue
        if "=" in a:
            overrides.append(a)
        i += 1
    return config, overrides


def test_readme_has_commands():
    assert "make quickstart" in COMMANDS and "make test" in COMMANDS
    assert len(COMMANDS) > 15


@pytest.mark.parametrize("cmd", COMMANDS)
def test_referenced_files_exist(cmd):
    for tok in _tokens(cmd):
        for path in re.findall(r"(?:^|[=\[,])((?:configs|slurm|bench)/[\w./-]+)", tok):
            assert (REPO / path).exists(), f"{path} (in: {cmd})"


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.startswith("make ")])
def test_make_targets_exist(cmd):
    target = cmd.split()[1]
    assert re.search(rf"^{re.escape(target)}:", (REPO / "Makefile").read_text(), re.M), cmd


def _stage_of(toks: list[str]) -> tuple[str | None, list[str]]:
    """(stage name, its arguments) for dinopipe/curate/python -m/torchrun/sbatch command lines."""
    if toks[0] == "dinopipe" and len(toks) > 1:
        return toks[1], toks[2:]
    if toks[0] == "curate":
        return "curate", toks[2:] if len(toks) > 1 and not toks[1].startswith("-") else toks[1:]
    if "-m" in toks:
        mod = toks[toks.index("-m") + 1]
        if mod.startswith("dinopipe.train."):
            return mod.rsplit(".", 1)[1], toks[toks.index("-m") + 2:]
    if toks[0] == "sbatch":
        script = next(t for t in toks if t.endswith(".sbatch"))
        stage = Path(script).stem.split("_")[0]
        return stage, toks[toks.index(script) + 1:]
    return None, []


def _has_schema(cmd: str) -> bool:
    stage, _ = _stage_of(_tokens(cmd))
    return bool(stage) and _schema(stage) is not None


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if _has_schema(c)])
def test_stage_configs_and_overrides_are_valid(cmd):
    stage, args = _stage_of(_tokens(cmd))
    schema = _schema(stage)
    config, overrides = _config_and_overrides(args)
    if stage == "sbatch" or (config is None and stage in ("pretrain", "distill") and "CONFIG=" in cmd):
        config = re.search(r"CONFIG=(\S+)", cmd).group(1)
    load_config(schema, REPO / config if config else None, overrides)  # raises ConfigError naming the key


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.startswith(("dinopipe eval", "dinopipe export",
                                                                       "dinopipe channel-stats"))])
def test_subcommand_flags_parse(cmd):
    toks = _tokens(cmd)
    if toks[1] == "eval":
        from dinopipe.eval.cli import build_parser
        build_parser().parse_args(toks[2:])
    else:
        from dinopipe.app.cli import build_parser
        build_parser().parse_args(toks[1:])


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.startswith(("dinopipe plan", "dinopipe models",
                                                                       "dinopipe config"))])
def test_cheap_commands_run(cmd):
    toks = _tokens(cmd)
    r = subprocess.run([sys.executable, "-m", "dinopipe.app.cli", *toks[1:]], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_python_examples_run(tmp_path, monkeypatch):
    """The README's Python blocks, run against small stand-ins for the files they name."""
    import timm
    import torch

    from dinopipe.hub import export_dinov2, export_timm, save_backbone
    from dinopipe.models import create_model

    monkeypatch.chdir(tmp_path)
    small = create_model("vit_test_reg4", init_values=1.0).eval()
    save_backbone(small, tmp_path / "runs" / "vitl14" / "export" / "teacher")
    export_dinov2(small, tmp_path / "dinov2_vitl14_reg4_pretrain.pth")
    # a foreign state dict says no head count: a released width (384 -> 6 heads) is what such files have
    tm = timm.create_model("vit_small_patch14_dinov2", img_size=224, embed_dim=384, depth=4, num_heads=6,
                           num_classes=0, pretrained=False)
    torch.save(tm.state_dict(), tmp_path / "timm_vit_small_dinov2.pth")
    export_timm(small, tmp_path / "timm_export")
    front = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    save_backbone(small, tmp_path / "runs" / "quickstart" / "pretrain" / "export" / "teacher")
    ns: dict = {}
    exec(front[0], ns)  # noqa: S102 - our own README: loading a run folder
    assert ns["cls"].shape == (1, 64) and "x_norm_patchtokens" in ns["out"]
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "docs" / "load.md").read_text(), re.S)
    assert len(blocks) >= 2
    ns = {}
    exec(blocks[0], ns)  # noqa: S102 - our own README
    assert ns["cls"].shape == (1, 384) and len(ns["feats"]) == 4
    # Block 2 names a real ViT-L/14 entry and a placeholder folder: run it on the tiny stand-ins.
    code = blocks[1].replace('"local-dir:DIR"', f'"local-dir:{tmp_path / "timm_export"}"')
    code = code.replace('"/path/to/dinopipe"', repr(str(REPO))).replace('"dinopipe_vitl14_reg"', '"dinopipe_vit_test_reg"')
    exec("import torch\n" + code, ns)  # noqa: S102


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.startswith(".venv/bin/ruff ")])
def test_lint_command_runs(cmd):
    """The README's lint command passes on this tree (ruff comes with the dev extra; CI runs it first)."""
    r = subprocess.run([sys.executable, "-m", "ruff", *_tokens(cmd)[1:]], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]


def _module(cmd: str) -> str | None:
    toks = _tokens(cmd)
    return toks[toks.index("-m") + 1] if "-m" in toks[:-1] else None


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if _module(c) and not _module(c).startswith("pip")])
def test_python_modules_exist(cmd):
    import importlib.util

    mod = _module(cmd)
    assert importlib.util.find_spec(mod) is not None, f"module {mod} (in: {cmd})"


def _pip_extras(cmd: str) -> list[str] | None:
    m = re.match(r"pip install (?:-e '?\.|'?dinopipe)\[([\w,-]+)\]'?$", cmd)
    return m.group(1).split(",") if m else None


@pytest.mark.parametrize("cmd", [c for c in COMMANDS if _pip_extras(c)])
def test_pip_extras_exist(cmd):
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name in _pip_extras(cmd):
        assert name in extras, f"extra '{name}' is not in pyproject.toml (in: {cmd})"


# Commands no test here can check, each with the reason; anything else the checks above do not cover fails.
NOT_CHECKED = {
    "export CURATE_SETUP=": "sets a shell variable for the next command",
    "sudo slurm/local_cluster.sh ": "starts/stops the machine's Slurm daemons (the script's path is checked above)",
    "sinfo": "Slurm's own tool",
    "squeue": "Slurm's own tool",
    "python3 -m pip download ": "fetches wheels for an offline cluster (needs the registry)",
    "dinopipe gpu-check ": "the GPU check itself: tests/test_gpu_check.py runs its CPU subset",
    "curate plan ": "the curation planner: tests/curation/test_curation_plan.py runs it",
    "slurm/submit_curation.sh ": "submits to Slurm: tests/curation/test_kmeans_slurm.py runs it",
    "srun --ntasks 3 curate kmeans ": "under Slurm: tests/curation/test_kmeans.py runs `curation.cli kmeans` on 1-3 ranks",
}


def _checked_by(cmd: str) -> list[str]:
    toks = _tokens(cmd)
    checks = []
    if cmd.startswith("make "):
        checks.append("make target")
    if _has_schema(cmd) and not cmd.startswith("curate plan"):
        checks.append("config and overrides")
    if cmd.startswith(("dinopipe eval", "dinopipe export", "dinopipe channel-stats")):
        checks.append("flags parse")
    if cmd.startswith(("dinopipe plan", "dinopipe models", "dinopipe config")):
        checks.append("runs")
    if _module(cmd) and not _module(cmd).startswith("pip") and toks[0] != "python3":
        checks.append("module exists")
    if _pip_extras(cmd):
        checks.append("pip extra exists")
    if cmd.startswith(".venv/bin/ruff "):
        checks.append("lint runs")
    if len(toks) > 1 and toks[0] == "python" and toks[1].startswith("bench/") and (REPO / toks[1]).is_file():
        checks.append("bench script exists")  # its flags: the bench's own test or run; the path: above
    return checks


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_command_is_checked(cmd):
    """A README command no check above recognises would rot unnoticed: it fails here until a check covers it or
    it is listed in NOT_CHECKED with a reason (then it is reported as a skip, naming the command)."""
    if _checked_by(cmd):
        return
    reason = next((why for prefix, why in NOT_CHECKED.items() if cmd.startswith(prefix) or cmd == prefix.strip()),
                  None)
    assert reason is not None, f"README command not checked by any test: {cmd!r} (add a check or a NOT_CHECKED entry)"
    pytest.skip(f"not checked here: {cmd!r}: {reason}")
