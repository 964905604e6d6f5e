"""The exit-code contract (docs/exit-codes.md) as a table over every command and subcommand.

Each row is a malformed input a user can give -- an unknown key, a wrong type, a zero or negative count, a missing
or unreadable path, an empty or all-unreadable set, a pool too small for a size-dependent setting, an output that
cannot be written -- with the exit code it must give and what its one line must name. For exit 2: no traceback,
and nothing written where the mistake can be known before. Then one injected internal fault per command: exit 1,
the traceback and "please report" (a bug is never blamed on the user). One row per killed-task case: exit 75.

Cheap on purpose: every row calls the entry points (``dinopipe.app.cli.main``, ``curation.cli.main``) in this process;
``test_console_scripts_keep_the_contract`` runs a few through the installed console scripts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from curation.cli import main as curate_main
from dinopipe.app.cli import main as dinopipe_main

REPO = Path(__file__).resolve().parents[1]
PRE = "configs/pretrain/quickstart.yaml"
DIS = "configs/distill/quickstart.yaml"
CUR = "configs/curation/quickstart.yaml"
PIPE = "configs/pipeline/quickstart.yaml"
SLURM = "configs/slurm/quickstart.yaml"


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
    """The paths a row names as @NAME. IMG: a few readable photos; BAD: files named .jpg that are not images;
    EMPTY: a folder without an image; CLS / BADCLS: labelled class folders (readable / unreadable); FEW: one image
    per class (too few to hold out); POOL80: 80 small photos; DENSE: no dense set at all; FILE: a regular file, so
    FILE/x is an output path that cannot be created; YAML: a file that is not YAML; PTH: a .pth that is not a
    checkpoint."""
    root = tmp_path_factory.mktemp("contract")
    rng = np.random.default_rng(0)

    def photo(path: Path, size: int = 40) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(path)

    for i in range(6):
        photo(root / "img" / f"{i}.png")
        (root / "bad" / f"{i}.jpg").parent.mkdir(parents=True, exist_ok=True)
        (root / "bad" / f"{i}.jpg").write_bytes(b"not a jpeg " * (i + 1))
    (root / "empty" / "sub").mkdir(parents=True)
    (root / "empty" / "notes.txt").write_text("no image here")
    for c in ("a", "b"):
        for i in range(4):
            photo(root / "cls" / c / f"{i}.png")
            p = root / "badcls" / c / f"{i}.jpg"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(b"\xff\xd8 truncated")
        photo(root / "few" / c / "0.png")
    for i in range(80):  # enough rows for an IVF index (78): knn.pq_m is checked when it is built
        photo(root / "pool80" / f"{i}.png", 16)
    (root / "file").write_text("a file, not a folder")
    (root / "bad.yaml").write_text("model: [unclosed\n  - x: {")
    (root / "bad.pth").write_bytes(b"PK\x03\x04 not a checkpoint")
    return {"IMG": str(root / "img"), "BAD": str(root / "bad"), "EMPTY": str(root / "empty"),
            "CLS": str(root / "cls"), "BADCLS": str(root / "badcls"), "FEW": str(root / "few"),
            "FILE": str(root / "file"), "YAML": str(root / "bad.yaml"), "PTH": str(root / "bad.pth"),
            "POOL80": str(root / "pool80")}


def call(argv: list[str]) -> int:
    """The exit code of `dinopipe ARGV` (or `curate ARGV[1:]` when ARGV[0] is "curate:"), in this process."""
    main, args = (curate_main, argv[1:]) if argv[0] == "curate:" else (dinopipe_main, argv)
    try:
        return main(list(args))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1


def R(argv: str, says: str, rc: int = 2, written: tuple[str, ...] = ()):
    """A row: the command line (split on spaces; IMG, OUT, ... are filled in), the text its stderr must hold,
    the exit code, and the files allowed in OUT afterwards (a curation step writes its resolved config first)."""
    return pytest.param(argv.split(), says, rc, set(written), id=argv)


_PRE = f"pretrain --config {PRE} data.paths=[@IMG] train.output_dir=@OUT"
_DIS = f"distill --config {DIS} data.paths=[@IMG] train.output_dir=@OUT"
_KNN = "eval knn --model vit_test --train @CLS --val @CLS --device cpu --workers 0"
_LIN = "eval linear --model vit_test --train @CLS --val @CLS --device cpu --workers 0"
_SEG = "eval seg --model vit_test --train @DENSE --val @DENSE --device cpu"
_PLAN = f"plan --config {PRE} --gpus 8 --gpu-mem-gb 80"
_RUN = f"curate: run --config {CUR} input.paths=[@IMG] output.dir=@OUT"
_CFG = ("config.yaml",)

ROWS = [
    # dinopipe models / config
    R("models --bogus", "--bogus"),
    R("config --kind nope", "--kind"),
    R("config --kind pretrain optim.nope=1", "optim.nope"),
    R("config --kind pretrain train.batch_size=abc", "train.batch_size"),
    R("config --kind pretrain --config no/such.yaml", "no/such.yaml"),
    R("config --kind pretrain --config @YAML", "bad.yaml"),
    R("config --kind curation noequals", "key=value"),
    R("config --kind slurm nope.x=1", "nope"),
    # dinopipe export
    R("export --model /no/such --format timm --out @OUT", "/no/such"),
    R("export --model @PTH --format timm --out @OUT", "bad.pth"),
    R("export --model vit_test --format nope --out @OUT", "--format"),
    R("export --model vit_test --format timm --out @OUT --image-size 56", "--image-size"),
    R("export --model vit_test --format timm --out @FILE/sub", "@FILE/sub"),
    R("export --model vit_test --format safetensors --out @FILE/sub", "@FILE/sub"),
    R("export --model vit_test --format dinov2 --out @FILE/x.pth", "@FILE/x.pth"),
    R("export --model vit_test_dinov3 --format dinov2 --out @OUT", "DINOv2"),
    R("export --model vit_test --format timm --out @OUT --num-heads abc", "--num-heads"),
    # dinopipe channel-stats
    R("channel-stats @IMG --channels 0", "--channels"),
    R("channel-stats @IMG --channels 17", "--channels"),
    R("channel-stats @IMG --channels 3 --sample 0", "--sample"),
    R("channel-stats /no/such --channels 3", "/no/such"),
    R("channel-stats @EMPTY --channels 3", "@EMPTY"),
    R("channel-stats @BAD --channels 3", "--channels"),
    # dinopipe pretrain
    R(f"{_PRE} optim.lrr=1", "optim.lrr"),
    R(f"{_PRE} model.name=vit_nope", "vit_nope"),
    R("pretrain --config no/such.yaml", "no/such.yaml"),
    R("pretrain --config @YAML", "bad.yaml"),
    R(f"{_PRE} optim.base_lr=-1", "optim.base_lr"),
    R(f"{_PRE} train.batch_size=0", "train.batch_size"),
    R(f"{_PRE} train.batch_size=abc", "train.batch_size"),
    R(f"{_PRE} data.paths=[]", "data.paths"),
    R(f"{_PRE} model.pretrained=/no/such.pth", "model.pretrained"),
    R(f"{_PRE} ibot.mask_ratio_min_max=[0.5,0.1]", "ibot.mask_ratio_min_max"),
    R(f"{_PRE} train.output_dir=@FILE/run", "@FILE/run"),
    # dinopipe distill
    R(f"{_DIS} teacher_model.path=/no/such", "teacher_model.path"),
    R(f"{_DIS} students_typo=1", "students_typo"),
    R(f"{_DIS} students=[]", "students"),
    R("distill --config no/such.yaml", "no/such.yaml"),
    R(f"{_DIS} train.batch_size=abc", "train.batch_size"),
    # dinopipe eval knn / linear / seg
    R(f"{_KNN} --k 0", "--k"),
    R(f"{_KNN} --k 10 -3", "--k"),
    R(f"{_KNN} --temperature 0", "--temperature"),
    R(f"{_KNN} --batch-size 0", "--batch-size"),
    R(f"{_KNN} --img-size 0", "--img-size"),
    R(f"{_KNN} --workers -1", "--workers"),
    R(f"{_KNN} --k abc", "--k"),
    R(f"{_KNN} --train /no/such", "/no/such"),
    R(f"{_KNN} --val /no/such", "/no/such"),
    R(f"{_KNN} --train @BADCLS", "@BADCLS"),
    R(f"{_KNN} --val @BADCLS", "@BADCLS"),
    R(f"{_KNN} --train @EMPTY", "@EMPTY"),
    R(f"{_KNN} --out @FILE/x.json", "--out"),
    R(f"{_KNN} --out @IMG", "--out"),
    R("eval knn --model /no/such --train @CLS --val @CLS --device cpu --workers 0", "/no/such"),
    R(f"{_LIN} --holdout 0", "--holdout"),
    R(f"{_LIN} --holdout 1.5", "--holdout"),
    R(f"{_LIN} --epochs 0", "--epochs"),
    R(f"{_LIN} --lrs -1", "--lrs"),
    R(f"{_LIN} --wds -1", "--wds"),
    R(f"{_LIN} --probe-batch-size 0", "--probe-batch-size"),
    R(f"{_LIN} --optimizer nope", "--optimizer"),
    R("eval linear --model vit_test --train @FEW --val @FEW --device cpu --workers 0", "--holdout"),
    R(f"{_SEG} --lr 0", "--lr"),
    R(f"{_SEG} --epochs 0", "--epochs"),
    R(f"{_SEG}", "@DENSE"),
    R("eval nope", "nope"),
    # dinopipe plan
    R(f"{_PLAN} --gpus 0", "--gpus"),
    R(f"plan --config {PRE} --gpus -1 --gpu-mem-gb 80", "--gpus"),
    R(f"plan --config {PRE} --gpus 8 --gpu-mem-gb 0", "--gpu-mem-gb"),
    R(f"{_PLAN} --mfu 0", "--mfu"),
    R(f"{_PLAN} --mfu 1.5", "--mfu"),
    R(f"{_PLAN} --margin -0.1", "--margin"),
    R(f"{_PLAN} --gpu-tflops 0", "--gpu-tflops"),
    R(f"{_PLAN} --trace --steps 0", "--steps"),
    R(f"{_PLAN} --json @OUT/x.json", "--json"),
    R(f"{_PLAN} --trace --json @FILE/x.json", "--json"),
    R("plan --config no/such.yaml --gpus 8 --gpu-mem-gb 80", "no/such.yaml"),
    R(f"{_PLAN} optim.nope=1", "optim.nope"),
    R(f"{_PLAN} model.name=vit_nope", "vit_nope"),
    R(f"{_PLAN} train.batch_size=abc", "train.batch_size"),
    R(f"{_PLAN} --trace --phase typo", "--phase"),
    R(f"plan --config {DIS} --gpus 8 --gpu-mem-gb 80 --trace", "--trace"),
    # dinopipe pipeline / slurm / gpu-check
    R(f"pipeline --config {PIPE} output_dir=@OUT nope=1", "nope"),
    R("pipeline --config no/such.yaml", "no/such.yaml"),
    R(f"pipeline --config {PIPE} output_dir=@OUT stages=[curate,pretrian]", "pretrian"),
    R(f"pipeline --config {PIPE} output_dir=@OUT pretrain.overrides=[optim.base_lr=-1]", "optim.base_lr"),
    R(f"pipeline --config {PIPE} output_dir=@FILE/run", "@FILE/run"),
    R("slurm submit --config no/such.yaml", "no/such.yaml"),
    R(f"slurm nope --config {SLURM}", "nope"),
    R(f"slurm submit --config {SLURM} --dry-run nope=1", "nope"),
    R("gpu-check --bogus", "--bogus"),
    R("gpu-check --cpu --out @FILE/gc", "@FILE/gc"),
    R("gpu-check --cpu --only nope --out @OUT", "nope"),
    # curate run and each step
    R(f"{_RUN} nope.key=1", "nope.key"),
    R(f"{_RUN} dedup.k=0", "dedup.k"),
    R(f"{_RUN} dedup.k=abc", "dedup.k"),
    R(f"{_RUN} input.paths=[/no/such]", "/no/such"),
    R(f"{_RUN} input.paths=[@EMPTY]", "@EMPTY"),
    R(f"{_RUN} input.paths=[@BAD]", "could be read", written=("*",)),
    R(f"{_RUN} output.dir=@FILE/out", "@FILE/out"),
    R("curate: run --config no/such.yaml input.paths=[@IMG] output.dir=@OUT", "no/such.yaml"),
    R(f"{_RUN} descriptor.pool_whiten=0.5", "descriptor.pool_whiten", written=("*",)),
    R(f"{_RUN} input.paths=[@POOL80] dedup.index=ivf_pq knn.pq_m=7", "knn.pq_m", written=("*",)),
    R(f"curate: dedup --config {CUR} input.paths=[@IMG] output.dir=@OUT", "embed", written=_CFG),
    R(f"curate: decontaminate --config {CUR} input.paths=[@IMG] output.dir=@OUT input.eval_paths=[@IMG]",
      "dedup", written=_CFG),
    R(f"curate: rebalance --config {CUR} input.paths=[@IMG] output.dir=@OUT", "decontaminate", written=(*_CFG, "steps")),
    R(f"curate: write --config {CUR} input.paths=[@IMG] output.dir=@OUT", "run", written=_CFG),
    R(f"curate: index --config {CUR} input.paths=[@IMG] output.dir=@OUT", "embed", written=_CFG),
    R(f"curate: search --config {CUR} input.paths=[@IMG] output.dir=@OUT", "embed", written=_CFG),
    R(f"curate: embed --config {CUR} input.paths=[@IMG] output.dir=@OUT embed.batch_size=0", "embed.batch_size"),
    R(f"curate: embed --config {CUR} input.paths=[@IMG] output.dir=@FILE/out", "@FILE/out"),
    R("curate: nope", "nope"),
    R("curate: plan --pool abc", "--pool"),
    R("curate: plan --dim 0", "--dim"),
    R("curate: plan --tasks 0", "--tasks"),
    R("curate: plan --pq-m 0", "--pq-m"),
    R("curate: plan --index ivf_pq --dim 100 --pq-m 64", "--pq-m"),
    R("curate: plan --k 0", "--k"),
    R("curate: simulate --n 0 --work @OUT", "--n"),
    R("curate: simulate --dim 0 --work @OUT", "--dim"),
    R("curate: simulate --tasks 0 --work @OUT", "--tasks"),
    R("curate: kmeans --emb-dir /no/such --out @OUT", "/no/such"),
]


def _fill(argv: list[str], assets: dict[str, str], out: Path) -> list[str]:
    names = {**assets, "OUT": str(out), "DENSE": str(out.parent / "no-dense-set")}
    filled = []
    for a in argv:
        for k in sorted(names, key=len, reverse=True):  # @BADCLS before @BAD
            a = a.replace(f"@{k}", names[k])
        filled.append(a)
    return filled


def test_the_table_is_big_enough_and_its_count_is_in_the_docs():
    from dinopipe.utils.exits import EXIT_UNFINISHED

    assert EXIT_UNFINISHED == 75
    assert len(ROWS) >= 80
    doc = (REPO / "docs" / "exit-codes.md").read_text()
    assert f"{len(ROWS)} rows" in doc and "| 75 |" in doc and f"command ({len(FAULTS)}," in doc


@pytest.mark.parametrize("argv, says, rc, written", ROWS)
def test_each_malformed_input_exits_with_its_code_and_one_clear_line(assets, tmp_path, capsys, monkeypatch, argv,
                                                                      says, rc, written):
    monkeypatch.chdir(REPO)
    out = tmp_path / "out"
    filled = _fill(argv, assets, out)
    got = call(filled)
    err = capsys.readouterr().err
    want = _fill([says], assets, out)[0]
    assert got == rc, f"exit {got}, want {rc}: {' '.join(filled)}\n{err[-3000:]}"
    assert want in err, f"stderr does not name {want!r}: {err[-3000:]}"
    if rc == 2:
        assert "Traceback" not in err and "please report" not in err, err[-3000:]
    if "*" not in written:
        assert not out.exists() or {p.name for p in out.iterdir()} <= written, sorted(os.listdir(out))


FAULTS = [  # (command line, module, attribute made to raise): one internal fault per command
    ("models", "dinopipe.models", "list_models"),
    ("config --kind model", "dinopipe.app.cli", "format_reference"),
    ("export --model vit_test --format timm --out @OUT", "dinopipe.export", "export"),
    ("channel-stats @IMG --channels 3", "dinopipe.data.channels", "channel_stats"),
    (_PRE, "dinopipe.train.pretrain", "validate_pretrain"),
    (_DIS, "dinopipe.train.distill", "validate"),
    (_KNN, "dinopipe.eval.cli", "run"),
    (_SEG, "dinopipe.eval.cli", "run_seg"),
    (_PLAN, "dinopipe.plan.cli", "plan"),
    (f"pipeline --config {PIPE} output_dir=@OUT", "dinopipe.app.pipeline", "validate"),
    (f"slurm submit --config {SLURM} --dry-run input_paths=[@IMG]", "dinopipe.app.slurm", "build_jobs"),
    ("gpu-check --cpu --out @OUT", "dinopipe.app.gpu_check", "run_checks"),
    (_RUN, "curation.pipeline", "run_step"),
    ("curate: plan --pool 1M", "curation.plan", "plan"),
    ("curate: simulate --n 10 --work @OUT", "curation.simulate.run", "simulate"),
    ("curate: kmeans --emb-dir @OUT --out @OUT", "curation.kmeans.dist", "main"),
]


@pytest.mark.parametrize("argv, module, attr", FAULTS, ids=[f[0] for f in FAULTS])
def test_an_internal_fault_in_each_command_exits_1_asking_for_a_report(assets, tmp_path, capsys, monkeypatch, argv,
                                                                        module, attr):
    import importlib

    def fault(*args, **kwargs):
        raise RuntimeError("injected internal fault")

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(importlib.import_module(module), attr, fault)
    got = call(_fill(argv.split(), assets, tmp_path / "out"))
    err = capsys.readouterr().err
    assert got == 1, f"exit {got}: {err[-3000:]}"
    assert "Traceback" in err and "injected internal fault" in err and "please report" in err, err[-3000:]


def test_a_part_a_killed_task_left_unwritten_exits_75_naming_it_and_saying_to_rerun(assets, tmp_path, capsys,
                                                                                     monkeypatch):
    """Embedding task 0 of 2 never ran (killed, or not started yet): dedup names the missing task and says to
    rerun, with its own code (75), neither "your mistake" (2) nor "please report" (1)."""
    monkeypatch.chdir(REPO)
    base = ["curate:", "--config", CUR, f"input.paths=[{assets['IMG']}]", f"output.dir={tmp_path / 'out'}",
            "embed.num_tasks=2", "rebalance.mode=none"]
    assert call([base[0], "embed", *base[1:], "embed.task_index=1"]) == 0
    capsys.readouterr()
    assert call([base[0], "dedup", *base[1:]]) == 75
    err = capsys.readouterr().err
    assert "tasks [0] of 2" in err and "rerun" in err and "unfinished" in err, err
    assert "Traceback" not in err and "please report" not in err and "error" not in err.split("unfinished")[0], err


@pytest.mark.parametrize("script, argv, says", [
    ("dinopipe", "eval knn --model vit_test --train @CLS --val @CLS --k 0", "--k"),
    ("dinopipe", "plan --config configs/pretrain/quickstart.yaml --gpus 0 --gpu-mem-gb 80", "--gpus"),
    ("curate", "plan --dim 0", "--dim"),
])
def test_console_scripts_keep_the_contract(assets, script, argv, says):
    """The installed entry points, not only main(): a fresh process, exit 2, one line, no traceback."""
    exe = Path(sys.executable).parent / script
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([str(exe), *_fill(argv.split(), assets, Path("/nonexistent/out"))], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len([line for line in r.stderr.splitlines() if "error" in line]) == 1, r.stderr
