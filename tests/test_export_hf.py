"""HF transformers export: Dinov2Model / Dinov2WithRegistersModel.from_pretrained(DIR) gives our features."""

import json

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'dinopipe[dev]'); HF export untested")

from dinopipe import hub  # noqa: E402
from dinopipe.app.cli import main as cli_main  # noqa: E402
from dinopipe.export.hf import export_hf  # noqa: E402
from dinopipe.models import create_model  # noqa: E402

HAS_REGISTERS = hasattr(transformers, "Dinov2WithRegistersModel")

VARIANTS = {
    "vit_test": ("vit_test", {}),
    "vit_test_reg4": ("vit_test_reg4", {}),
    "swiglu": ("vit_test", dict(ffn="swiglu")),
    # No LayerScale and no biases: HF always has them, the export writes ones / zeros.
    "bare": ("vit_test", dict(init_values=None, qkv_bias=False, proj_bias=False, ffn_bias=False)),
}


def _model(name):
    variant, kw = VARIANTS[name]
    kw = dict(kw)
    model = create_model(variant, init_values=kw.pop("init_values", 1.0), img_size=56, **kw).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # beyond init so every tensor (mask token, layer scale) matters
    return model


def _load_hf(path):
    model, info = transformers.AutoModel.from_pretrained(str(path), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def _compare(hf, model, x, atol):
    with torch.no_grad():
        out = hf(pixel_values=x).last_hidden_state  # (B, 1 + R + N, D), after HF's final layernorm
        ours = model.forward_features(x)
    r = model.num_register_tokens
    torch.testing.assert_close(out[:, 0], ours["x_norm_clstoken"], atol=atol, rtol=0)
    torch.testing.assert_close(out[:, 1:1 + r], ours["x_norm_regtokens"], atol=atol, rtol=0)
    torch.testing.assert_close(out[:, 1 + r:], ours["x_norm_patchtokens"], atol=atol, rtol=0)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_hf_export_gives_same_features(tmp_path, name):
    if name == "vit_test_reg4" and not HAS_REGISTERS:
        pytest.skip(f"transformers {transformers.__version__} has no Dinov2WithRegistersModel")
    model = _model(name)
    export_hf(model, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    hf = _load_hf(tmp_path / "hf")
    expected = "Dinov2WithRegistersModel" if model.num_register_tokens else "Dinov2Model"
    assert type(hf).__name__ == expected and cfg["architectures"] == [expected]
    x = torch.randn(2, 3, 56, 56, generator=torch.Generator().manual_seed(1))
    _compare(hf, model, x, atol=1e-4)  # native grid (the export's img_size): measured max |diff| <= 2e-6


def test_other_resolutions_differ_only_by_the_pos_embed_rule(tmp_path):
    """HF resamples position embeddings bicubically *to a size*. Register models: the same rule as DINOv2's hub
    (antialiased), so equal at any size. Others: DINOv2's legacy ``scale_factor=(h + 0.1) / M`` rule, which we
    keep for released weights; HF differs there (measured on this random tiny model at 84-224 px: max |diff|
    ~2e-3 on CLS, ~2e-2 on patch tokens, cosine > 0.9999). With HF's rule switched on, we match exactly."""
    x = torch.randn(2, 3, 84, 42, generator=torch.Generator().manual_seed(2))
    if HAS_REGISTERS:
        reg = _model("vit_test_reg4")
        export_hf(reg, tmp_path / "reg")
        _compare(_load_hf(tmp_path / "reg"), reg, x, atol=1e-5)
    model = _model("vit_test")
    export_hf(model, tmp_path / "plain")
    hf = _load_hf(tmp_path / "plain")
    with pytest.raises(AssertionError):
        _compare(hf, model, x, atol=1e-4)  # the legacy +0.1 rule is not HF's
    model.interpolate_offset, model.interpolate_antialias = 0.0, False  # HF's rule
    _compare(hf, model, x, atol=1e-5)


def test_hf_export_rejects_non_integer_mlp_ratio(tmp_path):
    model = create_model("vit_test", mlp_ratio=2.5, img_size=56)
    with pytest.raises(ValueError, match="integer mlp_ratio"):
        export_hf(model, tmp_path / "hf")


def test_cli_export_hf_and_preprocessor(tmp_path, capsys):
    model = _model("vit_test")
    hub.save_backbone(model, tmp_path / "export")
    rc = cli_main(["export", "--model", str(tmp_path / "export"), "--format", "hf", "--out", str(tmp_path / "hf")])
    assert rc == 0
    assert "hf" in hub.EXPORTERS
    hf = _load_hf(tmp_path / "hf")
    _compare(hf, model, torch.randn(1, 3, 56, 56), atol=1e-4)
    proc = transformers.AutoImageProcessor.from_pretrained(str(tmp_path / "hf"))
    import numpy as np

    pixels = proc(images=np.zeros((90, 120, 3), dtype=np.uint8), return_tensors="pt")["pixel_values"]
    assert tuple(pixels.shape) == (1, 3, 56, 56)  # crops to the export's native size
