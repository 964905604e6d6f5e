"""The dinopipe export folder every training run writes (RUN/export/NAME): ``model.safetensors`` with the
architecture in its metadata, ``config.json`` (format, arch, normalisation, provenance) and, for a pretraining
teacher, ``heads.safetensors``. ``dinopipe.hub.load`` reads it back; nothing here needs torch.distributed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional

from safetensors.torch import save_file
from torch import Tensor, nn

from ..models.convert import infer_arch
from ..models.registry import TRAINING_ONLY_KEYS
from ..utils.io import atomic_path
from ..utils.norm import IMAGENET_MEAN, IMAGENET_STD, input_norm

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
HEADS_NAME = "heads.safetensors"
ARCH_METADATA_KEY = "dinopipe_arch"
EXPORT_FORMAT = "dinopipe-backbone/1"


def _is_dinov3(arch: Mapping[str, Any]) -> bool:
    return arch.get("family") == "dinov3"


def _ffn_hidden(model: nn.Module) -> int:
    return int(model.blocks[0].mlp.fc2.in_features)


def export_arch(model: nn.Module) -> dict[str, Any]:
    arch = model.arch_config() or infer_arch(model.state_dict(), num_heads=model.num_heads)
    return {k: v for k, v in arch.items() if k not in TRAINING_ONLY_KEYS}


def _contiguous_cpu(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}


def save_backbone(model: nn.Module, out_dir: str | Path, extra: Optional[dict] = None) -> Path:
    """dinopipe export folder: model.safetensors (arch in its metadata) + config.json. No torch.distributed."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arch = export_arch(model)
    with atomic_path(out / WEIGHTS_NAME) as tmp:
        save_file(_contiguous_cpu(model.state_dict()), tmp, metadata={ARCH_METADATA_KEY: json.dumps(arch)})
    mean, std = input_norm(model)  # per input channel (utils/norm.py)
    cfg = {"format": EXPORT_FORMAT, "arch": arch, "mean": mean, "std": std, **(extra or {})}
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2))
    return out


def sidecar_path(weights: str | Path) -> Path:
    """FILE.pth -> FILE.json: where the official-layout exports record the architecture (the official loaders
    load the .pth strictly, so it cannot hold anything but the weights)."""
    return Path(weights).with_suffix(".json")


def write_sidecar(weights: Path, arch: Mapping[str, Any]) -> Path:
    out = sidecar_path(weights)
    out.write_text(json.dumps({"format": EXPORT_FORMAT, "arch": dict(arch)}, indent=2))
    return out


def read_sidecar(weights: str | Path) -> Optional[dict]:
    """The architecture an export recorded beside a weights file, or None (a file from elsewhere)."""
    path = sidecar_path(weights)
    if path == Path(weights) or not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return dict(cfg["arch"]) if isinstance(cfg, dict) and cfg.get("format") == EXPORT_FORMAT else None


def save_heads(out_dir: str | Path, heads: Mapping[str, Mapping[str, Tensor]]) -> Path:
    """{head name: state dict} -> OUT/heads.safetensors (what ``load_heads`` reads back)."""
    out = Path(out_dir) / HEADS_NAME
    save_file({f"{name}.{k}": v.detach().to("cpu").contiguous() for name, sd in heads.items() for k, v in sd.items()},
              str(out))
    return out


__all__ = ["save_backbone", "save_heads", "export_arch", "read_sidecar", "write_sidecar", "sidecar_path",
           "WEIGHTS_NAME", "CONFIG_NAME", "HEADS_NAME",
           "ARCH_METADATA_KEY", "EXPORT_FORMAT", "IMAGENET_MEAN", "IMAGENET_STD"]
