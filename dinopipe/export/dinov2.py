"""The official DINOv2 hub layout (``cls_token``, ``pos_embed``, ``blocks.N.*``, ...) as a ``.pth``."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..models.convert import to_dinov2
from .backbone import _contiguous_cpu, _is_dinov3, export_arch, write_sidecar


def export_dinov2(model: nn.Module, out_path: str | Path) -> Path:
    """A ``.pth`` in the official DINOv2 hub layout (plain tensors, loadable with weights_only=True)."""
    out = Path(out_path)
    if out.suffix != ".pth":
        out.mkdir(parents=True, exist_ok=True)
        out = out / "backbone.pth"
    arch = export_arch(model)
    if _is_dinov3(arch):
        raise ValueError("a DINOv3 backbone (RoPE, no position embedding) has no DINOv2 layout: use --format dinov3")
    torch.save(to_dinov2(_contiguous_cpu(model.state_dict()), arch.get("ffn", "mlp")), out)
    write_sidecar(out, arch)  # FILE.json: the whole architecture, for dinopipe.load (official loaders ignore it)
    return out


__all__ = ["export_dinov2"]
