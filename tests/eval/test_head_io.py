"""Backbone + head saved together: ``dinopipe.load`` gives back a model that predicts the same, nothing pickled, and
the ONNX / torch.export graphs of backbone + head predict the same (1e-5) at sizes never traced."""

from __future__ import annotations

import json

import pytest
import torch

import dinopipe
from dinopipe.eval.depth import DepthModel, build_head
from dinopipe.eval.head_io import export_head, load_head_model, save_head
from dinopipe.models import create_model

from ..test_export_onnx import needs_onnx

CASES = {  # backbone families: DINOv2 pos-embed, registers, DINOv3 RoPE + storage tokens
    "dinov2": "vit_test", "dinov2_reg4": "vit_test_reg4", "dinov3": "vit_test_dinov3"}


def _model(family: str, head: str, depth: int = 4) -> DepthModel:
    torch.manual_seed(0)
    bb = create_model(CASES[family], img_size=64 if family == "dinov3" else 56, depth=depth).eval()
    h, layers = build_head(head, bb.embed_dim, bb.n_blocks, "dinov2" if head == "linear" else "dinov3",
                           n_bins=32, dpt_features=16)
    with torch.no_grad():  # non-trivial weights: a swapped layer or token must show
        for p in list(bb.parameters()) + list(h.parameters()):
            p.add_(0.05 * torch.randn_like(p))
    for m in h.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2)
    return DepthModel(bb, h, layers, 1e-3, 10.0).eval()


def _cfg(model: DepthModel, head: str) -> dict:
    return {"task": "depth", "head": head, "protocol": "dinov2" if head == "linear" else "dinov3", "n_bins": 32,
            "layers": model.features.layers, "min_depth": 1e-3, "max_depth": 10.0, "dpt_features": 16}


@pytest.mark.parametrize("family", list(CASES))
@pytest.mark.parametrize("head", ["linear", "dpt"])
def test_saved_head_loads_as_a_model_that_predicts_the_same(tmp_path, family, head):
    model = _model(family, head)
    save_head(tmp_path / "m", model.backbone, model.head, _cfg(model, head))
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["format"] == "dinopipe-head/1" and cfg["head"]["head"] == head
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["backbone", "config.json", "head.safetensors"]
    loaded = dinopipe.load(tmp_path / "m")
    p = int(model.patch)
    for shape in ((2, 3, 4 * p, 4 * p), (1, 3, 3 * p + 5, 5 * p - 3)):  # also sizes the model pads
        x = torch.randn(*shape)
        with torch.no_grad():
            torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=1e-6)


def test_head_folder_errors_name_the_file(tmp_path):
    model = _model("dinov2", "linear")
    save_head(tmp_path / "m", model.backbone, model.head, _cfg(model, "linear"))
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["task"] = "teleport"
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(dinopipe.hub.CheckpointError, match="no head builder for task 'teleport'"):
        load_head_model(tmp_path / "m")
    with pytest.raises(ValueError, match="task"):
        save_head(tmp_path / "n", model.backbone, model.head, {"head": "linear"})


@needs_onnx
@pytest.mark.slow  # ~60 s on a busy 2-core machine: one trace, its ONNX conversion, three sizes each
def test_onnx_and_torch_export_of_backbone_and_head_match_at_new_sizes(tmp_path):
    """The DPT head (its ops include the linear head's) on a RoPE backbone with storage tokens; the DINOv2
    position-embedding resample in a graph is tests/test_export_onnx.py's."""
    family, head = "dinov3", "dpt"
    import onnxruntime as ort

    model = _model(family, head, depth=1)
    model.head_config = _cfg(model, head)
    paths = export_head(model, tmp_path)
    program = torch.export.load(str(paths["pt2"])).module()
    sess = ort.InferenceSession(str(paths["onnx"]), providers=["CPUExecutionProvider"])
    meta = sess.get_modelmeta().custom_metadata_map
    assert json.loads(meta["dinopipe_head"])["head"] == head  # the head's config travels in the graph
    p = int(model.patch)
    for shape in ((2, 3, 4 * p, 4 * p), (3, 3, 6 * p, 5 * p), (1, 3, 3 * p, 7 * p)):  # traced, then never traced
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            ref = model(x)
            got_pt2 = program(x)
        got_onnx = torch.as_tensor(sess.run(["prediction"], {"images": x.numpy()})[0])
        assert ref.shape == (shape[0], 1, shape[2], shape[3])
        torch.testing.assert_close(got_pt2, ref, rtol=0, atol=1e-5)
        torch.testing.assert_close(got_onnx, ref, rtol=0, atol=1e-5)
