"""timm students (``timm:NAME``): DINOv2's feature keys from a ConvNeXt and a ResNet, BatchNorm statistics in
the EMA, and every export a timm student has (dinopipe folder, timm folder, ONNX, torch.export) read back equal."""

import importlib.util

import numpy as np
import pytest
import timm
import torch
from PIL import Image

import dinopipe
from dinopipe.app.cli import main
from dinopipe.data.samples import real_photos
from dinopipe.data.transforms import eval_transform
from dinopipe.eval.features import model_crop_size
from dinopipe.export import export, save_backbone
from dinopipe.hub import CheckpointError
from dinopipe.models import TimmBackbone, build_vit, create_model
from dinopipe.ssl.ema import ema_update_

NAMES = ["timm:convnext_atto", "timm:resnet10t"]  # LayerNorm CNN, BatchNorm CNN
TOL = 1e-5
needs_onnx = pytest.mark.skipif(importlib.util.find_spec("onnxscript") is None or
                                importlib.util.find_spec("onnxruntime") is None, reason="onnx extras not installed")


@pytest.fixture(scope="module")
def photos():
    """8 real photos at 64 px, normalised as the models expect (3, 64, 64)."""
    t = eval_transform(64)
    arrs = [a for _, a in sorted(real_photos().items())][:8]
    return torch.stack([t(Image.fromarray(np.asarray(a))) for a in arrs])


def _trained(name: str, photos: torch.Tensor) -> TimmBackbone:
    """A random-init student whose BatchNorm statistics have left their init (a train-mode pass over photos)."""
    torch.manual_seed(0)
    m = create_model(name, img_size=64)
    m.train()
    with torch.no_grad():
        m(photos)
    return m.eval()


def _same(a, b, x) -> float:
    with torch.no_grad():
        fa, fb = a.forward_features(x), b.forward_features(x)
    return max(float((fa[k] - fb[k]).abs().max()) for k in ("x_norm_clstoken", "x_norm_patchtokens"))


@pytest.mark.parametrize("name", NAMES)
def test_features_have_dinov2_keys_and_the_feature_map_grid(name, photos):
    m = create_model(name, img_size=64).eval()
    assert isinstance(m, TimmBackbone) and m.patch_size == 32  # total stride of both
    with torch.no_grad():
        out = m.forward_features(photos)
        assert torch.equal(m(photos), out["x_norm_clstoken"])
    assert out["x_norm_clstoken"].shape == (8, m.embed_dim)
    assert out["patch_grid"] == (2, 2) and out["x_norm_patchtokens"].shape == (8, 4, m.embed_dim)
    assert out["x_norm_regtokens"].shape == (8, 0, m.embed_dim)
    # the pooled feature is the mean of the last feature map (ResNet: exactly; ConvNeXt: then its head norm)
    if name.endswith("resnet10t"):
        torch.testing.assert_close(out["x_norm_clstoken"], out["x_norm_patchtokens"].mean(1))
    assert model_crop_size(m, 72) == 72  # a CNN is evaluated at the size asked (a ViT rounds to its patch)
    units = m.shard_units()  # FSDP2 / AC / compile units: the four stages
    assert len(units) == 4 and all(any(True for _ in u.parameters()) for u in units)
    rebuilt = build_vit(**m.arch_config())  # what exports and the eval's random-init baseline rebuild
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {k: v.shape for k, v in m.state_dict().items()}


def test_unknown_timm_name_is_refused_with_a_hint():
    with pytest.raises(ValueError, match="timm has no model 'convnext_nope'.*convnext"):
        create_model("timm:convnext_nope")
    with pytest.raises(CheckpointError, match="timm has no model"):
        dinopipe.load("timm:convnext_nope")


def test_ema_follows_batchnorm_statistics(photos):
    student = create_model("timm:resnet10t", img_size=64)
    ema = create_model("timm:resnet10t", img_size=64)
    ema.load_state_dict(student.state_dict())
    student.train()
    with torch.no_grad():
        student(photos)
    bn_s, bn_e = student.model.bn1, ema.model.bn1
    before = bn_e.running_mean.clone()
    ema_update_(ema, student, 0.9)
    torch.testing.assert_close(bn_e.running_mean, 0.9 * before + 0.1 * bn_s.running_mean)
    assert int(bn_e.num_batches_tracked) == int(bn_s.num_batches_tracked) == 1


@pytest.mark.parametrize("name", NAMES)
def test_dinopipe_and_timm_folders_load_back_equal(name, photos, tmp_path):
    m = _trained(name, photos)
    save_backbone(m, tmp_path / "dinopipe")
    export(m, "timm", tmp_path / "timm")
    x = photos[:4]
    for folder in ("dinopipe", "timm"):
        back = dinopipe.load(tmp_path / folder)
        assert isinstance(back, TimmBackbone) and _same(m, back, x) <= TOL, folder
    # timm alone reads the folder: the pretrained_cfg overlay naming the file, and local-dir
    arch = name.split(":", 1)[1]
    with torch.no_grad():
        ref = m(x)
        by_file = timm.create_model(arch, pretrained=True, num_classes=0,
                                    pretrained_cfg_overlay=dict(file=str(tmp_path / "timm" / "model.safetensors")))
        by_dir = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True)
        for t in (by_file, by_dir):
            assert float((t.eval()(x) - ref).abs().max()) <= TOL
    with pytest.raises(ValueError, match="a timm student .* exports as dinopipe | safetensors | timm"):
        export(m, "hf", tmp_path / "hf")


@needs_onnx
@pytest.mark.slow  # 25-45 s each on a shared 2-core machine (tracing a CNN)
@pytest.mark.parametrize("name", NAMES)
def test_onnx_and_torch_export_match_at_two_sizes(name, photos, tmp_path):
    from dinopipe.export.onnx import export_onnx, export_program, max_abs_diff, onnx_runner, program_runner, trace

    m = _trained(name, photos)
    program = trace(m)
    runners = {"pt2": program_runner(export_program(m, tmp_path / "m.pt2", program=program), trust_code=True),
               "onnx": onnx_runner(export_onnx(m, tmp_path / "m.onnx", program=program))}
    big = torch.nn.functional.interpolate(photos[:3], size=96, mode="bilinear", align_corners=False)
    for fmt, run in runners.items():
        for x in (photos[:2], big):  # the traced size and one never traced (3 x 3 feature map)
            diffs = max_abs_diff(m, run, x)
            print(f"{name} {fmt} {tuple(x.shape)} max_abs_diff={max(diffs.values()):.2e}")
            assert max(diffs.values()) <= TOL, (fmt, x.shape, diffs)


def test_cli_export_of_a_timm_student(tmp_path, capsys, photos):
    m = _trained("timm:resnet10t", photos)
    save_backbone(m, tmp_path / "run")
    assert main(["export", "--model", str(tmp_path / "run"), "--format", "timm", "--out", str(tmp_path / "t")]) == 0
    assert _same(m, dinopipe.load(tmp_path / "t"), photos[:2]) <= TOL
    assert main(["export", "--model", str(tmp_path / "run"), "--format", "dinov2",
                 "--out", str(tmp_path / "x.pth")]) == 2
    assert "a timm student (resnet10t) exports as" in capsys.readouterr().err


def test_activation_checkpointing_per_stage_keeps_gradients(photos):
    """The train layer's wrap units for a CNN are its stages: checkpointing each gives the same gradients."""
    from dinopipe.train.parallel import _blocks, apply_activation_checkpointing

    torch.manual_seed(0)
    ref = create_model("timm:convnext_atto", img_size=64)
    ac = create_model("timm:convnext_atto", img_size=64)
    ac.load_state_dict(ref.state_dict())
    assert [type(b).__name__ for b in _blocks(ac)] == ["ConvNeXtStage"] * 4
    for blk in _blocks(ac):
        apply_activation_checkpointing(blk)
    for m in (ref, ac):
        m.forward_features(photos[:4])["x_norm_patchtokens"].square().mean().backward()
    for (name, a), (_, b) in zip(ref.named_parameters(), ac.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5, msg=name)
