"""Deployable graphs: ONNX (onnxruntime, CPU) and torch.export programs match eager PyTorch at the traced
size and at sizes never traced (position-embedding resampling / RoPE computed in the graph)."""

import importlib.util
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dinopipe.app.cli import main
from dinopipe.export.onnx import (OUTPUT_NAMES, export_onnx, export_program, max_abs_diff, onnx_runner,
                                  program_runner, resample_matrix, trace)
from dinopipe.models import create_model

HAVE_ONNX = all(importlib.util.find_spec(m) for m in ("onnx", "onnxruntime", "onnxscript"))
needs_onnx = pytest.mark.skipif(not HAVE_ONNX, reason="onnx/onnxruntime/onnxscript not installed "
                                                      "(pip install -e '.[onnx]' or '.[dev]')")
TOL = 1e-4

# One per family; depth 1 keeps export time down (the graph per block is the same).
FAMILIES = {
    "dinov2": dict(name="vit_test", img_size=56),  # legacy pos-embed rule (scale_factor, offset 0.1)
    "dinov2_reg4_swiglu": dict(name="vit_test_reg4", img_size=56, ffn="swiglu"),  # antialiased resample
    "dinov3": dict(name="vit_test_dinov3", img_size=64),  # RoPE + storage tokens
    "dinov3_swiglu": dict(name="vit_test_dinov3_swiglu", img_size=64),
}


def _model(family):
    torch.manual_seed(0)
    kw = dict(FAMILIES[family])
    m = create_model(kw.pop("name"), depth=1, **kw).eval()
    with torch.no_grad():  # non-trivial tokens: zero-init registers/pos-embeds would hide layout mistakes
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m


def _sizes(p):
    # traced size (4 x 4 patches), then sizes never traced: non-square, larger and smaller grids.
    return [(2, 3, 4 * p, 4 * p), (3, 3, 6 * p, 5 * p), (1, 3, 2 * p, 7 * p)]


@pytest.mark.parametrize("n_in", [4, 16])
@pytest.mark.parametrize("offset,antialias", [(0.1, False), (0.0, True)])
def test_resample_matrix_matches_pytorch_bicubic(n_in, offset, antialias):
    """The traceable resample equals F.interpolate (what eager DINOv2 runs) when up- and downsampling."""
    v = torch.randn(1, 1, n_in, 5, generator=torch.Generator().manual_seed(n_in))  # resample rows only
    for n_out in (1, 3, n_in - 1, n_in + 1, 2 * n_in + 3):
        if offset:
            ref = F.interpolate(v, scale_factor=((n_out + offset) / n_in, 1.0), mode="bicubic")
        else:
            ref = F.interpolate(v, size=(n_out, 5), mode="bicubic", antialias=True)
        assert ref.shape[2] == n_out
        got = resample_matrix(torch.empty(n_out), n_in, offset, antialias) @ v[0, 0]
        torch.testing.assert_close(got, ref[0, 0], atol=1e-5, rtol=0)  # float32 rounding: <= 6e-6 over 300 seeds
    eye = resample_matrix(torch.empty(n_in), n_in, offset, antialias, torch.tensor([True]))
    torch.testing.assert_close(eye, torch.eye(n_in), atol=1e-6, rtol=0)  # native grid: no resample


def _check(model, run, family, fmt):
    for shape in _sizes(model.patch_size):
        diffs = max_abs_diff(model, run, torch.randn(*shape, generator=torch.Generator().manual_seed(0)))
        print(f"{fmt} {family} {tuple(shape)} max_abs_diff={max(diffs.values()):.2e}")
        assert max(diffs.values()) <= TOL, (fmt, family, shape, diffs)


@needs_onnx
@pytest.mark.parametrize("family", list(FAMILIES))  # 5-11 s each on a quiet 2-core machine
def test_onnx_and_torch_export_match_pytorch_at_new_sizes(family, tmp_path, monkeypatch):
    """One trace per family, saved as .pt2 and converted to ONNX; both checked at the traced size and at
    two sizes never traced."""
    model = _model(family)
    program = trace(model)
    pt2 = export_program(model, tmp_path / "m.pt2", program=program)
    _check(model, program_runner(pt2, trust_code=True), family, "pt2")
    path = export_onnx(model, tmp_path / "m.onnx", program=program)
    import onnx

    graph = onnx.load(str(path)).graph
    assert [i.name for i in graph.input] == ["pixel_values"]  # no mask input
    assert [o.name for o in graph.output] == list(OUTPUT_NAMES)
    run = onnx_runner(path)
    _check(model, run, family, "onnx")
    cls, reg, patch = run(torch.randn(*_sizes(model.patch_size)[1]))
    assert cls.shape == (3, 64) and reg.shape == (3, model.num_register_tokens, 64) and patch.shape == (3, 30, 64)
    if family == "dinov2":
        _run_readme_snippet(path, model, monkeypatch)


def _run_readme_snippet(onnx_path, model, monkeypatch):
    """The README's onnxruntime snippet, as a user pastes it, on a real photo at 224 px (16 x 16 patches)."""
    from PIL import Image
    from skimage import data

    readme = (Path(__file__).resolve().parents[1] / "docs" / "deploy.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "onnxruntime" in b)
    monkeypatch.chdir(onnx_path.parent)
    onnx_path.rename("backbone.onnx")
    Image.fromarray(data.astronaut()).save("photo.jpg")
    ns: dict = {}
    exec(code, ns)  # noqa: S102 - our own README
    assert ns["cls_token"].shape == (1, 64) and ns["patch_tokens"].shape == (1, 256, 64)
    x = torch.from_numpy(ns["x"])
    with torch.no_grad():
        ref = model.forward_features(x)["x_norm_patchtokens"]
    assert (torch.from_numpy(ns["patch_tokens"]) - ref).abs().max() <= TOL


def test_cli_exports_program_and_refuses_bad_size(tmp_path, capsys):
    assert main(["export", "--model", "vit_test_dinov3", "--format", "pt2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip()
    assert out.endswith("backbone.pt2")
    mod = torch.export.load(out).module()
    assert [t.shape for t in mod(torch.randn(1, 3, 32, 48))] == [(1, 64), (1, 4, 64), (1, 6, 64)]
    assert main(["export", "--model", "vit_test", "--format", "onnx", "--image-size", "50",
                 "--out", str(tmp_path / "x.onnx")]) == 2  # the user's input (docs/exit-codes.md)
    assert "not a multiple of the patch size 14" in capsys.readouterr().err
    assert not (tmp_path / "x.onnx").exists()
    assert main(["export", "--model", "vit_test", "--format", "timm", "--image-size", "56",
                 "--out", str(tmp_path / "timm")]) == 2
    assert "--image-size only applies to --format onnx | pt2" in capsys.readouterr().err
