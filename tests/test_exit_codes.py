"""Every command follows one table of exit codes (docs/exit-codes.md): 0 done, 2 a mistake in the user's input or
config (caught before anything is written), 3 non-finite loss, 124 preempted and resumable, 1 a bug to report.
Here: each command's typical mistakes exit 2 with a message naming what is wrong, and leave nothing behind.
(3 and 124 are pinned by tests/train/test_loop*.py and tests/train/test_preemption.py.)"""

from pathlib import Path

import pytest

from dinopipe.app.cli import main

REPO = Path(__file__).resolve().parents[1]
QUICK = str(REPO / "configs/pipeline/quickstart.yaml")


def code(argv) -> int:
    """The exit code of `dinopipe ARGV` run in this process (argparse and config errors raise SystemExit)."""
    try:
        return main(list(argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1


def test_the_table_in_the_docs_is_the_one_the_code_uses():
    from dinopipe.config import EXIT_CONFIG_ERROR
    from dinopipe.train.builders import EXIT_NON_FINITE
    from dinopipe.train.signals import EXIT_PREEMPTED

    table = (REPO / "docs" / "exit-codes.md").read_text()
    for c in (0, 1, EXIT_CONFIG_ERROR, EXIT_NON_FINITE, EXIT_PREEMPTED):
        assert f"| {c} |" in table
    assert (EXIT_CONFIG_ERROR, EXIT_NON_FINITE, EXIT_PREEMPTED) == (2, 3, 124)




@pytest.mark.parametrize("overrides, says", [
    (["pretrain.overrides=[optim.base_lr=-1]"], "optim.base_lr"),  # a bad value, not only a bad key
    (["pretrain.overrides=[optim.base_lr_typo=1]"], "base_lr_typo"),
    (["distill.overrides=[students=[]]"], "students"),
    (["curate.overrides=[dedup.k=0]"], "dedup.k"),
    (["sample.enabled=false", "input.paths=[/no/such/folder]"], "/no/such/folder"),
    (["sample.enabled=false", "input.paths=[EMPTY]"], "no image in"),
    (["stages=[curate,pretrian]"], "pretrian"),
])
def test_pipeline_mistakes_exit_2_before_any_stage_runs(tmp_path, capsys, overrides, says):
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (empty / "notes.txt").write_text("not an image")
    rc = code(["pipeline", "--config", QUICK, f"output_dir={tmp_path / 'run'}",
               *[o.replace("EMPTY", str(empty)) for o in overrides]])
    out, err = capsys.readouterr()
    assert rc == 2, out + err
    assert says in err and "== curate" not in out
    assert not (tmp_path / "run").exists()  # no pipeline.yaml, no sample pool: nothing written


def test_curate_run_on_a_folder_without_images_exits_2_naming_it(tmp_path, capsys):
    empty = tmp_path / "photos"
    empty.mkdir()
    (empty / "readme.txt").write_text("no images here")
    out = tmp_path / "out"
    rc = code(["curate", "run", "--config", "configs/curation/quickstart.yaml", f"input.paths=[{empty}]",
               f"output.dir={out}"])
    err = capsys.readouterr().err
    assert rc == 2 and str(empty) in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() and "matplotlib" not in err.lower()


@pytest.mark.parametrize("argv, says", [
    (["export", "--model", "runs/nothing", "--format", "timm", "--out", "OUT"], "runs/nothing"),
    (["export", "--model", "vit_test", "--format", "nope", "--out", "OUT"], "--format"),
    (["export", "--model", "vit_test", "--format", "timm", "--out", "OUT", "--image-size", "56"], "--image-size"),
    (["pretrain", "--config", "configs/pretrain/quickstart.yaml", "data.paths=[.]", "optim.lrr=1"], "optim.lrr"),
    (["pretrain", "--config", "configs/pretrain/quickstart.yaml", "data.paths=[.]", "model.name=vit_nope"], "vit_nope"),
    (["pretrain", "--config", "no/such.yaml"], "no/such.yaml"),
    (["distill", "--config", "configs/distill/quickstart.yaml", "teacher_model.path=runs/nothing",
      "data.paths=[.]"], "teacher_model.path"),
    (["curate", "run", "--config", "configs/curation/quickstart.yaml", "input.paths=[/no/such]", "output.dir=OUT"],
     "/no/such"),
    (["curate", "dedup", "--config", "configs/curation/quickstart.yaml", "input.paths=[.]", "output.dir=OUT"],
     "embed"),  # a step before the one it needs: says what to run first
    (["eval", "knn", "--model", "vit_test", "--train", "/no/such", "--val", "/no/such"], "/no/such"),
    (["config", "--kind", "pretrain", "optim.nope=1"], "optim.nope"),
    (["config", "--kind", "nope"], "--kind"),
    (["slurm", "submit", "--config", "no/such.yaml"], "no/such.yaml"),
    (["plan", "--config", "no/such.yaml", "--gpus", "8", "--gpu-mem-gb", "80"], "no/such.yaml"),
    (["nosuchcommand"], "nosuchcommand"),
])
def test_every_commands_typical_mistakes_exit_2(tmp_path, capsys, argv, says):
    out = tmp_path / "out"
    rc = code([a.replace("OUT", str(out)) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and says in err, (rc, err)
    # nothing written (a curation step run too early leaves only its resolved config.yaml)
    assert not out.exists() or {p.name for p in out.iterdir()} <= {"config.yaml"}


# -- issue 31: 2 only for the user's mistakes, each naming what is wrong; anything else 1, "please report" --------

def test_curate_run_on_a_folder_of_unreadable_files_exits_2_with_the_manifest_written(tmp_path, capsys):
    photos = tmp_path / "photos"
    photos.mkdir()
    for i in range(3):
        (photos / f"{i}.jpg").write_bytes(b"not a jpeg " * (i + 1))
    out = tmp_path / "out"
    rc = code(["curate", "run", "--config", "configs/curation/quickstart.yaml", f"input.paths=[{photos}]",
               f"output.dir={out}"])
    err = capsys.readouterr().err
    assert rc == 2 and str(photos) in err and "could be read" in err, err
    assert (out / "manifest.json").exists()  # it lists why each file was refused


@pytest.mark.parametrize("raised, rc, says", [
    ("ConfigError", 2, "curate embed: error: embed.model: wrong"),  # the user's: one line naming the key
    ("RuntimeError", 1, "please report"),  # faiss / torch / our own internals: a bug, with its traceback
    ("ValueError", 1, "please report"),
])
def test_curate_step_errors_are_the_users_only_when_they_say_so(tmp_path, capsys, monkeypatch, raised, rc, says):
    import curation.pipeline
    from dinopipe.config import ConfigError

    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / "a.jpg").write_bytes(b"x")
    exc = {"ConfigError": ConfigError, "RuntimeError": RuntimeError, "ValueError": ValueError}[raised]

    def fail(step, *a, **k):
        raise exc("embed.model: wrong" if raised == "ConfigError" else "faiss: internal assertion")

    monkeypatch.setattr(curation.pipeline, "run_step", fail)
    got = code(["curate", "embed", "--config", "configs/curation/quickstart.yaml", f"input.paths=[{photos}]",
                f"output.dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert got == rc and says in err, err
    assert ("Traceback" in err) == (rc == 1)


def test_plan_trace_with_an_unknown_phase_exits_2_naming_it(capsys):
    rc = code(["plan", "--config", "configs/pretrain/quickstart.yaml", "--gpus", "1", "--gpu-mem-gb", "80",
               "--trace", "--phase", "typo"])
    err = capsys.readouterr().err
    assert rc == 2 and "--phase" in err and "typo" in err and "Traceback" not in err, err


def test_curate_kmeans_on_a_wrong_emb_dir_exits_2_without_a_traceback(tmp_path, capsys):
    from curation.cli import main as curate_main

    rc = curate_main(["kmeans", "--emb-dir", str(tmp_path / "wrong"), "--out", str(tmp_path / "km")])
    err = capsys.readouterr().err
    assert rc == 2 and "--emb-dir" in err and str(tmp_path / "wrong") in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1


def test_eval_linear_with_too_few_images_per_class_exits_2_naming_holdout(tmp_path, capsys):
    from PIL import Image

    for split in ("train", "val"):
        for c in ("a", "b"):
            (tmp_path / split / c).mkdir(parents=True)
            Image.new("RGB", (28, 28), (100, 60 if c == "a" else 10, 30)).save(tmp_path / split / c / "0.png")
    rc = code(["eval", "linear", "--model", "vit_test", "--train", str(tmp_path / "train"), "--val",
               str(tmp_path / "val"), "--device", "cpu", "--workers", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "--holdout" in err and "Traceback" not in err, err


def test_continuing_a_named_architecture_from_bare_weights_takes_its_head_count(tmp_path):
    """model.name=vit_test model.pretrained=<a state dict of it>: the file records no head count and 64 is no
    released width, but the config names the architecture, so its head count is used (a width the name does
    not have still refuses)."""
    import torch

    from dinopipe import hub
    from dinopipe.config import ConfigError, ModelConfig
    from dinopipe.models import create_model
    from dinopipe.ssl.config import PretrainConfig
    from dinopipe.train.checks import check_pretrained

    sd = create_model("vit_test").state_dict()
    torch.save(sd, tmp_path / "w.pth")
    cfg = PretrainConfig(model=ModelConfig(name="vit_test", pretrained=str(tmp_path / "w.pth")))
    check_pretrained(cfg)
    assert cfg.model.num_heads == 2
    model = hub.load(str(tmp_path / "w.pth"), num_heads=cfg.model.num_heads)
    assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items() if k in sd)
    with pytest.raises(ConfigError, match="head count"):
        check_pretrained(PretrainConfig(model=ModelConfig(name="vit_small", pretrained=str(tmp_path / "w.pth"))))


def test_a_bug_in_a_dinopipe_command_exits_1_asking_for_a_report(capsys, monkeypatch):
    import dinopipe.app.cli

    def broken(args):
        raise KeyError("an internal table lookup")

    monkeypatch.setattr(dinopipe.app.cli, "_cmd_config", broken)
    rc = code(["config", "--kind", "model"])
    err = capsys.readouterr().err
    assert rc == 1 and "please report" in err and "Traceback" in err and "KeyError" in err, err
