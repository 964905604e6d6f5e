"""Distillation on 4-band tiles (16-bit TIFF and float .npy rendered from real photos) from an RGB teacher file:
refused with exit 2 unless teacher_model.expand_patch_embed says how to expand it; expanded exactly as continued
pretraining expands; every student's export (a ViT and a timm ResNet; folder, timm layout, ONNX, torch.export)
records the data's channel statistics and takes 4 channels."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import dinopipe
import dinopipe.hub
from dinopipe.app.cli import main as cli_main
from dinopipe.config import ConfigError, load_config
from dinopipe.data.channels import channel_stats, decode_channels
from dinopipe.hub import export_dinov2
from dinopipe.models import create_model
from dinopipe.models.channels import expand_patch_embed
from dinopipe.ssl.distill import DistillTask
from dinopipe.ssl.distill_config import DistillConfig
from dinopipe.train.distill import validate
from dinopipe.utils.norm import input_norm
from tests.train.conftest import REPO, TINY_DISTILL, run_distill

HAVE_ONNX = all(importlib.util.find_spec(m) for m in ("onnx", "onnxruntime", "onnxscript"))
STUDENTS = ("students=[{name: vit, model: {name: vit_test, embed_dim: 32, num_heads: 1, depth: 2, img_size: 56}},"
            " {name: rn, model: {name: 'timm:resnet10t', img_size: 56}}]")
PHASE = "phases=[{name: base, fraction: 1.0, global_crops_size: 56, local_crops_size: 28, batch_size_per_gpu: 4}]"


@pytest.fixture(scope="module")
def band_pool(tmp_path_factory):
    from dinopipe.data.samples_nch import build_multichannel_pool

    root = tmp_path_factory.mktemp("bands") / "pool"
    build_multichannel_pool(root, channels=4, n_images=12, size=72, fmt="tiff16", seed=0)
    build_multichannel_pool(root, channels=4, n_images=4, size=72, fmt="npy", seed=1)
    return root


@pytest.fixture(scope="module")
def stats(band_pool):
    mean, std, used, _ = channel_stats((p.read_bytes() for p in sorted(band_pool.iterdir())), 4)
    assert used == 16
    return [round(v, 4) for v in mean], [round(v, 4) for v in std]


@pytest.fixture(scope="module")
def rgb_teacher(tmp_path_factory):
    """A 'released' RGB backbone file (no heads: feature distillation), away from its init."""
    torch.manual_seed(0)
    t = create_model("vit_test", img_size=56).eval()
    with torch.no_grad():
        for p in t.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = export_dinov2(t, tmp_path_factory.mktemp("released") / "teacher.pth")
    return t, path


def _overrides(band_pool, stats, teacher_path, *extra):
    mean, std = stats
    return [f"teacher_model.path={teacher_path}", f"data.paths=[{band_pool}]", "data.channels=4",
            f"data.mean={mean}", f"data.std={std}", STUDENTS, PHASE, "crops.local_crops_number=0", *extra]


def _cfg(band_pool, stats, teacher_path, *extra):
    return load_config(DistillConfig, str(REPO / "configs/distill/quickstart.yaml"),
                       [*TINY_DISTILL, *_overrides(band_pool, stats, teacher_path, *extra)])


def _tile(band_pool, size=56):
    first = sorted(band_pool.glob("*.tif"))[0]
    return decode_channels(first.read_bytes(), 4)[0][None, :, :size, :size]  # (1, 4, 56, 56)


def test_rgb_teacher_without_expansion_is_refused(band_pool, stats, rgb_teacher):
    _, path = rgb_teacher
    with pytest.raises(ConfigError, match=r"teacher_model.expand_patch_embed: .* RGB teacher and data.channels is 4"):
        validate(_cfg(band_pool, stats, path))
    with pytest.raises(ConfigError, match=r"teacher_model.rgb_channels: rgb_map needs 3 distinct"):
        validate(_cfg(band_pool, stats, path, "teacher_model.expand_patch_embed=rgb_map",
                      "teacher_model.rgb_channels=[0,1,7]"))
    # a 2-channel teacher cannot become a 4-channel one, whatever the expansion
    two = expand_patch_embed(create_model("vit_test", img_size=56), 2, "mean")
    p2 = export_dinov2(two, path.parent / "two.pth")
    with pytest.raises(ConfigError, match=r"teacher_model.path: .* takes 2 channels but data.channels is 4"):
        validate(_cfg(band_pool, stats, p2, "teacher_model.expand_patch_embed=mean"))


@pytest.mark.slow
def test_rgb_teacher_without_expansion_exits_2_before_any_work(tmp_path, band_pool, stats, rgb_teacher):
    out = tmp_path / "run"
    r = run_distill(out, band_pool, *_overrides(band_pool, stats, rgb_teacher[1]), check=False)
    assert r.returncode == 2 and "teacher_model.expand_patch_embed" in r.stderr, r.stderr[-2000:]
    assert not out.exists()


@pytest.mark.parametrize("mode,rgb", [("mean", None), ("rgb_map", [2, 0, 1])])
def test_teacher_is_expanded_as_pretraining_expands(band_pool, stats, rgb_teacher, mode, rgb):
    released, path = rgb_teacher
    extra = [f"teacher_model.expand_patch_embed={mode}"] + ([f"teacher_model.rgb_channels={rgb}"] if rgb else [])
    cfg = _cfg(band_pool, stats, path, *extra)
    validate(cfg)
    task = DistillTask(cfg, load_backbone=dinopipe.load, load_heads=dinopipe.hub.load_heads)
    want = expand_patch_embed(create_model("vit_test", img_size=56).eval(), 4, mode, rgb)
    import copy

    want.load_state_dict(expand_patch_embed(copy.deepcopy(released), 4, mode, rgb).state_dict())
    x = _tile(band_pool)
    with torch.no_grad():
        torch.testing.assert_close(task.teacher["backbone"](x), want(x), atol=0, rtol=0)
    for name, student in task.students.items():  # students take the data's channels and statistics
        assert input_norm(student["backbone"]) == tuple(map(list, stats)), name
        with torch.no_grad():
            assert student["backbone"](x).shape[0] == 1


@pytest.fixture(scope="module")
def distilled(tmp_path_factory, band_pool, stats, rgb_teacher):
    run = tmp_path_factory.mktemp("distill4") / "run"
    run_distill(run, band_pool, *_overrides(band_pool, stats, rgb_teacher[1], "teacher_model.expand_patch_embed=mean",
                                            "train.epochs=1"))
    return run


def _assert_stats(got_mean, got_std, stats):
    assert got_mean == pytest.approx(stats[0]) and got_std == pytest.approx(stats[1])


@pytest.mark.slow
def test_distilled_exports_record_the_channel_statistics(distilled, band_pool, stats, tmp_path):
    for name, size in (("vit", 56), ("rn", 64)):  # graphs take multiples of the patch size / total stride
        x = _tile(band_pool, size)
        cfg = json.loads((distilled / "export" / name / "config.json").read_text())
        assert cfg["arch"]["in_chans"] == 4, name
        _assert_stats(cfg["mean"], cfg["std"], stats)
        model = dinopipe.load(distilled, which=name)
        _assert_stats(*input_norm(model), stats)
        with torch.no_grad():
            want = model.forward_features(x)["x_norm_clstoken"]
        # the timm layout keeps them in pretrained_cfg, and they come back on load
        out = tmp_path / f"{name}_timm"
        assert cli_main(["export", "--model", str(distilled), "--which", name, "--format", "timm", "--out", str(out)]) == 0
        pre = json.loads((out / "config.json").read_text())["pretrained_cfg"]
        assert pre["input_size"][0] == 4
        _assert_stats(pre["mean"], pre["std"], stats)
        back = dinopipe.load(out)
        _assert_stats(*input_norm(back), stats)
        with torch.no_grad():
            torch.testing.assert_close(back.forward_features(x)["x_norm_clstoken"], want, atol=1e-5, rtol=0)
        if HAVE_ONNX:
            _graphs(distilled, name, x, want, stats, tmp_path)


def _graphs(run, name, x, want, stats, tmp_path):
    from dinopipe.export.onnx import graph_metadata, onnx_runner, program_runner

    for fmt, runner in (("onnx", onnx_runner), ("pt2", lambda p: program_runner(p, trust_code=True))):
        out = tmp_path / f"{name}.{fmt}"
        assert cli_main(["export", "--model", str(run), "--which", name, "--format", fmt, "--out", str(out),
                         "--image-size", str(x.shape[-1])]) == 0
        meta = graph_metadata(out)
        assert meta["in_chans"] == 4
        _assert_stats(meta["mean"], meta["std"], stats)
        got = torch.as_tensor(runner(out)(x)[0])
        assert (got - want).abs().max().item() <= 1e-4, (name, fmt)


def test_graph_metadata_of_an_rgb_model_is_imagenet(tmp_path):
    from dinopipe.export.onnx import export_program, graph_metadata
    from dinopipe.utils.norm import IMAGENET_MEAN, IMAGENET_STD

    m = create_model("vit_test", img_size=28, depth=1).eval()
    meta = graph_metadata(export_program(m, Path(tmp_path) / "m.pt2", 28))
    assert meta == {"in_chans": 3, "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)}
