"""timm layout: a folder ``timm.create_model('local-dir:DIR', pretrained=True)`` loads (DINOv2 ``vit_*`` or
DINOv3 ``vit_*_dinov3`` architectures, with their ``model_args``; a ``timm:NAME`` student as NAME itself)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file
from torch import nn

from ..models.convert import timm_model_args, to_timm
from ..models.convert_dinov3 import timm_dinov3_model_args, to_timm_dinov3
from ..utils.norm import input_norm
from .backbone import (
    ARCH_METADATA_KEY,
    CONFIG_NAME,
    WEIGHTS_NAME,
    _contiguous_cpu,
    _ffn_hidden,
    _is_dinov3,
    export_arch,
)


def _write_folder(out: Path, weights: dict, arch: dict, architecture: str, num_features: int, model_args: dict,
                  mean: list, std: list, first_conv: str, classifier: str) -> Path:
    """model.safetensors (timm's keys; the metadata holds the whole architecture, which timm ignores and
    dinopipe.load reads for an exact round trip) + config.json with timm's pretrained_cfg."""
    size = int(arch["img_size"])
    cfg = {
        "architecture": architecture,
        "num_classes": 0,
        "num_features": int(num_features),
        "model_args": model_args,
        "pretrained_cfg": {
            "tag": "dinopipe",
            "input_size": [int(arch.get("in_chans", 3)), size, size],
            "fixed_input_size": False,
            "interpolation": "bicubic",
            "crop_pct": 1.0,
            "crop_mode": "center",
            "mean": list(mean),
            "std": list(std),
            "num_classes": 0,
            "pool_size": None,
            "first_conv": first_conv,
            "classifier": classifier,
            "license": "apache-2.0",
        },
    }
    save_file(_contiguous_cpu(weights), str(out / WEIGHTS_NAME), metadata={ARCH_METADATA_KEY: json.dumps(arch)})
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2))
    return out


def export_timm(model: nn.Module, out_dir: str | Path) -> Path:
    """A folder that ``timm.create_model('local-dir:DIR', pretrained=True)`` loads, as timm's hub folders.
    A timm student (``timm:NAME``) is written with timm's own keys and architecture name, so
    ``timm.create_model(NAME, pretrained=True, num_classes=0, pretrained_cfg_overlay=dict(file=...))`` or
    ``local-dir:`` rebuild it (the pooled feature is its output)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arch = export_arch(model)
    if arch.get("family") == "timm":
        src_cfg = dict(getattr(model.model, "pretrained_cfg", None) or {})
        model_args = {**arch.get("model_args", {}), "in_chans": int(arch.get("in_chans", 3))}
        mean, std = input_norm(model)  # the statistics its training data recorded, one per input channel
        return _write_folder(out, model.timm_state_dict(), arch, arch["model"], model.embed_dim, model_args,
                             mean, std, src_cfg.get("first_conv", ""), src_cfg.get("classifier", ""))
    if _is_dinov3(arch):
        name, model_args = timm_dinov3_model_args(arch, _ffn_hidden(model))
        weights = to_timm_dinov3(model.state_dict(), arch)
    else:
        name, model_args = timm_model_args(arch)
        weights = to_timm(model.state_dict())
    mean, std = input_norm(model)  # one value per input channel (utils/norm.py)
    return _write_folder(out, weights, arch, name, arch["embed_dim"], model_args, mean, std, "patch_embed.proj", "head")


__all__ = ["export_timm"]
