"""The official DINOv3 layout (RoPE periods, storage tokens, masked key bias) as a ``.pth``."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..models.convert_dinov3 import to_official_dinov3
from .backbone import _contiguous_cpu, _is_dinov3, export_arch, write_sidecar


def export_dinov3(model: nn.Module, out_path: str | Path) -> Path:
    """A ``.pth`` in the official DINOv3 layout: ``dinov3.hub.backbones.dinov3_*(weights=PATH)`` loads it
    (strict), with ``rope_embed.periods`` and the masked key bias's ``bias_mask``."""
    out = Path(out_path)
    if out.suffix != ".pth":
        out.mkdir(parents=True, exist_ok=True)
        out = out / "backbone.pth"
    arch = export_arch(model)
    if not _is_dinov3(arch):
        raise ValueError("only DINOv3 backbones (RoPE) have the DINOv3 layout: use --format dinov2 for this one")
    torch.save(to_official_dinov3(_contiguous_cpu(model.state_dict()), arch), out)
    write_sidecar(out, arch)  # FILE.json: the whole architecture, for dinopipe.load (official loaders ignore it)
    return out


__all__ = ["export_dinov3"]
