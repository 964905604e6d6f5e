"""The SSL task in one process: a few steps on a fixed batch of real photos reduce the loss; the EMA teacher
follows the student; masked patches reach the iBOT loss."""

import glob

import pytest
import torch
from PIL import Image

from dinopipe.config import load_config
from dinopipe.data.transforms import MultiCropAugmentation, MultiCropCollator
from dinopipe.ssl.config import PretrainConfig
from dinopipe.ssl.param_groups import build_param_groups
from dinopipe.ssl.task import SSLTask
from tests.train.conftest import REPO, TINY


@pytest.fixture(scope="module")
def batch(photo_pool):
    aug = MultiCropAugmentation(global_size=56, local_size=28, n_local=2)
    imgs = [Image.open(p).convert("RGB") for p in sorted(glob.glob(f"{photo_pool}/*.jpg"))[:8]]
    return MultiCropCollator(14, mask_probability=0.5)([aug(im, seed=i) for i, im in enumerate(imgs)])


def make_task(*overrides):
    torch.manual_seed(0)
    cfg = load_config(PretrainConfig, REPO / "configs/pretrain/quickstart.yaml", [*TINY, "data.paths=[x]", *overrides])
    return SSLTask(cfg)


def test_steps_on_a_fixed_batch_reduce_the_loss(batch):
    task = make_task("dino.koleo_loss_weight=0.0")
    opt = torch.optim.AdamW(build_param_groups(task.student), lr=1e-3)
    values = {"teacher_temp": 0.04, "momentum": 0.0}  # momentum 0: teacher = student after each step
    history = []
    for _ in range(8):
        opt.zero_grad()
        loss, logs = task(batch, values)
        loss.backward()
        opt.step()
        task.after_step(values)
        history.append(float(loss.detach()))
    assert logs["n_masked"] > 0 and float(logs["ibot_loss"]) > 0
    assert history[-1] < history[0] - 0.05, history


def test_ema_teacher_moves_toward_student(batch):
    task = make_task()
    with torch.no_grad():
        for p in task.student.parameters():
            p.add_(1.0)
    before = [p.clone() for p in task.teacher.parameters()]
    task.after_step({"momentum": 0.9})
    for b, t, s in zip(before, task.teacher.parameters(), task.student.parameters()):
        torch.testing.assert_close(t, 0.9 * b + 0.1 * s)
    assert not any(p.requires_grad for p in task.teacher.parameters())


def test_separate_ibot_head_and_sinkhorn_knopp_single_process(batch):
    task = make_task("ibot.separate_head=true", "teacher.centering=sinkhorn_knopp")
    assert "ibot_head" in task.student
    loss, logs = task(batch, {"teacher_temp": 0.07, "momentum": 0.99})
    loss.backward()
    assert torch.isfinite(loss)
    assert task.student["ibot_head"].last_layer.weight.grad is not None
