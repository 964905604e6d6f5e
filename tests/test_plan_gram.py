"""`dinopipe plan` with Gram anchoring and a high-resolution adaptation phase: the Gram teacher costs one more
sharded fp32 backbone, a forward at its crop size and the Gram matrices; a multi-size phase must fit its
largest size triple and takes the probability-weighted time."""

import pytest
import torch

from dinopipe.config import load_config
from dinopipe.models import create_model
from dinopipe.plan import crop_forward_flops, describe, plan
from dinopipe.ssl.config import PretrainConfig

BASE = ["model.name=vit_l16_dinov3", "data.paths=[x]", "train.epochs=1", "train.epoch_length=100"]
HR = ("phases=[{name: hr, batch_size_per_gpu: 8, sizes: ["
      "{global_crops_size: 512, local_crops_size: 112, gram_crops_size: 768, probability: 0.25},"
      " {global_crops_size: 768, local_crops_size: 224, gram_crops_size: 1152, probability: 0.75}]}]")


def run(*overrides, gpus=8):
    return plan(load_config(PretrainConfig, None, BASE + list(overrides)), gpus, 80.0, 989.0)


def test_gram_teacher_adds_one_backbone_of_state_and_its_forward():
    off = run("phases=[{name: a, global_crops_size: 256, local_crops_size: 112, batch_size_per_gpu: 16}]")
    on = run("phases=[{name: a, global_crops_size: 256, local_crops_size: 112, batch_size_per_gpu: 16,"
             " gram_crops_size: 512}]", "gram.enabled=true")
    with torch.device("meta"):
        backbone = sum(p.numel() for p in create_model("vit_l16_dinov3", init_values=1e-5).parameters())
    extra = on["state"]["total"] - off["state"]["total"]
    assert extra == on["state"]["gram_teacher_params"]
    assert extra == pytest.approx(backbone * 4 / 8, rel=0.01)  # fp32, sharded over 8 GPUs
    f_on, f_off = on["phases"][0]["flops"], off["phases"][0]["flops"]
    arch_fwd = crop_forward_flops(describe(load_config(PretrainConfig, None, BASE))[0], 512, None, 32)
    assert f_on["gram"] == pytest.approx(arch_fwd, rel=0.05)  # the forward dominates; Gram products are small
    assert f_on["model"] == pytest.approx(f_off["model"] + f_on["gram"])
    m_on, m_off = on["phases"][0]["memory"]["fused_noac"], off["phases"][0]["memory"]["fused_noac"]
    assert m_on["peak"] > m_off["peak"] and m_on["max_batch"] <= m_off["max_batch"]


def test_multi_size_phase_fits_the_largest_and_times_the_mix():
    mixed = run(HR, "gram.enabled=true")["phases"][0]
    small = run(HR.replace("probability: 0.25", "probability: 1.0").split(", {global_crops_size: 768")[0] + "]}]",
                "gram.enabled=true")["phases"][0]
    large = run("phases=[{name: hr, batch_size_per_gpu: 8, global_crops_size: 768, local_crops_size: 224,"
                " gram_crops_size: 1152}]", "gram.enabled=true")["phases"][0]
    assert mixed["memory"]["fused_ac"]["peak"] == large["memory"]["fused_ac"]["peak"]
    assert mixed["global_crops_size"] == 768
    expected = 0.25 * small["flops"]["model"] + 0.75 * large["flops"]["model"]
    assert mixed["flops"]["model"] == pytest.approx(expected)


def test_gram_flops_count_only_the_anchored_steps():
    one = "phases=[{name: a, global_crops_size: 256, local_crops_size: 112, batch_size_per_gpu: 16, gram_crops_size: 512}]"
    full = run(one, "gram.enabled=true")["phases"][0]["flops"]
    late = run(one, "gram.enabled=true", "gram.first_step=75")["phases"][0]["flops"]  # 25 of 100 steps
    assert late["gram"] == pytest.approx(0.25 * full["gram"])


@pytest.mark.parametrize("name", ["vitl16_dinov3", "vitl16_dinov3_highres", "dinov3_continue"])
def test_dinov3_recipes_validate_and_plan(name):
    from pathlib import Path

    from dinopipe.ssl.config_checks import validate

    cfg = load_config(PretrainConfig, Path(__file__).parents[1] / "configs/pretrain" / f"{name}.yaml")
    validate(cfg)
    assert cfg.gram.enabled and cfg.model.name.endswith("_dinov3") and cfg.teacher.centering == "sinkhorn_knopp"
    r = plan(cfg, 32, 80.0, 989.0)
    assert r["state"]["gram_teacher_params"] > 0 and r["phases"][-1]["flops"]["gram"] > 0


def test_dinov3_distill_config_validates():
    from pathlib import Path

    from dinopipe.ssl.distill_config import DistillConfig, validate

    cfg = load_config(DistillConfig, Path(__file__).parents[1] / "configs/distill/dinov3_vit7b_to_s_b_l.yaml")
    validate(cfg)
    assert cfg.mode == "feature" and [s.model.name for s in cfg.students] == [
        "vit_s16_dinov3", "vit_b16_dinov3", "vit_l16_dinov3"]
