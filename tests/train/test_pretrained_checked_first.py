"""A backbone file handed to a training stage (``model.pretrained=`` for pretraining, ``teacher_model.path=`` for
distillation) that is missing, not a checkpoint, truncated or pickled: exit 2 with one line naming the file,
before the process group starts and before anything is written (every rank checks it, headers only)."""

import pickle

import pytest
import torch

from dinopipe.export import save_backbone
from dinopipe.models import create_model
from tests.train.conftest import stage_cmd


class Payload:
    """Unpickling this would create the marker file."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def no_process_group(monkeypatch):
    """Fail the test if a stage gets as far as starting its process group."""
    import dinopipe.train.builders as builders
    import dinopipe.train.dist as dist
    import dinopipe.train.run as run

    def refuse(*a, **k):
        raise AssertionError("init_distributed was called before the backbone file was checked")

    for mod in (dist, builders, run):
        monkeypatch.setattr(mod, "init_distributed", refuse)


@pytest.fixture
def bad_files(tmp_path):
    """name -> (path given, path the error must name)."""
    good = save_backbone(create_model("vit_test"), tmp_path / "good")
    weights = good / "model.safetensors"
    out = {"missing": (tmp_path / "nothing_here.safetensors",) * 2}
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"this is not a checkpoint")
    out["garbage"] = (garbage, garbage)
    data = weights.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) // 2])  # a sound header whose tensors run past the end
    out["truncated"] = (truncated, truncated)
    export = tmp_path / "export_cut"  # an export folder (its config.json records the arch) with cut weights
    export.mkdir()
    (export / "config.json").write_text((good / "config.json").read_text())
    (export / "model.safetensors").write_bytes(data[: len(data) // 2])
    out["export_cut"] = (export, export / "model.safetensors")
    evil = tmp_path / "evil.pth"
    torch.save({"model": create_model("vit_test").state_dict(), "args": Payload(tmp_path / "PWNED")}, evil)
    out["pickled"] = (evil, evil)
    raw = tmp_path / "raw.pth"  # a plain pickle, not even a torch file
    raw.write_bytes(pickle.dumps(Payload(tmp_path / "PWNED")))
    out["raw_pickle"] = (raw, raw)
    return out


KINDS = ["missing", "garbage", "truncated", "export_cut", "pickled", "raw_pickle"]


def _run(stage, argv, capsys):
    if stage == "pretrain":
        from dinopipe.train.pretrain import main
    else:
        from dinopipe.train.distill import main
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    return exit_.value.code, capsys.readouterr().err


@pytest.mark.parametrize("kind", KINDS)
def test_pretrain_model_pretrained_checked_before_any_work(kind, bad_files, tmp_path, photo_pool, capsys,
                                                          no_process_group):
    given, named = bad_files[kind]
    out = tmp_path / "run"
    code, err = _run("pretrain", stage_cmd("pretrain", out, photo_pool, f"model.pretrained={given}")[3:], capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "model.pretrained" in lines[0] and str(named) in lines[0], err
    assert not out.exists()
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_distill_teacher_checked_before_any_work(kind, bad_files, tmp_path, photo_pool, capsys, no_process_group):
    given, named = bad_files[kind]
    out = tmp_path / "run"
    code, err = _run("distill", stage_cmd("distill", out, photo_pool, f"teacher_model.path={given}")[3:], capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "teacher_model.path" in lines[0] and str(named) in lines[0], err
    assert not out.exists()
    assert not (tmp_path / "PWNED").exists()


def test_a_students_pretrained_key_is_refused_not_ignored(bad_files, tmp_path, photo_pool, capsys,
                                                          no_process_group):
    good = tmp_path / "good"
    out = tmp_path / "run"
    argv = stage_cmd("distill", out, photo_pool, f"teacher_model.path={good}",
                     f"students=[{{name: s1, model: {{name: vit_test, pretrained: {good}}}}}]")[3:]
    code, err = _run("distill", argv, capsys)
    assert code == 2 and "students[0].model.pretrained" in err, err
    assert not out.exists()


def test_a_sound_export_passes_the_check_and_its_patch_size_is_used(tmp_path, photo_pool):
    """The check refuses nothing genuine, and crops are tiled against the file's patch size (16 here), not the
    registry name's (vit_test: 14)."""
    from dinopipe.config import ConfigError, load_config
    from dinopipe.ssl.config import PretrainConfig
    from dinopipe.train.checks import validate_pretrain

    good = save_backbone(create_model("vit_test", patch_size=16, img_size=64), tmp_path / "p16")
    cmd = stage_cmd("pretrain", tmp_path / "run", photo_pool, f"model.pretrained={good}")
    yaml, base = cmd[4], cmd[5:]
    tiled = ["phases=[{name: base, fraction: 1.0, global_crops_size: 64, local_crops_size: 32, "
             "batch_size_per_gpu: 4}]"]
    validate_pretrain(load_config(PretrainConfig, yaml, [*base, *tiled]))
    with pytest.raises(ConfigError, match="multiple of the backbone in .*patch size 16"):
        validate_pretrain(load_config(PretrainConfig, yaml, base))  # 56 / 28 px crops: 14 px patches
    assert not (tmp_path / "run").exists()
