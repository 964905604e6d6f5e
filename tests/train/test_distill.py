"""Distillation: students move toward the teacher, several at once, resumable, teacher never saved."""

import glob

import numpy as np
import pytest
import torch
from PIL import Image
from torch.distributed.checkpoint import FileSystemReader

import dinopipe
from dinopipe.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from dinopipe.hub import export_dinov2
from dinopipe.models import create_model
from tests.train.conftest import losses, metrics, run_distill, run_pretrain

pytestmark = pytest.mark.slow


def linear_agreement(student: torch.Tensor, teacher: torch.Tensor, lam: float = 1e-2) -> float:
    """How well a linear map of the student's features predicts the teacher's on held-out images: ridge
    regression fitted on half the images, mean cosine on the other half. Students are narrower than the
    teacher, so agreement is measured up to a linear map (what the distillation projection learns)."""
    n = len(student)
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    fit, held = idx[: n // 2], idx[n // 2 :]
    x = torch.cat([student, torch.ones(n, 1)], 1)
    w = torch.linalg.solve(x[fit].T @ x[fit] + lam * torch.eye(x.shape[1]), x[fit].T @ teacher[fit])
    return float(torch.nn.functional.cosine_similarity(x[held] @ w, teacher[held]).mean())


def features(model, images):
    with torch.no_grad():
        return model(images)


@pytest.fixture(scope="module")
def eval_images(photo_pool):
    """6 random 56 px crops of each real photo (~190 images), normalised as the models expect."""
    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    g = torch.Generator().manual_seed(0)
    out = []
    for p in sorted(glob.glob(f"{photo_pool}/*.jpg")):
        img = torch.from_numpy(np.array(Image.open(p).convert("RGB").resize((112, 112)))).permute(2, 0, 1) / 255
        for _ in range(6):
            y, x = torch.randint(0, 57, (2,), generator=g).tolist()
            out.append((img[:, y : y + 56, x : x + 56] - mean) / std)
    return torch.stack(out)


@pytest.fixture(scope="module")
def released_teacher(tmp_path_factory):
    """A 'released' backbone: DINOv2 key layout, no heads (as the official hub files)."""
    torch.manual_seed(1)
    teacher = create_model("vit_test_reg4", img_size=56, embed_dim=128, num_heads=2, init_values=1.0).eval()
    with torch.no_grad():  # far from init: a random init's features are nearly linear in the pixels, which
        for p in teacher.parameters():  # any random student already matches (linear CKA ~0.9)
            p.add_(torch.randn_like(p) * 0.2)
    path = export_dinov2(teacher, tmp_path_factory.mktemp("released") / "dinov2_vitt14_reg4.pth")
    return teacher, path


def test_feature_distillation_from_released_backbone_raises_agreement(tmp_path, photo_pool, released_teacher,
                                                                      eval_images):
    teacher, path = released_teacher
    run = tmp_path / "feat"
    # A short EMA (momentum 0.5 -> 0.9): with DINOv2's 0.994 -> 1 the kept EMA barely leaves init in 32 steps.
    run_distill(run, photo_pool, f"teacher_model.path={path}", "train.epochs=8", "optim.base_lr=0.01",
                "train.checkpoint_every=100", "teacher.momentum_teacher=0.5", "teacher.final_momentum_teacher=0.9")
    rows = metrics(run)
    assert all("s1/cls_loss" in r and "s2/patch_loss" in r for r in rows)  # feature mode was chosen (no heads)
    t = features(teacher, eval_images)
    torch.manual_seed(0)  # the students' initial weights, as the run built them (seed 0, same order)
    init = create_model("vit_test", embed_dim=32, num_heads=1, depth=2, img_size=56).eval()
    before = linear_agreement(features(init, eval_images), t)
    after = linear_agreement(features(dinopipe.load(run / "export" / "s1"), eval_images), t)
    assert after > before + 0.03, (before, after)  # measured: 0.76 -> 0.84


def test_two_students_resume_and_teacher_never_saved(tmp_path, photo_pool):
    teacher_run = tmp_path / "teacher"
    run_pretrain(teacher_run, photo_pool, "train.epochs=1")  # a dinopipe run: heads exported -> ssl mode
    args = (f"teacher_model.path={teacher_run}", "train.epochs=2", "train.checkpoint_every=100")
    ref, run = tmp_path / "ref", tmp_path / "split"
    run_distill(ref, photo_pool, *args)
    run_distill(run, photo_pool, *args, "train.stop_after=3")
    r = run_distill(run, photo_pool, *args)
    assert "resuming from checkpoint at step 3" in r.stderr
    assert {"s1/dino_loss", "s1/ibot_loss", "s2/dino_loss"} <= set(metrics(run)[0])  # ssl mode
    got, want = losses(run), losses(ref)
    assert sorted(got) == list(range(8))
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), step
    for name, dim in (("s1", 32), ("s2", 48)):
        assert dinopipe.load(run / "export" / name).embed_dim == dim
    keys = FileSystemReader(str(run / "checkpoints" / "step_00000008")).read_metadata().state_dict_metadata
    assert any(k.startswith("student.s1.") for k in keys) and any(k.startswith("ema.s2.") for k in keys)
    # Only students, their EMAs and the loss centres ('loss_state.*.teacher.*' is the centring state).
    assert {k.split(".")[0] for k in keys} == {"trainer", "student", "ema", "loss_state"}
    assert not any("backbone" in k for k in keys if not k.startswith(("student.", "ema.")))


def test_koleo_in_ssl_distillation_and_refused_in_feature_mode(tmp_path, photo_pool, released_teacher):
    teacher_run = tmp_path / "teacher"
    run_pretrain(teacher_run, photo_pool, "train.epochs=1")
    run = tmp_path / "koleo"
    run_distill(run, photo_pool, f"teacher_model.path={teacher_run}", "train.epochs=1", "dino.koleo_loss_weight=0.1")
    rows = metrics(run)
    assert all(np.isfinite(r["s1/koleo_loss"]) for r in rows)
    # loss = dino + ibot + 0.1 * koleo, per student
    r = rows[-1]
    assert r["s1/loss"] == pytest.approx(r["s1/dino_loss"] + r["s1/ibot_loss"] + 0.1 * r["s1/koleo_loss"], rel=1e-4)
    _, path = released_teacher  # no heads: feature distillation has no KoLeo term, so the key is refused
    bad = run_distill(tmp_path / "bad", photo_pool, f"teacher_model.path={path}", "dino.koleo_loss_weight=0.1",
                      check=False)
    assert bad.returncode == 2 and "dino.koleo_loss_weight" in bad.stderr


def test_patch16_student_of_patch14_teacher(tmp_path, photo_pool, released_teacher):
    _, path = released_teacher
    run = tmp_path / "p16"
    run_distill(run, photo_pool, f"teacher_model.path={path}", "train.epochs=1", "crops.local_crops_number=0",
                "students=[{name: p16, model: {name: vit_test, patch_size: 16, img_size: 112}}]",
                "phases=[{name: base, fraction: 1.0, global_crops_size: 112, local_crops_size: 32, batch_size_per_gpu: 4}]")
    assert dinopipe.load(run / "export" / "p16").patch_size == 16


def test_crop_not_tiling_patches_is_a_config_error(tmp_path, photo_pool, released_teacher):
    _, path = released_teacher
    r = run_distill(tmp_path / "bad", photo_pool, f"teacher_model.path={path}",
                    "students=[{name: p16, model: {name: vit_test, patch_size: 16}}]", check=False)
    assert r.returncode == 2 and "not a multiple of patch size" in r.stderr
