"""Every export loads back exactly: each format x {DINOv2 with registers and an unusual head count, DINOv3 with
RoPE}, written with `dinopipe export` and read back with dinopipe.load (or run, for the graph formats), gives
the same features at the native size to 1e-5. A file that does not say its head count is refused, not guessed."""

import importlib.util
import json

import pytest
import torch

import dinopipe
from dinopipe.app.cli import main
from dinopipe.hub import CheckpointError
from dinopipe.models import create_model

HAVE_ONNX = all(importlib.util.find_spec(m) for m in ("onnx", "onnxruntime", "onnxscript"))
TOL = 1e-5

MODELS = {
    # 3 heads of 16 dims (dim/64 would say 1), 4 registers, SwiGLU, no LayerScale on one: nothing default
    "dinov2_reg4_3heads": dict(name="vit_test_reg4", embed_dim=48, num_heads=3, depth=2, img_size=42, ffn="swiglu"),
    "dinov2_2heads_mlp": dict(name="vit_test", embed_dim=64, num_heads=2, depth=2, img_size=56),  # the quickstart's
    "dinov3_rope_3heads": dict(name="vit_test_dinov3", embed_dim=48, num_heads=3, depth=2, img_size=48),
}
FORMATS = {"dinopipe": "dir", "safetensors": "dir", "timm": "dir", "hf": "dir", "dinov2": "x.pth", "dinov3": "x.pth"}


def _model(kind):
    torch.manual_seed(0)
    kw = dict(MODELS[kind])
    m = create_model(kw.pop("name"), **kw).eval()
    with torch.no_grad():  # non-trivial tokens, scales and biases: zeros would hide a layout mistake
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m


def _features(model, x):
    with torch.no_grad():
        f = model.forward_features(x)
    return {k: f[k] for k in ("x_norm_clstoken", "x_norm_regtokens", "x_norm_patchtokens")}


def _same(a, b, what):
    fa, fb = _features(a, _x(a)), _features(b, _x(a))
    for k in fa:
        assert fa[k].shape == fb[k].shape, (what, k)
        diff = (fa[k] - fb[k]).abs().max().item() if fa[k].numel() else 0.0
        assert diff <= TOL, (what, k, diff)


def _x(model):
    size = model.arch_config()["img_size"]
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("kind", list(MODELS))
def test_every_format_loads_back_exactly(tmp_path, capsys, kind, fmt):
    model = _model(kind)
    src = dinopipe.hub.save_backbone(model, tmp_path / "src")
    out = tmp_path / ("out" if FORMATS[fmt] == "dir" else "out.pth")
    rc = main(["export", "--model", str(src), "--format", fmt, "--out", str(out)])
    family = "dinov3" if "dinov3" in kind else "dinov2"
    if fmt in ("dinov2", "dinov3") and fmt != family:
        assert rc == 2 and f"--format {family}" in capsys.readouterr().err  # the layout cannot hold it
        return
    assert rc == 0, capsys.readouterr().err
    back = dinopipe.load(out)
    assert back.num_heads == model.num_heads and back.num_register_tokens == model.num_register_tokens
    assert back.patch_size == model.patch_size
    _same(model, back, fmt)


@pytest.mark.skipif(not HAVE_ONNX, reason="onnx/onnxruntime/onnxscript not installed")
@pytest.mark.parametrize("kind", ["dinov2_reg4_3heads", "dinov3_rope_3heads"])
def test_graph_exports_run_like_the_model(tmp_path, kind):
    from dinopipe.export.onnx import export_onnx, export_program, onnx_runner, program_runner

    model = _model(kind)
    x = _x(model)
    ref = _features(model, x)
    want = (ref["x_norm_clstoken"], ref["x_norm_regtokens"], ref["x_norm_patchtokens"])
    size = x.shape[-1]
    for run in (program_runner(export_program(model, tmp_path / "m.pt2", size), trust_code=True),
                onnx_runner(export_onnx(model, tmp_path / "m.onnx", size))):
        for got, ref_t in zip(run(x), want):
            assert (torch.as_tensor(got) - ref_t).abs().max().item() <= TOL


def test_official_layout_without_its_record_refuses_to_guess_the_heads(tmp_path):
    """The DINOv2 .pth holds no head count: with the record beside it (FILE.json) it loads exactly; without it,
    a non-released width is refused naming num_heads, and num_heads=N loads it."""
    model = _model("dinov2_reg4_3heads")
    pth = dinopipe.hub.export_dinov2(model, tmp_path / "b.pth")
    assert json.loads((tmp_path / "b.json").read_text())["arch"]["num_heads"] == 3
    _same(model, dinopipe.load(pth), "with record")
    (tmp_path / "b.json").unlink()
    with pytest.raises(CheckpointError, match="num_heads"):
        dinopipe.load(pth)
    _same(model, dinopipe.load(pth, num_heads=3), "num_heads given")


def _hf_dinov3_folder(tmp_path, **cfg_changes):
    model = _model("dinov3_rope_3heads")
    out = dinopipe.hub.export_hf(model, tmp_path / "hf")
    from safetensors.torch import load_file, save_file

    sd = load_file(str(out / "model.safetensors"))  # as a foreign folder: no dinopipe record
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(cfg_changes)
    (out / "config.json").write_text(json.dumps(cfg))
    return model, out, sd


def test_foreign_hf_dinov3_config_is_read_whole(tmp_path):
    model, out, sd = _hf_dinov3_folder(tmp_path)
    _same(model, dinopipe.load(out), "hf dinov3 from config.json")
    # proj_bias=false is honoured: a folder without output-projection biases loads (biases absent)
    from safetensors.torch import save_file

    no_bias = {k: v for k, v in sd.items() if not k.endswith("attention.o_proj.bias")}
    save_file(no_bias, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "proj_bias": False}))
    back = dinopipe.load(out)
    assert back.blocks[0].attn.proj.bias is None
    # a key bias is honoured (read, and dropped exactly: softmax over keys ignores it)
    with_k = dict(sd)
    for k in [k for k in sd if k.endswith("attention.q_proj.bias")]:
        with_k[k.replace("q_proj", "k_proj")] = torch.randn_like(sd[k])
    save_file(with_k, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**cfg, "key_bias": True}))
    _same(model, dinopipe.load(out), "hf dinov3 with a key bias")


@pytest.mark.parametrize("change, field", [({"rope_scaling": {"type": "yarn"}}, "rope_scaling"),
                                           ({"hidden_act": "relu"}, "hidden_act")])
def test_foreign_hf_dinov3_field_it_cannot_honour_is_an_error_naming_it(tmp_path, change, field):
    _, out, _ = _hf_dinov3_folder(tmp_path, **change)
    with pytest.raises(CheckpointError, match=field):
        dinopipe.load(out)


@pytest.mark.parametrize("change, field", [({"layer_norm_eps": 1e-5}, "layer_norm_eps"),
                                           ({"hidden_act": "gelu_new"}, "hidden_act"),
                                           ({"some_new_switch": True}, "some_new_switch")])
def test_foreign_hf_dinov2_field_it_cannot_honour_is_an_error_naming_it(tmp_path, change, field):
    from safetensors.torch import load_file, save_file

    model = _model("dinov2_2heads_mlp")
    out = dinopipe.hub.export_hf(model, tmp_path / "hf")
    save_file(load_file(str(out / "model.safetensors")), str(out / "model.safetensors"), metadata={"format": "pt"})
    _same(model, dinopipe.load(out), "hf dinov2 from config.json")
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(CheckpointError, match=field):
        dinopipe.load(out)
