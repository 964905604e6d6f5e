"""The recipe switches a user can flip: the prototype layer per family, per-module clip groups, DINOv3's
local-crop reweighting and its high-resolution lr rise (each default is the official behaviour)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dinopipe.config import load_config
from dinopipe.ssl.base import build_head, head_config
from dinopipe.ssl.config import HeadConfig, PretrainConfig
from dinopipe.ssl.losses import DINOLoss
from dinopipe.train.builders import build_schedules


@pytest.mark.parametrize("kind", ["weight_norm", "weight_norm_fixed", "linear"])
def test_each_prototype_layer_rebuilds_as_itself(kind):
    head = build_head(16, HeadConfig(n_prototypes=12, hidden_dim=8, bottleneck_dim=4, nlayers=2, last_layer=kind))
    x = torch.randn(5, 16)
    before = head(x).detach()
    with torch.no_grad():
        head.last_layer.weight.mul_(3.0)  # a plain linear layer sees the scale, weight norm does not
    torch.testing.assert_close(head(x), before * (3.0 if kind == "linear" else 1.0))
    assert head_config(head.state_dict()).last_layer == kind
    back = build_head(state_dict=head.state_dict())
    torch.testing.assert_close(back(x), head(x))
    trained = {n for n, p in head.named_parameters()}
    assert ("last_layer_gain" in trained) == (kind == "weight_norm")  # DINOv2 trains the gain


def test_clip_groups_are_each_module_unless_switched_off():
    from dinopipe.ssl.task import SSLTask

    cfg = PretrainConfig()
    cfg.model.name = "vit_test"
    cfg.dino.head = cfg.ibot.head = HeadConfig(n_prototypes=16, hidden_dim=8, bottleneck_dim=4)
    cfg.ibot.separate_head = True
    task = SSLTask(cfg)
    sizes = [len(g) for g in task.clip_groups()]
    assert sizes == [len(list(task.student[k].parameters())) for k in ("backbone", "dino_head", "ibot_head")]
    cfg.optim.clip_per_module = False
    assert [len(g) for g in task.clip_groups()] == [len(list(task.student.parameters()))]


def test_local_crop_terms_are_reweighted():
    loss = DINOLoss(8, centering="centering")
    torch.manual_seed(0)
    g, t, loc = torch.randn(4, 8), torch.softmax(torch.randn(4, 8), -1), torch.randn(6, 8)
    _, parts = loss(g, t, loc, return_parts=True)
    half, parts_half = loss(g, t, loc, return_parts=True, local_weight=0.5)
    assert float(half) == pytest.approx(float(parts["dino_global"] + 0.5 * parts["dino_local"]), rel=1e-6)
    assert float(parts_half["dino_local"]) == pytest.approx(0.5 * float(parts["dino_local"]), rel=1e-6)


def test_dinov3_stage_schedules():
    """Gram stage: local weight 1 -> 0.5 over one epoch when the Gram stage starts; high-res adaptation: lr rises
    from 0 to its peak along half a cosine over 10 epochs, local weight 0.5 throughout (the official YAMLs)."""
    base = load_config(PretrainConfig, "configs/pretrain/vitl16_dinov3.yaml", ["train.epochs=202", "train.epoch_length=10"])
    w = build_schedules(base, world_size=1)["dino_local_weight"]
    assert np.all(w[:2000] == 1.0) and w[2000] == 1.0 and 0.5 < w[2005] < 1.0 and np.all(w[2010:] == 0.5)
    hi = load_config(PretrainConfig, "configs/pretrain/vitl16_dinov3_highres.yaml",
                     ["train.epochs=30", "train.epoch_length=10"])
    s = build_schedules(hi, world_size=4)
    lr, peak = s["lr"], s["lr"].max()
    assert lr[0] == 0.0 and np.all(np.diff(lr[:100]) > 0) and np.all(lr[100:] == peak)
    # half a cosine sampled as DINOv3 samples it (schedule_shape dinov3: np.linspace(0, pi, 100))
    np.testing.assert_allclose(lr[50], peak * (1 - np.cos(np.pi * 50 / 99)) / 2, rtol=1e-12)
    assert np.all(s["dino_local_weight"] == 0.5)


def test_dinov3_gram_stage_has_its_own_momentum_and_constant_lr():
    """DINOv3 ran pretraining (lr 5e-5, momentum 0.994) and then the Gram stage (gram_anchor.yaml: lr 3e-5, momentum
    0.999, both constant); ``phases[].momentum_teacher`` and a later phase's own peak under ``lr_schedule: constant``
    give the same two stages in one run. The high-resolution stage holds 0.999 throughout."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(PretrainConfig, str(root / "configs/pretrain/vitl16_dinov3.yaml"), [])
    s = build_schedules(cfg, world_size=4)
    g = cfg.gram.first_step
    assert (s["momentum"][:g] == 0.994).all() and (s["momentum"][g:] == 0.999).all()
    assert s["lr"][g] == pytest.approx(0.6 * s["lr"][g - 1]) and np.ptp(s["lr"][g:]) == 0
    hr = load_config(PretrainConfig, str(root / "configs/pretrain/vitl16_dinov3_highres.yaml"), [])
    assert (build_schedules(hr, world_size=2)["momentum"] == 0.999).all()
    cfg.phases[1].momentum_teacher = None  # null: the run's schedule goes on
    assert (build_schedules(cfg, world_size=4)["momentum"] == 0.994).all()
