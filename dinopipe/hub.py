"""Loading backbones from anywhere and exporting them for other libraries.

``load()`` accepts: a dinopipe export folder or run directory, a ``.safetensors`` file, an official DINOv2
``.pth`` (hub or training checkpoint), a timm DINOv2 state dict or timm ``local-dir`` folder, or a registry
name (random init). Files are read with ``torch.load(weights_only=True)`` or safetensors: a checkpoint that
needs arbitrary pickled objects is refused, because unpickling can run code.
"""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from safetensors.torch import load_file, safe_open, save_file
from torch import Tensor, nn

from .export_hf import export_hf
from .models.convert import infer_arch, timm_model_args, to_canonical, to_dinov2, to_timm
from .models.registry import TRAINING_ONLY_KEYS, build_vit, list_models
from .models.vit import DinoVisionTransformer

log = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
ARCH_METADATA_KEY = "dinopipe_arch"
EXPORT_FORMAT = "dinopipe-backbone/1"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message says why and what to do."""


# -- reading ------------------------------------------------------------------------------------------


def read_checkpoint(path: str | Path) -> tuple[Any, Optional[dict]]:
    """(raw object, arch dict if the file carries one) from a .safetensors or torch file."""
    path = Path(path)
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        arch = json.loads(meta[ARCH_METADATA_KEY]) if ARCH_METADATA_KEY in meta else None
        return load_file(str(path)), arch
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path}: refusing to load a checkpoint that needs arbitrary pickled objects (unpickling can run "
            f"code). If you trust the file, re-save only its tensors: torch.save(ckpt['model'], 'weights.pth'). "
            f"Detail: {str(exc).splitlines()[0]}"
        ) from None
    arch = obj.get("arch") if isinstance(obj, Mapping) and isinstance(obj.get("arch"), Mapping) else None
    return obj, dict(arch) if arch else None


def _resolve_path(path: Path) -> tuple[Path, Optional[dict]]:
    """A folder -> its weights file (+ arch from config.json). Run dirs point at export/teacher."""
    if path.is_file():
        return path, None
    if not path.is_dir():
        raise CheckpointError(f"'{path}' is neither a file, a folder nor a registry name ({', '.join(list_models())})")
    for sub in ("", "export/teacher", "export"):
        d = path / sub if sub else path
        if (d / WEIGHTS_NAME).is_file():
            cfg_file = d / CONFIG_NAME
            cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
            arch = cfg.get("arch") if cfg.get("format") == EXPORT_FORMAT else None
            return d / WEIGHTS_NAME, arch
    raise CheckpointError(f"'{path}': no {WEIGHTS_NAME} in the folder, export/teacher/ or export/")


def load(
    path_or_name: str | Path,
    arch: Optional[Mapping[str, Any]] = None,
    device: str | torch.device = "cpu",
    num_heads: Optional[int] = None,
    strict: bool = True,
    **overrides: Any,
) -> DinoVisionTransformer:
    """A ready backbone in eval mode.

    ``arch`` (constructor kwargs) overrides what the file says or what shapes imply; ``num_heads`` is needed
    only for foreign files whose heads are not 64-dimensional. ``overrides`` (e.g. ``attn_backend='sdpa'``,
    ``drop_path_rate``) change run-time behaviour, not weights.
    """
    name = str(path_or_name)
    if name in list_models() and not Path(name).exists():
        from .models.registry import create_model

        log.warning("dinopipe.load('%s'): a registry name, so the weights are randomly initialised", name)
        return create_model(name, **overrides).to(device).eval()
    file, folder_arch = _resolve_path(Path(path_or_name))
    obj, file_arch = read_checkpoint(file)
    try:
        sd = to_canonical(obj)
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"{file}: {exc}") from None
    kwargs = dict(file_arch or folder_arch or infer_arch(sd, num_heads=num_heads))
    kwargs.update(arch or {})
    if num_heads:
        kwargs["num_heads"] = num_heads
    kwargs.update(overrides)
    model = build_vit(**kwargs)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k != "mask_token"]  # timm files carry none; it only matters for iBOT
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{file}: weights do not fit the architecture {kwargs}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return model.to(device).eval()


# -- writing ------------------------------------------------------------------------------------------


def export_arch(model: DinoVisionTransformer) -> dict[str, Any]:
    arch = model.arch_config() or infer_arch(model.state_dict(), num_heads=model.num_heads)
    return {k: v for k, v in arch.items() if k not in TRAINING_ONLY_KEYS}


def _contiguous_cpu(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}


def save_backbone(model: nn.Module, out_dir: str | Path, extra: Optional[dict] = None) -> Path:
    """dinopipe export folder: model.safetensors (arch in its metadata) + config.json. No torch.distributed."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arch = export_arch(model)
    tmp = out / (WEIGHTS_NAME + ".tmp")
    save_file(_contiguous_cpu(model.state_dict()), str(tmp), metadata={ARCH_METADATA_KEY: json.dumps(arch)})
    tmp.replace(out / WEIGHTS_NAME)
    cfg = {"format": EXPORT_FORMAT, "arch": arch, "mean": IMAGENET_MEAN, "std": IMAGENET_STD, **(extra or {})}
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2))
    return out


def export_timm(model: DinoVisionTransformer, out_dir: str | Path) -> Path:
    """A folder that ``timm.create_model('local-dir:DIR', pretrained=True)`` loads, as timm's hub folders."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arch = export_arch(model)
    name, model_args = timm_model_args(arch)
    size = int(arch["img_size"])
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
            "mean": list(IMAGENET_MEAN),
            "std": list(IMAGENET_STD),
            "num_classes": 0,
            "pool_size": None,
            "first_conv": "patch_embed.proj",
            "classifier": "head",
            "license": "apache-2.0",
        },
    }
    save_file(_contiguous_cpu(to_timm(model.state_dict())), str(out / WEIGHTS_NAME))
    (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2))
    return out


def export_dinov2(model: DinoVisionTransformer, out_path: str | Path) -> Path:
    """A ``.pth`` in the official DINOv2 hub layout (plain tensors, loadable with weights_only=True)."""
    out = Path(out_path)
    if out.suffix != ".pth":
        out.mkdir(parents=True, exist_ok=True)
        out = out / "backbone.pth"
    arch = export_arch(model)
    torch.save(to_dinov2(_contiguous_cpu(model.state_dict()), arch.get("ffn", "mlp")), out)
    return out


EXPORTERS = {
    "dinopipe": save_backbone,
    "safetensors": save_backbone,
    "timm": export_timm,
    "dinov2": export_dinov2,
    "hf": export_hf,  # transformers Dinov2Model / Dinov2WithRegistersModel folder
}


def export(model: DinoVisionTransformer, fmt: str, out: str | Path) -> Path:
    if fmt not in EXPORTERS:
        raise ValueError(f"unknown export format '{fmt}'; choose from {sorted(EXPORTERS)}")
    return EXPORTERS[fmt](model, out)


__all__ = [
    "load", "read_checkpoint", "save_backbone", "export", "export_timm", "export_dinov2", "export_hf", "CheckpointError",
]
