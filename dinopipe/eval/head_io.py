"""A trained dense head saved with its backbone, and read back as one model that predicts.

Folder layout (nothing pickled)::

    OUT/config.json          {"format": "dinopipe-head/1", "task": "depth", "head": {...}, "backbone": "backbone",
                              "backbone_source": "<what --model was>"}
    OUT/head.safetensors     the head's weights
    OUT/backbone/            the backbone as a dinopipe export folder (model.safetensors + config.json)

``dinopipe.load(OUT)`` returns ``load_head_model(OUT)``: a module in eval mode whose ``forward(images)`` (normalised
(B, 3, H, W), any H and W) returns the task's prediction (depth: (B, 1, H, W) metres). The model is rebuilt by the
builder registered for the config's ``task`` (:func:`register_head_builder`; depth's is here, the other tasks'
register from their modules), so the folder names what to build, never code. ``export_head`` traces
backbone + head to torch.export (.pt2) and ONNX with dynamic height and width.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors.torch import save_file
from torch import nn

from ..export.backbone import CONFIG_NAME, save_backbone
from ..utils.io import atomic_path, atomic_write_json
from ..utils.safe_load import CheckpointError, read_safetensors

HEAD_FORMAT = "dinopipe-head/1"
HEAD_WEIGHTS = "head.safetensors"
BACKBONE_DIR = "backbone"

# task -> (backbone, head_config) -> (model that predicts, the submodule whose weights head.safetensors holds)
HeadBuilder = Callable[[nn.Module, dict], tuple[nn.Module, nn.Module]]
_BUILDERS: dict[str, HeadBuilder] = {}
# tasks whose builder lives in another module: imported when such a folder is loaded
_BUILDER_MODULES = {"depth": __name__, "seg": "dinopipe.eval.seg_model", "detect": "dinopipe.eval.detect"}


def register_head_builder(task: str, builder: HeadBuilder) -> None:
    _BUILDERS[task] = builder


def is_head_folder(path: str | Path) -> bool:
    cfg = Path(path) / CONFIG_NAME
    if not cfg.is_file():
        return False
    try:
        return str(json.loads(cfg.read_text()).get("format", "")).startswith("dinopipe-head/")
    except (ValueError, AttributeError):
        return False


def save_head(out_dir: str | Path, backbone_ref: nn.Module | str, head: nn.Module, head_config: dict) -> Path:
    """Write ``head``'s weights and ``head_config`` (must hold ``task``) next to the backbone: ``backbone_ref`` a
    module (saved whole under backbone/, e.g. when it was tuned) or a path/name ``dinopipe.load`` reads (recorded,
    loaded from there)."""
    if "task" not in head_config:
        raise ValueError("head_config needs a 'task' (the builder that rebuilds the model)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg: dict[str, Any] = {"format": HEAD_FORMAT, "task": head_config["task"], "head": dict(head_config)}
    if isinstance(backbone_ref, nn.Module):
        save_backbone(backbone_ref, out / BACKBONE_DIR)
        cfg["backbone"] = BACKBONE_DIR
    else:
        cfg["backbone"] = str(backbone_ref)
    sd = {k: v.detach().to("cpu").contiguous() for k, v in head.state_dict().items()}
    with atomic_path(out / HEAD_WEIGHTS) as tmp:
        save_file(sd, tmp, metadata={"dinopipe_head": json.dumps(cfg["head"])})
    atomic_write_json(out / CONFIG_NAME, cfg, indent=2)  # last: a folder without it is not a head folder
    return out


def load_head_model(path: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    from ..hub import load

    path = Path(path)
    try:
        cfg = json.loads((path / CONFIG_NAME).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a dinopipe head folder ({exc})") from None
    task = cfg.get("task")
    if task not in _BUILDERS and task in _BUILDER_MODULES:
        import importlib

        importlib.import_module(_BUILDER_MODULES[task])
    if task not in _BUILDERS:
        raise CheckpointError(f"{path}: no head builder for task '{task}' (known: {sorted(_BUILDERS)})")
    ref = str(cfg.get("backbone", BACKBONE_DIR))
    backbone = load(path / ref if (path / ref).exists() else ref, device="cpu")
    model, head = _BUILDERS[task](backbone, dict(cfg["head"]))
    sd, _ = read_safetensors(path / HEAD_WEIGHTS)
    try:
        head.load_state_dict(sd, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"{path / HEAD_WEIGHTS}: does not fit the head {cfg['head']}: "
                              f"{str(exc).splitlines()[-1].strip()[:300]}") from None
    model.head_config = dict(cfg["head"])  # what the exports record
    return model.to(device).eval()


def _build_depth(backbone: nn.Module, hc: dict) -> tuple[nn.Module, nn.Module]:
    from .depth import DepthModel, build_head

    head, layers = build_head(hc["head"], backbone.embed_dim, backbone.n_blocks, hc.get("protocol", "dinov3"),
                              int(hc.get("n_bins", 256)), int(hc.get("dpt_features", 0)) or None)
    if list(layers) != list(hc.get("layers", layers)):
        raise CheckpointError(f"head config layers {hc.get('layers')} differ from the head's {layers}")
    model = DepthModel(backbone, head, layers, float(hc["min_depth"]), float(hc["max_depth"]))
    return model, head


register_head_builder("depth", _build_depth)


# -- deployable graphs of backbone + head -------------------------------------------------------------------
def _pool_matrix(n: torch.Tensor, out: int, like: torch.Tensor) -> torch.Tensor:
    """(out, n) averaging matrix of adaptive average pooling over a length-``n`` axis: row i averages
    [floor(i n / out), ceil((i + 1) n / out)), as torch's adaptive_avg_pool2d defines its windows."""
    idx = torch.arange(n, device=like.device)
    i = torch.arange(out, device=like.device)
    start, end = (i * n) // out, ((i + 1) * n + out - 1) // out
    m = ((idx[None] >= start[:, None]) & (idx[None] < end[:, None])).to(like.dtype)
    return m / m.sum(1, keepdim=True)


class TraceableAdaptiveAvgPool2d(nn.Module):
    """nn.AdaptiveAvgPool2d as two matrix products built from the input's size: ONNX exporters otherwise fix its
    kernel to the traced size (UperNet's pyramid pooling then gave wrong scores, up to 1e-2, at any other size)."""

    def __init__(self, output_size) -> None:
        super().__init__()
        o = output_size if isinstance(output_size, (tuple, list)) else (output_size, output_size)
        self.out_h, self.out_w = int(o[0]), int(o[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ph = _pool_matrix(x.shape[-2], self.out_h, x)
        pw = _pool_matrix(x.shape[-1], self.out_w, x)
        return torch.matmul(torch.matmul(ph, x), pw.transpose(0, 1))


def _traceable_pools(model: nn.Module) -> None:
    """Swap every fixed-size nn.AdaptiveAvgPool2d of ``model`` for :class:`TraceableAdaptiveAvgPool2d`: where it is
    registered and in the plain lists some modules also call it through (transformers' UperNet's ``layers``)."""
    swap: dict[int, nn.Module] = {}
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            size = getattr(child, "output_size", None)
            sizes = size if isinstance(size, (tuple, list)) else (size,)
            if isinstance(child, nn.AdaptiveAvgPool2d) and None not in sizes:
                new = swap.setdefault(id(child), TraceableAdaptiveAvgPool2d(size))
                setattr(module, name, new)
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, list):
                value[:] = [swap.get(id(v), v) for v in value]


def _graph(model: nn.Module) -> nn.Module:
    """An eval-mode fp32 CPU copy whose backbone traces at any grid (the backbone export's patches:
    ``export/onnx.py``): the DINOv2 position embedding resampled by matrix products, SDPA attention; and whose head's
    adaptive average pools (UperNet's pyramid pooling) are size-generic matrix products."""
    import copy
    import types

    from ..export.onnx import _traceable_pos_encoding

    g = copy.deepcopy(model).cpu().eval().float()
    _traceable_pools(g)
    bb = g.backbone
    if hasattr(bb, "pos_embed"):
        bb.interpolate_pos_encoding = types.MethodType(_traceable_pos_encoding, bb)
    if hasattr(bb, "set_attn_backend"):
        bb.set_attn_backend("sdpa")
    return g


def _fixed_export_size(model: nn.Module, image_size: Optional[int]) -> Optional[int]:
    """The one size a head that cannot trace size-generic is exported at (None: the head traces at any size)."""
    if getattr(getattr(model, "head", None), "size_generic_export", True):
        return None
    return int(image_size or (getattr(model, "head_config", None) or {}).get("img_size")
               or 4 * int(model.backbone.patch_size))


def trace_head_model(model: nn.Module, image_size: Optional[int] = None) -> torch.export.ExportedProgram:
    """torch.export of ``model.forward(images)``: dynamic batch, height and width (multiples of the patch, at least
    3 patches). A head whose code fixes its spatial sizes in Python (``size_generic_export = False``: Mask2Former,
    whose deformable attention splits its values by the levels' sizes as ints) is traced at one size, dynamic batch:
    ``image_size`` or the size it was trained at (``head_config["img_size"]``, the window slide inference uses)."""
    from torch.export import Dim

    g = _graph(model)
    p = int(g.backbone.patch_size)
    batch = Dim("batch", min=1, max=4096)
    fixed = _fixed_export_size(model, image_size)
    if fixed is not None:
        with torch.no_grad():
            return torch.export.export(g, (torch.randn(2, 3, fixed, fixed),), dynamic_shapes=({0: batch},))
    size = int(image_size or 4 * p)
    # >= 3 patches a side: a DPT head's stride-2 level then has >= 2 rows (a size-1 dim would be specialised)
    # by position: each task's model names its input as it likes (depth ``x``, seg ``images``)
    shapes = ({0: batch, 2: p * Dim("grid_h", min=3, max=512), 3: p * Dim("grid_w", min=3, max=512)},)
    with torch.no_grad():
        return torch.export.export(g, (torch.randn(2, 3, size, size),), dynamic_shapes=shapes)


def export_head(model: nn.Module, out_dir: str | Path, image_size: Optional[int] = None,
                onnx: bool = True) -> dict[str, Path]:
    """``out_dir/model.pt2`` (torch.export) and ``out_dir/model.onnx`` of backbone + head (input ``images``,
    output ``prediction``), the head's config in the graphs' metadata (with ``export_size`` [H, W] where the graph
    takes one size only: :func:`trace_head_model`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    program = trace_head_model(model, image_size)
    paths = {"pt2": out / "model.pt2"}
    meta = dict(getattr(model, "head_config", {}) or {})
    fixed = _fixed_export_size(model, image_size)
    if fixed is not None:
        meta["export_size"] = [fixed, fixed]
    meta = json.dumps(meta)
    with atomic_path(paths["pt2"]) as tmp:
        torch.export.save(program, tmp, extra_files={"dinopipe_head.json": meta})
    if onnx:
        paths["onnx"] = out / "model.onnx"
        prog = torch.onnx.export(program, dynamo=True, input_names=["images"], output_names=["prediction"],
                                 verbose=False)
        prog.model.metadata_props.update({"dinopipe_head": meta})
        with atomic_path(paths["onnx"]) as tmp:
            prog.save(tmp)
    return paths


__all__ = ["HEAD_FORMAT", "save_head", "load_head_model", "is_head_folder", "register_head_builder",
           "export_head", "trace_head_model"]
