"""Every way a backbone leaves dinopipe, in one place: the dinopipe export folder (``backbone``), timm,
Hugging Face transformers (``hf``), the official DINOv2 / DINOv3 ``.pth`` layouts, and deployable graphs
(``onnx``: ONNX and ``torch.export`` .pt2, imported on demand). ``dinopipe.hub`` reads them back; this package
never imports it, so the two do not form a cycle.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from .backbone import (
    ARCH_METADATA_KEY,
    CONFIG_NAME,
    EXPORT_FORMAT,
    HEADS_NAME,
    IMAGENET_MEAN,
    IMAGENET_STD,
    WEIGHTS_NAME,
    export_arch,
    read_sidecar,
    save_backbone,
    save_heads,
)
from .dinov2 import export_dinov2
from .dinov3 import export_dinov3
from .hf import export_hf
from .timm import export_timm

EXPORTERS = {
    "dinopipe": save_backbone,
    "safetensors": save_backbone,
    "timm": export_timm,
    "dinov2": export_dinov2,
    "dinov3": export_dinov3,
    "hf": export_hf,  # transformers Dinov2Model / Dinov2WithRegistersModel / DINOv3ViTModel folder
}

TIMM_STUDENT_FORMATS = ("dinopipe", "safetensors", "timm")


def export(model: nn.Module, fmt: str, out: str | Path) -> Path:
    """Write ``model`` in weight layout ``fmt`` (see EXPORTERS); returns the file or folder written."""
    if fmt not in EXPORTERS:
        raise ValueError(f"unknown export format '{fmt}'; choose from {sorted(EXPORTERS)}")
    if (getattr(model, "arch_config", lambda: {})() or {}).get("family") == "timm" and fmt not in TIMM_STUDENT_FORMATS:
        raise ValueError(f"'{fmt}' is a ViT layout; a timm student ({model.arch_config()['model']}) exports as "
                         f"{' | '.join(TIMM_STUDENT_FORMATS)} (or onnx | pt2)")
    return EXPORTERS[fmt](model, out)


__all__ = [
    "export", "EXPORTERS", "read_sidecar", "save_backbone", "save_heads", "export_arch", "export_timm", "export_dinov2",
    "export_dinov3", "export_hf", "WEIGHTS_NAME", "CONFIG_NAME", "HEADS_NAME", "ARCH_METADATA_KEY",
    "EXPORT_FORMAT", "IMAGENET_MEAN", "IMAGENET_STD",
]
