"""Students of any architecture: a ConvNeXt and a ResNet (timm, random init) distilled next to a ViT student in
one run, on 1 process and on 2 (FSDP2), exported, loaded back and kNN-evaluated by the pipeline's eval; bad
student specs exit 2 before any work."""

import types

import pytest
import torch

import dinopipe
from dinopipe.config import ConfigError, load_config
from dinopipe.hub import export_dinov2
from dinopipe.models import TimmBackbone, create_model
from dinopipe.ssl.distill_config import DistillConfig
from dinopipe.train import distill
from dinopipe.train.distill import validate
from tests.train.conftest import REPO, TINY_DISTILL, metrics, run_distill

STUDENTS = ("students=[{name: cnx, model: {name: 'timm:convnext_atto', img_size: 64}},"
            " {name: rn, model: {name: 'timm:resnet10t', img_size: 64}},"
            " {name: vit, model: {name: vit_test, patch_size: 16, embed_dim: 32, num_heads: 1, depth: 2, img_size: 64}}]")
PHASE = "phases=[{{name: base, fraction: 1.0, global_crops_size: 64, local_crops_size: 32, batch_size_per_gpu: {b}}}]"
# 64 px global crops (a 4 x 4 grid of the patch-16 teacher, 2 x 2 of both CNNs) and two 32 px local crops (1 x 1)
COMMON = (STUDENTS, "crops.local_crops_number=2", "train.checkpoint_every=100", "teacher.momentum_teacher=0.5",
          "teacher.final_momentum_teacher=0.9")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A 'released' patch-16 backbone without heads (feature distillation), far from its init."""
    torch.manual_seed(1)
    t = create_model("vit_test_reg4", img_size=64, patch_size=16, embed_dim=128, num_heads=2, init_values=1.0).eval()
    with torch.no_grad():
        for p in t.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return export_dinov2(t, tmp_path_factory.mktemp("released") / "teacher.pth")


def _cfg(teacher, *overrides):
    return load_config(DistillConfig, str(REPO / "configs/distill/quickstart.yaml"),
                       [*TINY_DISTILL, f"teacher_model.path={teacher}", f"data.paths=[{teacher.parent}]", *overrides])


def test_bad_student_specs_are_config_errors(teacher):
    validate(_cfg(teacher, STUDENTS, PHASE.format(b=4)))  # the good one passes
    bad = {
        "students=[{name: c, model: {name: 'timm:convnext_nope'}}]": "timm has no model 'convnext_nope'",
        "students=[{name: c, model: {name: 'timm:'}}]": "names no timm model",
        "students=[{name: c, model: {name: resnet18}}]": "or any timm model as timm:NAME",
        "students=[{name: c, model: {name: 'timm:resnet18', embed_dim: 64}}]":
            r"students\[0\].model.embed_dim: a ViT setting, but timm:resnet18 is a timm model",
    }
    for override, msg in bad.items():
        with pytest.raises(ConfigError, match=msg):
            validate(_cfg(teacher, override, PHASE.format(b=4)))
    with pytest.raises(ConfigError, match=r"students\[0\].model.name: 'timm:convnext_atto' is not a ViT.*mode=feature"):
        validate(_cfg(teacher, STUDENTS, PHASE.format(b=4), "mode=ssl"))
    # 16 px local crops tile the teacher's patches but are below a CNN's total stride of 32: no output token
    small = "phases=[{name: base, fraction: 1.0, global_crops_size: 64, local_crops_size: 16, batch_size_per_gpu: 4}]"
    with pytest.raises(ConfigError, match="crop size 16 is below the total stride 32 of student timm:convnext_atto"):
        validate(_cfg(teacher, "students=[{name: c, model: {name: 'timm:convnext_atto'}}]", small))
    validate(_cfg(teacher, "students=[{name: c, model: {name: 'timm:convnext_atto'}}]", small,
                  "crops.local_crops_number=0"))  # no local crops: fine


@pytest.mark.parametrize("overrides, msg", [
    (["students=[{name: c, model: {name: 'timm:resnet_nope'}}]"], "students[0].model.name: timm has no model 'resnet_nope'"),
    ([STUDENTS, "mode=ssl"], "students[0].model.name: 'timm:convnext_atto' is not a ViT"),
])
def test_bad_timm_students_exit_2_before_anything_is_written(tmp_path, teacher, capsys, overrides, msg):
    out = tmp_path / "run"
    argv = ["--config", str(REPO / "configs/distill/quickstart.yaml"), *TINY_DISTILL, f"data.paths=[{tmp_path}]",
            f"train.output_dir={out}", f"teacher_model.path={teacher}", PHASE.format(b=4), *overrides]
    with pytest.raises(SystemExit) as exc:
        distill.main(argv)
    assert exc.value.code == 2 and msg in capsys.readouterr().err
    assert not out.exists()


@pytest.fixture(scope="module")
def single(tmp_path_factory, photo_pool, teacher):
    run = tmp_path_factory.mktemp("single")
    run_distill(run, photo_pool, f"teacher_model.path={teacher}", "train.epochs=2", *COMMON, PHASE.format(b=8))
    return run


@pytest.mark.slow
def test_cnn_and_vit_students_train_export_and_load(single, tmp_path):
    rows = metrics(single)
    assert len(rows) == 8
    for s in ("cnx", "rn", "vit"):  # feature mode (a bare teacher): pooled + dense terms for every student
        assert all(torch.isfinite(torch.tensor([r[f"{s}/cls_loss"], r[f"{s}/patch_loss"]])).all() for r in rows)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    for name, dim in (("cnx", 320), ("rn", 512)):
        exported = dinopipe.load(single, which=name)
        assert isinstance(exported, TimmBackbone) and exported.embed_dim == dim
        ckpt = dinopipe.load(single / "checkpoints" / "step_00000008", which=name)  # the EMA in the DCP checkpoint
        with torch.no_grad():
            torch.testing.assert_close(exported(x), ckpt(x), atol=1e-5, rtol=0)
    # the EMA carries the BatchNorm statistics the student gathered (left at init they would be 0 / 1): one
    # train-mode forward per crop size and step (global, local), 8 steps
    rn = dinopipe.load(single, which="rn")
    assert rn.model.bn1.running_mean.abs().max() > 0 and int(rn.model.bn1.num_batches_tracked) == 16


@pytest.mark.slow
def test_pipeline_knn_eval_lists_cnn_students_next_to_the_vit(single, teacher, tmp_path):
    from dinopipe.data.samples import build_eval_set
    from dinopipe.app.pipeline import run_eval

    sets = build_eval_set(tmp_path, n_train=4, n_val=2, size=72)
    cfg = types.SimpleNamespace(eval=types.SimpleNamespace(img_size=64, k=[5]))
    paths = types.SimpleNamespace(pretrain=teacher, distill=single, eval=tmp_path / "eval.json",
                                  eval_train=sets["train"], eval_val=sets["val"])
    assert run_eval(cfg, paths) == 0
    import json

    top1 = json.loads(paths.eval.read_text())["knn_top1"]
    for s in ("cnx", "rn", "vit"):
        assert 0 <= top1[f"student {s}"]["5"] <= 1 and f"random init (student {s} arch)" in top1


@pytest.mark.slow
@pytest.mark.dist
def test_fsdp2_two_processes(single, tmp_path, photo_pool, teacher):
    """fully_shard wraps each CNN stage and the root like a ViT's blocks. ConvNeXt (LayerNorm) and the ViT train as
    in one process with the same global batch; the ResNet's BatchNorm normalises each rank's own 4 images (no
    SyncBatchNorm on CPU), so its losses differ by design and are only checked to be finite."""
    run = tmp_path / "fsdp"
    run_distill(run, photo_pool, f"teacher_model.path={teacher}", "train.epochs=2", *COMMON, PHASE.format(b=4),
                nproc=2)
    ref, got = metrics(single), metrics(run)
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(8))
    for a, b in zip(ref, got):
        for key in ("cnx/loss", "vit/loss"):
            assert b[key] == pytest.approx(a[key], rel=2e-4), (a["step"], key)
        assert torch.isfinite(torch.tensor(b["rn/loss"]))
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(dinopipe.load(single, which="cnx")(x), dinopipe.load(run, which="cnx")(x),
                                   atol=2e-4, rtol=2e-4)
    assert isinstance(dinopipe.load(run, which="rn"), TimmBackbone)
