"""``dinopipe plan`` of a distillation config: students of any architecture (ViT, timm ConvNeXt and ResNet) and the
teacher built on meta; the parameter counts and state bytes equal those of the real DistillTask, the FLOPs those
torch's counter gives on real tensors; config mistakes exit 2."""

from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import dinopipe
import dinopipe.hub
from dinopipe.app.cli import main as cli_main
from dinopipe.config import load_config
from dinopipe.export import save_backbone
from dinopipe.export.backbone import save_heads
from dinopipe.models import create_model
from dinopipe.plan import backbone_arch, crop_forward_flops
from dinopipe.plan.distill import plan_distill
from dinopipe.ssl.base import build_head
from dinopipe.ssl.config import HeadConfig
from dinopipe.ssl.distill import DistillTask
from dinopipe.ssl.distill_config import DistillConfig

REPO = Path(__file__).resolve().parents[1]
QUICK = REPO / "configs/distill/quickstart.yaml"
STUDENTS = ("students=[{name: vit, model: {name: vit_test, embed_dim: 32, num_heads: 1, depth: 2, img_size: 56}},"
            " {name: cnx, model: {name: 'timm:convnext_atto', img_size: 64}},"
            " {name: rn, model: {name: 'timm:resnet10t', img_size: 64}}]")
PHASE = "phases=[{name: base, fraction: 1.0, global_crops_size: 56, local_crops_size: 28, batch_size_per_gpu: 4}]"
BASE = [STUDENTS, PHASE, "crops.local_crops_number=0", "mode=auto"]


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory):
    """A teacher export with DINO heads (ssl mode for ViT students)."""
    root = tmp_path_factory.mktemp("teacher")
    torch.manual_seed(0)
    t = create_model("vit_test", img_size=56)
    save_backbone(t, root)
    head = build_head(64, HeadConfig(n_prototypes=96, hidden_dim=48, bottleneck_dim=16))
    save_heads(root, {"dino_head": head.state_dict()})
    return root


def _cfg(*overrides):
    return load_config(DistillConfig, str(QUICK), [f"data.paths=[{REPO}]", *overrides])


def _real(cfg):
    return DistillTask(cfg, load_backbone=dinopipe.load, load_heads=dinopipe.hub.load_heads)


@pytest.mark.parametrize("gpus", [1, 8])
def test_counts_match_the_real_task_feature_mode(teacher_run, gpus):
    cfg = _cfg(*BASE, f"teacher_model.path={teacher_run}", "mode=feature")
    r = plan_distill(cfg, gpus, 80)
    task = _real(cfg)
    assert r["mode"] == "feature" and r["teacher"]["params"] == sum(p.numel() for p in task.teacher.parameters())
    x = torch.randn(1, 3, 56, 56)
    for s in r["students"]:
        real = task.students[s["name"]]
        assert s["backbone_params"] == sum(p.numel() for p in real["backbone"].parameters())
        assert s["trained_extra_params"] == sum(p.numel() for n, m in real.items() if n != "backbone"
                                                for p in m.parameters())
        if gpus == 1:  # fp32 params, grads, AdamW x 2, EMA
            assert s["state"]["total"] == 5 * 4 * sum(p.numel() for p in real.parameters())
        else:
            assert s["state"]["total"] < 5 * 4 * sum(p.numel() for p in real.parameters()) / (gpus / 2)
        if s["kind"] == "vit":  # the pretraining planner's analytic count (torch's counter misses CPU SDPA)
            want = crop_forward_flops(backbone_arch(real["backbone"]), 56)
        else:  # convolutions: torch's counter on real tensors
            with FlopCounterMode(display=False) as fc:
                real["backbone"].forward_features(x)
            want = fc.get_total_flops()
        assert s["forward_flops_per_global_crop"] == want > 0, s["name"]
    assert {s["kind"] for s in r["students"]} == {"vit", "timm"}


def test_ssl_mode_counts_the_new_heads(teacher_run):
    cfg = _cfg("students=[{name: vit, model: {name: vit_test, embed_dim: 32, num_heads: 1, depth: 2, img_size: 56}}]",
               PHASE, "crops.local_crops_number=0", "mode=auto", f"teacher_model.path={teacher_run}")
    r = plan_distill(cfg, 1, 80)
    real = _real(cfg).students["vit"]
    assert r["mode"] == "ssl"
    assert r["students"][0]["trained_extra_params"] == sum(p.numel() for p in real["dino_head"].parameters())


def test_cli_plans_a_distill_config_with_timm_students(capsys):
    argv = ["plan", "--config", str(QUICK), "--gpus", "4", "--gpu-mem-gb", "80", "teacher_model.path=vit_test", *BASE]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "timm:resnet10t" in out and "timm:convnext_atto" in out and "teacher vit_test" in out
    assert cli_main([*argv, "--trace"]) == 2
    bad = ["plan", "--config", str(QUICK), "--gpus", "4", "--gpu-mem-gb", "80", "teacher_model.path=vit_test",
           "students=[{name: c, model: {name: 'timm:convnext_nope'}}]"]
    with pytest.raises(SystemExit) as exc:
        cli_main(bad)
    assert exc.value.code == 2 and "timm has no model 'convnext_nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli_main(["plan", "--config", str(QUICK), "--gpus", "4", "--gpu-mem-gb", "80", "teacher_model.path=nope"])
    assert exc.value.code == 2 and "teacher_model.path" in capsys.readouterr().err
