"""N-channel backbones (N = 4 and 1) survive every export: dinopipe / safetensors / timm / HF / DINOv2 / DINOv3
layouts load back through dinopipe.load with the same features, timm builds it with ``in_chans``, transformers
with ``num_channels``, the ONNX and torch.export graphs take (B, N, H, W); the per-channel statistics a run
recorded travel in config.json, timm's pretrained_cfg and HF's preprocessor config."""

import importlib.util
import json

import pytest
import torch

import dinopipe
import dinopipe.hub
from dinopipe.app.cli import main
from dinopipe.models import create_model
from dinopipe.models.channels import expand_patch_embed
from dinopipe.utils.norm import set_input_norm

HAVE_ONNX = all(importlib.util.find_spec(m) for m in ("onnx", "onnxruntime", "onnxscript"))
TOL = 1e-5
STATS = {4: ([0.46, 0.38, 0.36, 0.40], [0.32, 0.27, 0.27, 0.27]), 1: ([0.40], [0.27])}
MODELS = {"dinov2": dict(name="vit_test_reg4", embed_dim=48, num_heads=3, depth=2, img_size=42),
          "dinov3": dict(name="vit_test_dinov3", embed_dim=48, num_heads=3, depth=2, img_size=48)}
FORMATS = {"dinopipe": "dir", "safetensors": "dir", "timm": "dir", "hf": "dir", "dinov2": "x.pth", "dinov3": "x.pth"}


def _model(family, n):
    torch.manual_seed(0)
    kw = dict(MODELS[family])
    m = create_model(kw.pop("name"), **kw).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    expand_patch_embed(m, n, "mean")  # the way an N-channel model is born from RGB weights
    set_input_norm(m, *STATS[n])
    return m


def _x(model, n):
    size = model.arch_config()["img_size"]
    return torch.randn(2, n, size, size, generator=torch.Generator().manual_seed(1))


def _max_diff(a, b, x):
    with torch.no_grad():
        fa, fb = a.forward_features(x), b.forward_features(x)
    return max((fa[k] - fb[k]).abs().max().item() for k in ("x_norm_clstoken", "x_norm_patchtokens"))


# each official layout holds only its own family (test_export_roundtrip checks the refusal)
CASES = [(fmt, family) for fmt in FORMATS for family in MODELS if fmt not in MODELS or fmt == family]


@pytest.mark.parametrize("n", [4, 1])
@pytest.mark.parametrize("fmt,family", CASES)
def test_every_format_keeps_the_channels(tmp_path, capsys, fmt, family, n):
    model = _model(family, n)
    src = dinopipe.hub.save_backbone(model, tmp_path / "src")
    assert json.loads((src / "config.json").read_text())["mean"] == STATS[n][0]
    out = tmp_path / ("out" if FORMATS[fmt] == "dir" else "out.pth")
    assert main(["export", "--model", str(src), "--format", fmt, "--out", str(out)]) == 0, capsys.readouterr().err
    back = dinopipe.load(out)
    assert back.patch_embed.proj.in_channels == n and back.arch_config()["in_chans"] == n
    diff = _max_diff(model, back, _x(model, n))
    print(f"round-trip {family} N={n} {fmt}: max |diff| {diff:.2e}")
    assert diff <= TOL
    if fmt == "timm":
        pre = json.loads((out / "config.json").read_text())["pretrained_cfg"]
        assert pre["input_size"][0] == n and (pre["mean"], pre["std"]) == STATS[n]
    if fmt == "hf":
        assert json.loads((out / "config.json").read_text())["num_channels"] == n
        pre = json.loads((out / "preprocessor_config.json").read_text())
        assert (pre["image_mean"], pre["image_std"]) == STATS[n]


@pytest.mark.parametrize("n", [4, 1])
def test_timm_and_transformers_build_n_channel_models(tmp_path, n):
    timm = pytest.importorskip("timm")
    transformers = pytest.importorskip("transformers")
    model = _model("dinov2", n)
    x = _x(model, n)
    dinopipe.hub.export_timm(model, tmp_path / "timm")
    tm = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True).eval()
    assert tm.patch_embed.proj.in_channels == n
    dinopipe.hub.export_hf(model, tmp_path / "hf")
    hf = transformers.AutoModel.from_pretrained(str(tmp_path / "hf")).eval()
    assert hf.config.num_channels == n
    with torch.no_grad():
        d_timm = (tm(x) - model(x)).abs().max().item()
        d_hf = (hf(pixel_values=x).last_hidden_state[:, 0] - model.forward_features(x)["x_norm_clstoken"]).abs().max().item()
    print(f"N={n}: timm max |diff| {d_timm:.2e}, transformers {d_hf:.2e}")
    assert d_timm <= TOL and d_hf <= 1e-4


@pytest.mark.skipif(not HAVE_ONNX, reason="onnx/onnxruntime/onnxscript not installed")
@pytest.mark.parametrize("n", [4, 1])
def test_graph_exports_take_n_channels(tmp_path, n):
    import onnx

    from dinopipe.export.onnx import export_onnx, export_program, onnx_runner, program_runner

    model = _model("dinov2", n)
    x = _x(model, n)
    path = export_onnx(model, tmp_path / "m.onnx", x.shape[-1])
    dims = onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim
    assert dims[1].dim_value == n
    with torch.no_grad():
        want = model.forward_features(x)["x_norm_clstoken"]
    pt2 = export_program(model, tmp_path / "m.pt2", x.shape[-1])
    for run in (onnx_runner(path), program_runner(pt2, trust_code=True)):
        diff = (torch.as_tensor(run(x)[0]) - want).abs().max().item()
        print(f"N={n} graph max |diff| {diff:.2e}")
        assert diff <= TOL
