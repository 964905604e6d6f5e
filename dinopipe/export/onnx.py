"""Deployable graphs of a backbone: ONNX (``torch.onnx.export(..., dynamo=True)``) and ``torch.export`` (.pt2).

Both take one input, ``pixel_values`` (B, C, H, W) float32 (C = the model's in_chans), already normalised
(ImageNet mean/std, or the N-channel statistics of the export's config.json), with
dynamic batch, height and width (H and W multiples of the patch size), and return three outputs:

    cls_token        (B, D)       normalised class token (``x_norm_clstoken``)
    register_tokens  (B, R, D)    normalised register / DINOv3 storage tokens (R = 0 for plain DINOv2)
    patch_tokens     (B, h*w, D)  normalised patch tokens, row-major over the (H/p, W/p) grid

Both record what the input must be normalised with (``in_chans``, per-channel ``mean`` and ``std``, JSON strings):
the ONNX model's ``metadata_props`` (onnxruntime: ``get_modelmeta().custom_metadata_map``) and the .pt2
archive's extra file ``dinopipe.json``; :func:`graph_metadata` reads either back (the ``.pt2``'s as a zip member,
without loading the program: running a ``.pt2`` runs code, so :func:`program_runner` needs ``trust_code=True``).

Masks are not an input (they only matter in training). One graph serves every resolution, so the
position information is computed *in the graph* from the input size:

* DINOv3 (RoPE) needs nothing special: the sin/cos tables are arithmetic on ``arange(h)``, ``arange(w)``.
* DINOv2's learned position embedding is resampled bicubically, and eager PyTorch skips the resample at
  the native grid (``if (h, w) == (M, M)``). Traced, that branch becomes a guard that pins the graph to the
  example size: ``torch.export`` refuses the dynamic shapes, and the ONNX exporter (which falls back to
  non-strict tracing) silently bakes in the native-size embedding, so other sizes fail at run time. Here the
  resample is rewritten as two interpolation matrices built from ``arange`` (``resample_matrix``) that
  reproduce PyTorch's ``upsample_bicubic2d`` (legacy ``scale_factor`` path, a = -0.75, clamped borders) and
  ``_upsample_bicubic2d_aa`` (register models, a = -0.5, normalised weights) in every case, the native-grid
  identity included, with no data-dependent branch. It is applied to a copy of the model; the model
  code itself is untouched.

The ONNX exporter is the dynamo one (``torch.export`` + onnxscript), PyTorch's default since 2.9, fed the
same ``torch.export`` program that is saved as ``.pt2``. For the PyTorch-native format ``torch.export`` is
chosen over TorchScript because the docs mark TorchScript deprecated ("please use torch.export instead");
AOTInductor and ExecuTorch consume its programs.
"""

from __future__ import annotations

import copy
import json
import types
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor, nn

from ..utils.norm import in_channels, input_norm
from ..utils.safe_load import CheckpointError, read_archive_file, require_trust

OUTPUT_NAMES = ("cls_token", "register_tokens", "patch_tokens")
INPUT_NAME = "pixel_values"
ONNX_OPSET = 18
MAX_GRID = 512  # patches per side the exported graph accepts (a bound torch.export wants for symbolic dims)
PT2_META = "dinopipe.json"  # the .pt2 archive's extra file holding the input normalisation


def input_metadata(model: nn.Module) -> dict[str, str]:
    """What a graph's input expects: channel count and per-channel statistics (utils/norm.py:input_norm)."""
    mean, std = input_norm(model)
    return {"in_chans": str(in_channels(model)), "mean": json.dumps(mean), "std": json.dumps(std)}


def graph_metadata(path: str | Path) -> dict:
    """``{'in_chans': int, 'mean': [...], 'std': [...]}`` recorded in an exported .onnx or .pt2 ({} if none)."""
    path = Path(path)
    if path.suffix == ".pt2":  # the archive's extra file, read as a zip member: the program is never loaded
        data = read_archive_file(path, PT2_META)
        try:
            raw = json.loads(data) if data else {}
        except ValueError as exc:
            raise CheckpointError(f"{path}: its {PT2_META} is not JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path}: its {PT2_META} is not a JSON object")
    else:
        import onnx

        raw = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
    return {k: json.loads(raw[k]) if isinstance(raw[k], str) else raw[k] for k in ("in_chans", "mean", "std")
            if k in raw}


def _cubic(x: Tensor, a: float) -> Tensor:
    """Keys' cubic convolution kernel (a = -0.75 in upsample_bicubic2d, -0.5 in the antialiased one)."""
    x = x.abs()
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return torch.where(x <= 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


def resample_matrix(n_out: Tensor, n_in: int, offset: float, antialias: bool,
                    native: Optional[Tensor] = None) -> Tensor:
    """(n_out, n_in) matrix M with ``M @ v`` equal to PyTorch's 1-D bicubic resample of ``v`` to ``n_out``.

    ``n_out`` is any tensor whose length is the output length: the size is read as a tensor
    (``arange(len)[-1] + 1``), never as a Python int, so tracing keeps it symbolic and adds no guard.
    ``offset`` > 0 is DINOv2's legacy ``scale_factor = (n_out + offset) / n_in`` rule; eager DINOv2 skips the
    resample when the whole grid is the native one, so the scale is 1 where ``native`` (a bool tensor: both
    axes at the native size) holds.
    """
    dd = dict(dtype=torch.float64, device=n_out.device)  # coordinates in double, as ATen computes them
    dst = torch.arange(n_out.shape[0], **dd)
    size = dst[-1:] + 1  # (1,) output length as a tensor (no guard on the symbolic size)
    if offset:
        keep = native if native is not None else size == n_in
        scale = torch.where(keep, torch.ones_like(size), n_in / (size + offset))  # in / out
    else:
        scale = n_in / size
    src = torch.arange(n_in, **dd)
    if antialias:
        # _upsample_bicubic2d_aa: kernel widened by the downsampling factor, weights normalised per row.
        inv = torch.where(scale >= 1, 1 / scale, torch.ones_like(scale))
        centre = scale * (dst + 0.5)  # (n_out,)
        w = _cubic((src[None, :] - centre[:, None] + 0.5) * inv, -0.5)
        return (w / w.sum(dim=1, keepdim=True)).float()
    # upsample_bicubic2d (align_corners=False): 4 taps around the source point, indices clamped.
    real = scale * (dst + 0.5) - 0.5
    base = real.floor()
    t = real - base
    m = torch.zeros(n_out.shape[0], n_in, **dd)
    for k in (-1, 0, 1, 2):
        idx = (base + k).clamp(0, n_in - 1)
        m = m + _cubic(t - k, -0.75)[:, None] * (src[None, :] == idx[:, None]).to(m.dtype)
    return m.float()


def _traceable_pos_encoding(self: nn.Module, h: int, w: int) -> Tensor:
    """DINOv2 ``interpolate_pos_encoding`` as matrix products (see the module docstring)."""
    pe = self.pos_embed
    m = int(round((pe.shape[1] - 1) ** 0.5))
    gh = torch.empty(h // self.patch_size, device=pe.device)  # only its (symbolic) length is used
    gw = torch.empty(w // self.patch_size, device=pe.device)
    native = ((torch.arange(gh.shape[0], device=pe.device)[-1:] + 1) == m) & (
        (torch.arange(gw.shape[0], device=pe.device)[-1:] + 1) == m)
    rh = resample_matrix(gh, m, self.interpolate_offset, self.interpolate_antialias, native)  # (h', M)
    rw = resample_matrix(gw, m, self.interpolate_offset, self.interpolate_antialias, native)  # (w', M)
    grid = pe[0, 1:].float().reshape(m, m, -1)  # (M, M, D)
    out = torch.einsum("hi,wj,ijd->hwd", rh, rw, grid).reshape(1, -1, pe.shape[-1])
    return torch.cat([pe[:, :1].float(), out], dim=1).to(pe.dtype)


class FeatureGraph(nn.Module):
    """``pixel_values -> (cls_token, register_tokens, patch_tokens)`` around an eval-mode fp32 CPU copy of a
    backbone (ONNX graphs are device-free; the .pt2 program is traced on CPU, AOTInductor retargets it)."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = copy.deepcopy(backbone).cpu().eval().float()
        if hasattr(self.backbone, "pos_embed"):  # DINOv2 family: learned, resampled position embedding
            self.backbone.interpolate_pos_encoding = types.MethodType(_traceable_pos_encoding, self.backbone)
        if hasattr(self.backbone, "set_attn_backend"):
            self.backbone.set_attn_backend("sdpa")  # the portable kernel (no xformers in a graph)

    def forward(self, pixel_values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        out = self.backbone.forward_features(pixel_values)
        return out["x_norm_clstoken"], out["x_norm_regtokens"], out["x_norm_patchtokens"]


def _example_and_shapes(model: nn.Module, image_size: Optional[int]) -> tuple[Tensor, dict]:
    from torch.export import Dim

    p = int(model.patch_size)
    size = int(image_size or 4 * p)
    if size % p or size < 2 * p:
        raise ValueError(f"--image-size {size} is not a multiple of the patch size {p} of at least 2 patches "
                         f"(a 1-patch example would fix the graph to that size)")
    # The example has 4 patches per side: torch.export would specialise a dim whose example value is 0 or 1.
    gh, gw = Dim("grid_h", min=1, max=MAX_GRID), Dim("grid_w", min=1, max=MAX_GRID)
    shapes = {INPUT_NAME: {0: Dim("batch", min=1, max=4096), 2: p * gh, 3: p * gw}}
    return torch.randn(2, in_channels(model), size, size), shapes  # (B, in_chans, H, W)


def trace(model: nn.Module, image_size: Optional[int] = None) -> torch.export.ExportedProgram:
    """``torch.export`` program of ``FeatureGraph(model)`` with dynamic batch/height/width."""
    graph = FeatureGraph(model).eval()
    x, shapes = _example_and_shapes(graph.backbone, image_size)
    with torch.no_grad():
        return torch.export.export(graph, (x,), dynamic_shapes=shapes)


def export_program(model: nn.Module, out_path: str | Path, image_size: Optional[int] = None,
                   program: Optional[torch.export.ExportedProgram] = None) -> Path:
    """Saved ``.pt2``; load with ``torch.export.load(PATH).module()``. ``program``: reuse a ``trace``."""
    out = _out_file(out_path, ".pt2")
    torch.export.save(program if program is not None else trace(model, image_size), str(out),
                      extra_files={PT2_META: json.dumps(input_metadata(model))})
    return out


def export_onnx(model: nn.Module, out_path: str | Path, image_size: Optional[int] = None,
                opset: int = ONNX_OPSET, program: Optional[torch.export.ExportedProgram] = None) -> Path:
    """ONNX graph (dynamo exporter, from the ``torch.export`` program) with dynamic batch/height/width."""
    try:
        import onnxscript  # noqa: F401  (the dynamo exporter translates through it)
    except ImportError as exc:
        raise ValueError("ONNX export needs onnx and onnxscript: pip install 'dinopipe[onnx]'") from exc
    out = _out_file(out_path, ".onnx")
    ep = program if program is not None else trace(model, image_size)
    onnx_prog = torch.onnx.export(ep, dynamo=True, opset_version=opset, input_names=[INPUT_NAME],
                                  output_names=list(OUTPUT_NAMES), verbose=False)
    onnx_prog.model.metadata_props.update(input_metadata(model))
    onnx_prog.save(str(out))
    return out


def _out_file(out_path: str | Path, suffix: str) -> Path:
    out = Path(out_path)
    if out.suffix != suffix:  # a folder
        out.mkdir(parents=True, exist_ok=True)
        out = out / f"backbone{suffix}"
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
    return out


def max_abs_diff(model: nn.Module, run: Any, x: Tensor) -> dict[str, float]:
    """Max |exported - eager| per output for ``run(x) -> 3 arrays/tensors``; eager runs the model itself."""
    with torch.no_grad():
        ref = FeatureGraph.forward(types.SimpleNamespace(backbone=model.eval()), x)
        got = run(x)
    return {name: float((torch.as_tensor(g) - r).abs().max()) if r.numel() else 0.0
            for name, g, r in zip(OUTPUT_NAMES, got, ref)}


def onnx_runner(path: str | Path) -> Any:
    """``x -> outputs`` through onnxruntime on CPU."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return lambda x: sess.run(list(OUTPUT_NAMES), {INPUT_NAME: x.numpy()})


def program_runner(path: str | Path, trust_code: bool = False) -> Any:
    """``x -> outputs`` through the saved program ``path``. Loading a ``.pt2`` runs code (``torch.export.load``
    falls back to unpickling when its weights-only load fails), so it needs ``trust_code=True``."""
    require_trust(path, "a torch.export program (.pt2)", trust_code, "program_runner(..., trust_code=True)")
    mod = torch.export.load(str(path)).module()
    return lambda x: mod(x)


__all__ = ["export_onnx", "export_program", "graph_metadata", "input_metadata",
           "trace", "FeatureGraph", "resample_matrix", "max_abs_diff", "onnx_runner",
           "program_runner", "OUTPUT_NAMES", "INPUT_NAME"]

