"""timm layout: a folder ``timm.create_model('local-dir:DIR', pretrained=True)`` loads (DINOv2 ``vit_*`` or
DINOv3 ``vit_*_dinov3`` architectures, with their ``model_args``; a ``timm:NAME`` student as NAME itself)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file
from torch import nn

from ..models.convert import timm_model_args, to_timm
from ..models.convert_dinov3 import timm_dinov3_model_args, to_timm_dinov3
from ..utils.norm import IMAGENET_MEAN, IMAGENET_STD, input_norm
from .backbone import (
    ARCH_METADATA_KEY,
    CONFIG_NAME,
    WEIGHTS_NAME,
    _contiguous_cpu,
    _ffn_hidden,
    _is_dinov3,
    export_arch,
)


def _export_timm_student(model: nn.Module, arch: dict, out: Path) -> Path:
    """A timm student (``timm:NAME``): timm's own keys and architecture name, so ``timm.create_model(NAME,
    pretrained=True, num_classes=0, pretrained_cfg_overlay=dict(file=OUT/model.safetensors))`` or
    ``timm.create_model('local-dir:OUT', pretrained=True)`` rebuild it (the pooled feature is its output)."""
    src_cfg = dict(getattr(model.model, "pretrained_cfg", None) or {})
    size = int(arch["img_size"])
    cfg = {
        "architecture": arch["model"],
        "num_classes": 0,
        "num_features": int(model.embed_dim),
        "model_args": {**arch.get("model_args", {}), "in_chans": int(arch.get("in_chans", 3))},
        "pretrained_cfg": {
            "tag": "dinopipe",
            "input_size": [int(arch.get("in_chans", 3)), size, size],
            "fixed_input_size": False,
            "interpolation": "bicubic",
            "crop_pct": 1.0,
            "crop_mode": "center",
            "mean": list(IMAGENET_MEAN),
            "std": list(IMAGENET_STD),
            "num_classes": 0,
            "pool_size": None,
            "first_conv": src_cfg.get("first_conv", ""),
            "classifier": src_cfg.get("classifier", ""),
            "license": "apache-2.0",
        },
    }
    save_file(_contiguous_cpu(model.timm_state_dict()), str(out / WEIGHTS_NAME),
              metadata={ARCH_METADATA_KEY: json.dumps(arch)})
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2))
    return out


def export_timm(model: nn.Module, out_dir: str | Path) -> Path:
    """A folder that ``timm.create_model('local-dir:DIR', pretrained=True)`` loads, as timm's hub folders."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arch = export_arch(model)
    if arch.get("family") == "timm":
        return _export_timm_student(model, arch, out)
    if _is_dinov3(arch):
        name, model_args = timm_dinov3_model_args(arch, _ffn_hidden(model))
        weights = to_timm_dinov3(model.state_dict(), arch)
    else:
        name, model_args = timm_model_args(arch)
        weights = to_timm(model.state_dict())
    size = int(arch["img_size"])
    mean, std = input_norm(model)  # one value per input channel (utils/norm.py)
    cfg = {
        "architecture": name,
        "num_classes": 0,
        "num_features": int(arch["embed_dim"]),
        "model_args": model_args,
        "pretrained_cfg": {
            "tag": "dinopipe",
            "input_size": [int(arch.get("in_chans", 3)), size, size],
            "fixed_input_size": False,
            "interpolation": "bicubic",
            "crop_pct": 1.0,
            "crop_mode": "center",
            "mean": mean,
            "std": std,
            "num_classes": 0,
            "pool_size": None,
            "first_conv": "patch_embed.proj",
            "classifier": "head",
            "license": "apache-2.0",
        },
    }
    # timm ignores the metadata; dinopipe.load reads the whole architecture from it (exact round trip)
    save_file(_contiguous_cpu(weights), str(out / WEIGHTS_NAME), metadata={ARCH_METADATA_KEY: json.dumps(arch)})
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2))
    return out


__all__ = ["export_timm"]
