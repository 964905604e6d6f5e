"""Checkpoints in and out: official DINOv2 layouts, timm, dinopipe exports, torch.hub, refusing pickles."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch

import dinopipe
from dinopipe import hub
from dinopipe.hub import CheckpointError
from dinopipe.models import create_model
from dinopipe.models.block import swiglu_hidden
from dinopipe.models.convert import detect_format, to_canonical, to_dinov2

from tests._dinov2_reference import chunk_blocks, official_keys, reference_forward

REPO = Path(__file__).resolve().parents[1]


def _img(h, w, seed=0):
    return torch.randn(2, 3, h, w, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("registers,swiglu", [(0, False), (4, False), (0, True), (4, True)])
def test_official_layout_matches_reference_forward(tmp_path, registers, swiglu):
    dim = 128  # 2 heads of 64 dims, given (a width no release has: not guessed)
    hidden = swiglu_hidden(4 * dim) if swiglu else 4 * dim
    sd = official_keys(dim, depth=2, grid=4, registers=registers, swiglu=swiglu, hidden=hidden)
    path = tmp_path / "dinov2_vitx14.pth"
    torch.save(sd, path)
    model = dinopipe.load(path, num_heads=2)  # a foreign file says no head count
    assert not model.training and model.num_register_tokens == registers and model.num_heads == 2
    # Hub behaviour: registers -> antialiased size interpolation; none -> legacy scale_factor with +0.1.
    interp = dict(antialias=True, offset=0.0) if registers else dict(antialias=False, offset=0.1)
    for h, w in [(56, 56), (84, 42)]:  # native grid, then an interpolated non-square one
        x = _img(h, w)
        cls_ref, patch_ref = reference_forward(sd, x, 2, registers=registers, swiglu=swiglu, **interp)
        with torch.no_grad():
            out = model.forward_features(x)
        torch.testing.assert_close(out["x_norm_clstoken"], cls_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out["x_norm_patchtokens"], patch_ref, atol=1e-5, rtol=1e-5)


def test_training_checkpoint_layouts_load_the_teacher(tmp_path):
    sd = official_keys(128, depth=4, grid=4, swiglu=True, hidden=swiglu_hidden(512))
    x = _img(56, 56)
    ref = reference_forward(sd, x, 2, swiglu=True)[0]
    other = official_keys(128, depth=4, grid=4, swiglu=True, hidden=swiglu_hidden(512), seed=1)
    layouts = {
        "chunked_teacher_ckpt": {"teacher": {"backbone." + k: v for k, v in chunk_blocks(sd, 2).items()}
                                 | {"dino_head.mlp.0.weight": torch.zeros(4, 128)}},
        "dinov2_train_ckpt": {"model": {"teacher.backbone." + k: v for k, v in sd.items()}
                              | {"student.backbone." + k: v for k, v in other.items()}
                              | {"teacher.dino_head.last_layer.weight_g": torch.ones(8, 1)}, "iteration": 3},
        "ddp_module_prefix": {"module." + k: v for k, v in chunk_blocks(sd, 4).items()},
    }
    for name, obj in layouts.items():
        p = tmp_path / f"{name}.pth"
        torch.save(obj, p)
        with torch.no_grad():
            got = dinopipe.load(p, num_heads=2)(x)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5, msg=name)


def test_real_size_key_names_and_shapes_match_official():
    """Every key of the released ViT-S/14, ViT-L/14-reg and ViT-g/14 files exists with the same shape."""
    for variant, dim, depth, reg, swiglu in [("vit_s14", 384, 12, 0, False), ("vit_l14_reg4", 1024, 24, 4, False),
                                            ("vit_g14", 1536, 40, 0, True)]:
        with torch.device("meta"):
            model = create_model(variant, img_size=518, init_values=1.0)
            hidden = 4096 if swiglu else 4 * dim  # 4096 is the released ViT-g SwiGLU width
            official = official_keys(dim, depth, grid=37, registers=reg, swiglu=swiglu, hidden=hidden)
        ours = to_dinov2(model.state_dict(), "swiglu" if swiglu else "mlp")
        assert set(ours) == set(official), variant
        assert all(ours[k].shape == official[k].shape for k in official), variant


def test_detect_format():
    sd = official_keys(64, 1, grid=2, swiglu=True, hidden=64)
    assert detect_format(sd) == "dinov2"
    canon = to_canonical(sd)
    assert detect_format(canon) == "dinopipe"
    t = timm.create_model("vit_small_patch14_reg4_dinov2", img_size=56, embed_dim=64, depth=1, num_heads=1,
                          num_classes=0, pretrained=False)
    assert detect_format(t.state_dict()) == "timm"


@pytest.mark.parametrize("variant", ["vit_test", "vit_test_reg4", "vit_g14"])
def test_timm_export_gives_same_features(tmp_path, variant):
    # Compared at the native grid: for models without registers timm interpolates differently from DINOv2's
    # legacy rule (which dinopipe keeps, as released weights expect it).
    kw = dict(embed_dim=128, depth=2, num_heads=2) if variant == "vit_g14" else {}
    model = create_model(variant, init_values=1.0, img_size=56, **kw).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # beyond init so every tensor matters
    hub.export_timm(model, tmp_path / "timm")
    tm = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True).eval()
    x = _img(56, 56, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(tm(x), model(x), atol=1e-5, rtol=1e-5)
        feats = tm.forward_features(x)  # (B, 1 + R + N, D), normed
        ours = model.forward_features(x)
        torch.testing.assert_close(feats[:, 1 + model.num_register_tokens:], ours["x_norm_patchtokens"],
                                   atol=1e-5, rtol=1e-5)
        if variant == "vit_test_reg4":  # same interpolation rule as timm for register models
            x2 = _img(84, 42, seed=4)
            torch.testing.assert_close(tm(x2), model(x2), atol=1e-5, rtol=1e-5)


def test_dinov2_export_is_read_by_timms_own_converter(tmp_path):
    """timm's DINOv2 checkpoint filter is an independent reader of the official layout."""
    model = create_model("vit_test_reg4", embed_dim=128, num_heads=2, init_values=1.0, img_size=56).eval()
    path = hub.export_dinov2(model, tmp_path / "backbone.pth")
    tm = timm.create_model("vit_small_patch14_reg4_dinov2", pretrained=True, img_size=56, embed_dim=128, depth=4,
                           num_heads=2, num_classes=0, pretrained_cfg_overlay=dict(file=str(path))).eval()
    x = _img(56, 56)
    with torch.no_grad():
        torch.testing.assert_close(tm(x), model(x), atol=1e-5, rtol=1e-5)


def test_timm_state_dict_loads(tmp_path):
    tm = timm.create_model("vit_small_patch14_reg4_dinov2", img_size=56, embed_dim=128, depth=2, num_heads=2,
                           num_classes=0, pretrained=False).eval()
    torch.save(tm.state_dict(), tmp_path / "timm.pth")
    model = dinopipe.load(tmp_path / "timm.pth", num_heads=2)
    x = _img(56, 56)
    with torch.no_grad():
        torch.testing.assert_close(model(x), tm(x), atol=1e-5, rtol=1e-5)


def test_export_folder_roundtrip_keeps_arch(tmp_path):
    model = create_model("vit_test", num_register_tokens=2, img_size=112).eval()  # 2 heads of 32: not inferable
    hub.save_backbone(model, tmp_path / "export")
    loaded = dinopipe.load(tmp_path / "export")
    assert loaded.num_heads == 2 and loaded.num_register_tokens == 2
    x = _img(112, 112)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    (tmp_path / "run" / "export").mkdir(parents=True)
    hub.save_backbone(model, tmp_path / "run" / "export" / "teacher")
    assert dinopipe.load(tmp_path / "run").num_register_tokens == 2  # a run dir resolves to its teacher export


class _Evil:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['EVIL_MARKER']}",))


def test_malicious_pickle_is_refused(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("EVIL_MARKER", str(marker))
    torch.save({"model": official_keys(64, 1, grid=2), "args": _Evil()}, tmp_path / "evil.pth")
    with pytest.raises(CheckpointError, match="refusing"):
        dinopipe.load(tmp_path / "evil.pth")
    assert not marker.exists()


def test_bad_inputs_have_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="neither a file"):
        dinopipe.load(tmp_path / "missing.pth")
    torch.save({"foo": torch.zeros(3)}, tmp_path / "notavit.pth")
    with pytest.raises(CheckpointError, match="ViT"):
        dinopipe.load(tmp_path / "notavit.pth")


def test_registry_name_gives_random_init_in_eval():
    m = dinopipe.load("vit_test")
    assert not m.training and m.embed_dim == 64


def test_torch_hub_local(tmp_path):
    model = create_model("vit_test").eval()
    hub.save_backbone(model, tmp_path / "export")
    loaded = torch.hub.load(str(REPO), "dinopipe_vit_test", source="local", weights=str(tmp_path / "export"))
    x = _img(56, 56)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    with pytest.raises(ValueError, match="not a vit_s14"):
        torch.hub.load(str(REPO), "dinopipe_vits14", source="local", weights=str(tmp_path / "export"))
    sys.path.insert(0, str(REPO))
    try:
        import hubconf
    finally:
        sys.path.remove(str(REPO))
    assert {"dinopipe_vits14", "dinopipe_vitg14_reg", "dinopipe_vitl16"} <= set(dir(hubconf))


def test_cli_export_timm(tmp_path):
    hub.save_backbone(create_model("vit_test"), tmp_path / "export")
    r = subprocess.run([sys.executable, "-m", "dinopipe.app.cli", "export", "--model", str(tmp_path / "export"),
                        "--format", "timm", "--out", str(tmp_path / "timm")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "timm" / "model.safetensors").is_file() and (tmp_path / "timm" / "config.json").is_file()
