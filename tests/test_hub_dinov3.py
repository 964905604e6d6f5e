"""Every checkpoint format DINOv3 users hold, in and out: official DINOv3 .pth, timm DINOv3 state dicts and
folders, Hugging Face DINOv3ViT / Dinov2 / Dinov2WithRegisters folders (key names as on disk), and a
dinopipe run's DCP checkpoint folders (pretraining and distillation), read without torch.distributed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import timm
import torch
from safetensors import safe_open
from torch import nn

import dinopipe
from dinopipe import hub
from dinopipe.hub import CheckpointError
from dinopipe.models import create_model
from dinopipe.models.convert import detect_format

TOL = 1e-4


def randomised(name="vit_test_dinov3", **kw):
    torch.manual_seed(0)
    model = create_model(name, **kw).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            centre = 1.0 if n.endswith("gamma") or ("norm" in n and n.endswith("weight")) else 0.0
            p.copy_(centre + 0.1 * torch.randn_like(p))
    return model


def img(h=64, w=96, seed=0):
    return torch.randn(2, 3, h, w, generator=torch.Generator().manual_seed(seed))


def same(a, b, x=None):
    x = img() if x is None else x
    with torch.no_grad():
        fa, fb = a.forward_features(x), b.forward_features(x)
    for k in ("x_norm_clstoken", "x_norm_regtokens", "x_norm_patchtokens"):
        torch.testing.assert_close(fa[k], fb[k], atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["vit_test_dinov3", "vit_test_dinov3_swiglu"], ids=["mlp", "swiglu"])
def test_official_dinov3_layout_roundtrip_and_timms_own_converter(tmp_path, name):
    model = randomised(name)
    path = hub.export(model, "dinov3", tmp_path / "dinov3_vitx16.pth")
    sd = torch.load(path, weights_only=True)
    # The official release's key names (dinov3 hub backbones load these with strict=True).
    assert {"cls_token", "storage_tokens", "mask_token", "rope_embed.periods", "blocks.0.attn.qkv.bias_mask",
            "blocks.0.ls1.gamma", "blocks.0.ls2.gamma", "norm.weight"} <= set(sd)
    ffn = {"blocks.0.mlp.w1.weight", "blocks.0.mlp.w2.weight", "blocks.0.mlp.w3.weight"} if "swiglu" in name \
        else {"blocks.0.mlp.fc1.weight", "blocks.0.mlp.fc2.weight"}
    assert ffn <= set(sd) and sd["rope_embed.periods"].shape == (8,)  # head dim 32 = 4 x 8
    assert sd["blocks.0.attn.qkv.bias_mask"].tolist() == [1.0] * 64 + [0.0] * 64 + [1.0] * 64
    assert detect_format(sd) == "dinov3"
    back = dinopipe.load(path)
    assert back.num_heads == 2  # from the periods (a 64-dim-head guess would say 1)
    same(model, back)
    # timm's own DINOv3 checkpoint filter reads our official-layout file into its model.
    from timm.models.eva import checkpoint_filter_fn

    name_t, args = hub.timm_dinov3_model_args(model.arch_config(), model.blocks[0].mlp.fc2.in_features)
    tm = timm.create_model(name_t, **args).eval()
    tm.load_state_dict(checkpoint_filter_fn(sd, tm), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(tm(img()), model(img()), atol=TOL, rtol=0)


def test_official_training_checkpoint_with_local_cls_norm_and_masked_bias(tmp_path):
    model = randomised(untie_global_and_local_cls_norm=True)
    sd = hub.to_official_dinov3(model.state_dict(), model.arch_config())
    d = model.embed_dim
    for i in range(model.n_blocks):  # whatever sits under the mask never reaches the logits
        sd[f"blocks.{i}.attn.qkv.bias"] = sd[f"blocks.{i}.attn.qkv.bias"].clone()
        sd[f"blocks.{i}.attn.qkv.bias"][d:2 * d] = 7.0
    ckpt = {"teacher": {f"backbone.{k}": v for k, v in sd.items()} | {"dino_head.mlp.0.weight": torch.zeros(4, d)},
            "student": {f"backbone.{k}": v * 0 for k, v in sd.items()}, "iteration": 10}
    torch.save(ckpt, tmp_path / "model_final.pth")
    back = dinopipe.load(tmp_path / "model_final.pth")
    assert back.local_cls_norm is not None
    same(model, back)


@pytest.mark.parametrize("name", ["vit_test_dinov3", "vit_test_dinov3_swiglu"], ids=["mlp", "swiglu"])
def test_timm_folder_and_state_dict(tmp_path, name):
    model = randomised(name)
    out = hub.export(model, "timm", tmp_path / "timm")
    tm = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(tm(img()), model(img()), atol=TOL, rtol=0)
    # A timm DINOv3 state dict (reg_token, gamma_1, q_bias/v_bias, fc1_g/fc1_x) loads back.
    torch.save(tm.state_dict(), tmp_path / "timm.pth")
    keys = set(tm.state_dict())
    assert {"reg_token", "blocks.0.gamma_1", "blocks.0.attn.q_bias", "blocks.0.attn.v_bias"} <= keys
    assert ("blocks.0.mlp.fc1_g.weight" in keys) == ("swiglu" in name)
    # A bare state dict does not tell the head count (released widths are known; this one is 32-dim).
    same(model, dinopipe.load(tmp_path / "timm.pth", num_heads=2))
    same(model, dinopipe.load(out))  # the folder's config.json does


def test_hf_dinov3_export_loads_in_transformers_and_back(tmp_path):
    from transformers import DINOv3ViTModel

    model = randomised("vit_test_dinov3_swiglu")
    out = hub.export(model, "hf", tmp_path / "hf")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "layer.0.attention.q_proj.weight" in keys and "layer.0.mlp.gate_proj.weight" in keys  # on-disk names
    hf = DINOv3ViTModel.from_pretrained(out).eval()
    from transformers import AutoImageProcessor

    pixels = AutoImageProcessor.from_pretrained(out)(images=torch.zeros(3, 100, 150), return_tensors="pt")
    assert pixels["pixel_values"].shape == (1, 3, 224, 224)  # DINOv3's square resize, no crop
    x = img(64, 96)
    with torch.no_grad():
        torch.testing.assert_close(hf(pixel_values=x).pooler_output, model(x), atol=TOL, rtol=0)
    # A folder transformers itself wrote loads into dinopipe (config.json gives heads, eps, RoPE base).
    hf.save_pretrained(tmp_path / "saved")
    back = dinopipe.load(tmp_path / "saved")
    assert back.arch_config()["family"] == "dinov3" and back.num_heads == 2
    same(model, back, x)


@pytest.mark.parametrize("registers", [0, 4])
def test_hf_dinov2_folders_written_by_transformers_load(tmp_path, registers):
    from transformers import Dinov2Config, Dinov2Model, Dinov2WithRegistersConfig, Dinov2WithRegistersModel

    kw = dict(hidden_size=64, num_attention_heads=2, num_hidden_layers=2, image_size=56, patch_size=14,
              use_swiglu_ffn=True, layerscale_value=0.5)
    torch.manual_seed(0)
    hf = (Dinov2WithRegistersModel(Dinov2WithRegistersConfig(num_register_tokens=registers, **kw)) if registers
          else Dinov2Model(Dinov2Config(**kw))).eval()
    hf.save_pretrained(tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert "encoder.layer.0.attention.attention.query.weight" in set(f.keys())  # the on-disk names
    model = dinopipe.load(tmp_path / "hf")
    assert model.num_register_tokens == registers and model.num_heads == 2
    x = torch.randn(2, 3, 56, 56)
    with torch.no_grad():
        ref = hf(pixel_values=x).last_hidden_state
        out = model.forward_features(x)
    torch.testing.assert_close(out["x_norm_clstoken"], ref[:, 0], atol=TOL, rtol=0)
    torch.testing.assert_close(out["x_norm_patchtokens"], ref[:, 1 + registers:], atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["vit_test", "vit_test_reg4"])
def test_dinopipes_own_hf_dinov2_export_loads_back(tmp_path, name):
    model = create_model(name, init_values=1.0).eval()
    back = dinopipe.load(hub.export(model, "hf", tmp_path / "hf"))
    assert back.num_register_tokens == model.num_register_tokens and back.num_heads == 2
    same(model, back, torch.randn(2, 3, 56, 56))


def test_dinov2_layout_refused_for_dinov3(tmp_path):
    with pytest.raises(ValueError, match="--format dinov3"):
        hub.export(randomised(), "dinov2", tmp_path / "x.pth")


# -- DCP checkpoints of runs -------------------------------------------------------------------------------


def _save_dcp(path: Path, states: dict) -> None:
    """The trainer's own checkpoint layout (ModelOptimState per saved module, as dinopipe.train writes it)."""
    import torch.distributed.checkpoint as dcp

    from dinopipe.train.checkpoint import ModelOptimState

    dcp.save({k: ModelOptimState(v) for k, v in states.items()}, checkpoint_id=str(path))


def test_pretraining_run_checkpoint_teacher_default_student_on_request(tmp_path):
    teacher, student = randomised(), create_model("vit_test_dinov3").eval()
    head = nn.Linear(64, 8)
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_00000004"
    ckpt.parent.mkdir(parents=True)
    _save_dcp(ckpt, {"teacher": nn.ModuleDict({"backbone": teacher, "dino_head": head}),
                     "student": nn.ModuleDict({"backbone": student, "dino_head": head})})
    (run / "checkpoints" / "latest").write_text("step_00000004\n")
    (run / "config.yaml").write_text("model:\n  name: vit_test_dinov3\n  img_size: 64\n")
    same(teacher, dinopipe.load(ckpt))
    same(student, dinopipe.load(ckpt, which="student"))
    same(teacher, dinopipe.load(run))  # a run without export/ -> its latest checkpoint
    assert not torch.distributed.is_initialized()
    with pytest.raises(CheckpointError, match="no backbone 'ema'"):
        dinopipe.load(ckpt, which="ema")


def test_distillation_run_names_its_students(tmp_path):
    s1, s2 = randomised(), randomised("vit_test_dinov3_swiglu")
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    ckpt.parent.mkdir(parents=True)
    _save_dcp(ckpt, {"student.s1": nn.ModuleDict({"backbone": create_model("vit_test_dinov3")}),
                     "ema.s1": nn.ModuleDict({"backbone": s1}),
                     "student.s2": nn.ModuleDict({"backbone": create_model("vit_test_dinov3_swiglu")}),
                     "ema.s2": nn.ModuleDict({"backbone": s2})})
    (tmp_path / "run" / "config.yaml").write_text(
        "students:\n- name: s1\n  model: {name: vit_test_dinov3}\n- name: s2\n  model: {name: vit_test_dinov3_swiglu}\n")
    with pytest.raises(CheckpointError, match=r"students \['s1', 's2'\]"):
        dinopipe.load(ckpt)
    same(s2, dinopipe.load(ckpt, which="s2"))
    assert not torch.distributed.is_initialized()
    # Exported run directories: ambiguous without a name, then the named student.
    run = tmp_path / "run"
    for name, m in (("s1", s1), ("s2", s2)):
        hub.save_backbone(m, run / "export" / name)
    with pytest.raises(CheckpointError, match=r"students \['s1', 's2'\]"):
        dinopipe.load(run)
    same(s1, dinopipe.load(run, which="s1"))


def test_cli_export_dinov3_formats(tmp_path, capsys):
    from dinopipe.app.cli import main

    src = hub.save_backbone(randomised(), tmp_path / "src")
    for fmt, out in (("dinov3", tmp_path / "o.pth"), ("hf", tmp_path / "hf"), ("timm", tmp_path / "tm")):
        assert main(["export", "--model", str(src), "--format", fmt, "--out", str(out)]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "dinov3_vit"
    same(dinopipe.load(src), dinopipe.load(tmp_path / "o.pth"))
    same(dinopipe.load(src), dinopipe.load(tmp_path / "hf"))
    assert main(["export", "--model", str(src), "--format", "dinov2", "--out", str(tmp_path / "x.pth")]) == 2
    assert "--format dinov3" in capsys.readouterr().err


def test_torch_hub_dinov3_entries(tmp_path):
    repo = str(Path(__file__).resolve().parents[1])
    model = randomised()
    pth = hub.export(model, "dinov3", tmp_path / "dinov3_vittest16.pth")
    loaded = torch.hub.load(repo, "dinopipe_vit_test_dinov3", source="local", weights=str(pth))
    same(model, loaded)
    with pytest.raises(ValueError, match="not a vit_test"):  # DINOv2 entry, DINOv3 weights: refused
        torch.hub.load(repo, "dinopipe_vit_test", source="local", weights=str(pth))
    with torch.device("meta"):
        big = torch.hub.load(repo, "dinopipe_vitl16_dinov3", source="local")
    assert sum(p.numel() for p in big.parameters()) == 303_154_176


def test_readme_dinov3_loading_example_runs(tmp_path, monkeypatch):
    """The README's DINOv3 loading block, run against tiny stand-ins for the files it names."""
    import re

    readme = (Path(__file__).resolve().parents[1] / "docs" / "load.md").read_text()  # moved from README.md
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "dinov3_vits16_pretrain" in b)
    monkeypatch.chdir(tmp_path)
    model = randomised()
    hub.export(model, "dinov3", tmp_path / "dinov3_vits16_pretrain_lvd1689m-08c60483.pth")
    hub.export(model, "hf", tmp_path / "dinov3-vits16-hf")
    ckpt = tmp_path / "runs" / "distill" / "checkpoints" / "step_00000004"
    ckpt.parent.mkdir(parents=True)
    _save_dcp(ckpt, {"ema.s1": nn.ModuleDict({"backbone": model}), "ema.s2": nn.ModuleDict({"backbone": model})})
    (ckpt.parents[1] / "config.yaml").write_text(
        "students:\n- name: s1\n  model: {name: vit_test_dinov3}\n- name: s2\n  model: {name: vit_test_dinov3}\n")
    ns: dict = {}
    exec(block, ns)  # noqa: S102 - our own README
    same(model, ns["m"])
