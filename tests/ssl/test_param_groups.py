"""AdamW parameter groups on the real vit_test student (backbone + DINO head): layer-wise lr decay by block
depth with the patch-embed multiplier, no weight decay on biases / norms / LayerScale / tokens, the head's
last layer flagged, and the per-step schedule applied to the optimizer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dinopipe.models import create_model
from dinopipe.models.head import DINOHead
from dinopipe.ssl.param_groups import (
    apply_optim_schedules,
    build_param_groups,
    clean_name,
    param_specs,
    vit_lr_decay_rate,
)


@pytest.fixture(scope="module")
def student():
    torch.manual_seed(0)
    backbone = create_model("vit_test_reg4")
    return nn.ModuleDict({
        "backbone": backbone,
        "dino_head": DINOHead(64, out_dim=32, hidden_dim=32, bottleneck_dim=16, norm_last_layer=False),
    })


def test_layer_decay_and_weight_decay_per_parameter(student):
    r, n = 0.9, 4
    specs = {s.name: s for s in param_specs(student, lr_decay_rate=r, patch_embed_lr_mult=0.2)}
    assert set(specs) == {name for name, p in student.named_parameters()}
    lr = {k: s.lr_multiplier for k, s in specs.items()}
    assert lr["backbone.cls_token"] == pytest.approx(r ** (n + 1))
    assert lr["backbone.pos_embed"] == pytest.approx(r ** (n + 1))
    assert lr["backbone.patch_embed.proj.weight"] == pytest.approx(0.2 * r ** (n + 1))
    for i in range(n):
        assert lr[f"backbone.blocks.{i}.attn.qkv.weight"] == pytest.approx(r ** (n - i))
    assert lr["backbone.norm.weight"] == 1.0
    assert all(lr[k] == 1.0 for k in specs if k.startswith("dino_head."))

    no_wd = {k for k, s in specs.items() if s.wd_multiplier == 0.0}
    # As both official codes: biases, norms and LayerScale are exempt; tokens and the prototype gain decay.
    expected_no_wd = {"backbone.norm.weight", "backbone.norm.bias", "backbone.patch_embed.proj.bias"}
    for i in range(n):
        expected_no_wd |= {f"backbone.blocks.{i}.{p}" for p in (
            "norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias", "ls1.gamma", "ls2.gamma",
            "attn.qkv.bias", "attn.proj.bias", "mlp.fc1.bias", "mlp.fc2.bias")}
    expected_no_wd |= {k for k in specs if k.startswith("dino_head.mlp.") and k.endswith(".bias")}
    assert no_wd == expected_no_wd
    assert {k for k, s in specs.items() if s.is_last_layer} == {"dino_head.last_layer.weight",
                                                                 "dino_head.last_layer_gain"}
    # optim.decay_tokens=false: tokens and the gain join the exempt set.
    exempt = {s.name for s in param_specs(student, r, 0.2, decay_tokens=False) if s.wd_multiplier == 0.0}
    assert exempt - no_wd == {"backbone.cls_token", "backbone.pos_embed", "backbone.register_tokens",
                              "backbone.mask_token", "dino_head.last_layer_gain"}


def test_groups_are_fused_and_schedules_applied(student):
    groups = build_param_groups(student, lr_decay_rate=0.9, patch_embed_lr_mult=0.2)
    n_params = sum(len(g["params"]) for g in groups)
    assert n_params == len(list(student.parameters()))
    # backbone and head parameters never share a group (the backbone's lr takes the continued-pretraining ramp)
    keys = [(g["lr_multiplier"], g["wd_multiplier"], g["is_last_layer"], g["is_backbone"]) for g in groups]
    assert len(keys) == len(set(keys))
    opt = torch.optim.AdamW(groups, lr=0.0)
    apply_optim_schedules(opt, lr=1e-3, weight_decay=0.04, last_layer_lr=0.0)
    for g in opt.param_groups:
        want_lr = 0.0 if g["is_last_layer"] else 1e-3 * g["lr_multiplier"]
        assert g["lr"] == pytest.approx(want_lr)
        assert g["weight_decay"] == pytest.approx(0.04 * g["wd_multiplier"])
    # Frozen last layer really stays put through an AdamW step; other weights move.
    before = student["dino_head"].last_layer.weight.detach().clone()
    qkv = student["backbone"].blocks[0].attn.qkv.weight.detach().clone()
    x = torch.randn(2, 3, 28, 28)
    out = student["dino_head"](student["backbone"](x))
    opt.zero_grad()
    out.square().sum().backward()
    opt.step()
    assert torch.equal(student["dino_head"].last_layer.weight, before)
    assert not torch.equal(student["backbone"].blocks[0].attn.qkv.weight, qkv)


def test_frozen_params_skipped_and_wrapper_names():
    torch.manual_seed(0)
    vit = create_model("vit_test")
    vit.patch_embed.requires_grad_(False)
    names = {s.name for s in param_specs(vit)}
    assert not any(n.startswith("patch_embed") for n in names) and "blocks.3.ls2.gamma" in names
    # Names as torch.compile / activation checkpointing wrap them.
    assert clean_name("backbone.blocks.2._checkpoint_wrapped_module._orig_mod.mlp.fc1.weight") == \
        "backbone.blocks.2.mlp.fc1.weight"
    assert vit_lr_decay_rate("blocks.2._orig_mod.mlp.fc1.weight", 0.5, 4) == pytest.approx(0.5 ** 2)
    assert vit_lr_decay_rate("mask_token", 0.5, 4) == pytest.approx(0.5 ** 5)
