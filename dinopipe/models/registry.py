"""Named backbone variants. ``create_model(name, **overrides)`` builds one; every CPU test uses ``vit_test``.

DINOv2 sizes: S/B/L/g = 384/768/1024/1536 wide, 12/12/24/40 deep, 64-dim heads; g uses SwiGLU with
DINOv2's hidden-size rule. Each exists with patch 14 and 16 and with 4 registers (``_reg4``).

DINOv3 (``family="dinov3"``, vit_dinov3.py): the released backbones, patch 16, RoPE, 4 storage tokens, with
the official builders' widths (``ffn_ratio`` 4, or 6 for the SwiGLU "plus" models, 3 with 64-alignment for
the 7B) and ``vit_test_dinov3`` / ``vit_test_dinov3_swiglu`` for CPU tests.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import functools

import torch

from timm.layers import Mlp

from .block import SwiGLU
from .timm_backbone import create_timm_backbone, is_timm_name
from .vit import DinoVisionTransformer
from .vit_dinov3 import DinoV3VisionTransformer, SwiGLUAligned

# "swiglu" rounds to 8 (DINOv2's rule and DINOv3's default); DINOv3 also names 32/64/128-aligned widths.
FFN_LAYERS: dict[str, Callable] = {
    "mlp": Mlp, "swiglu": SwiGLU,
    **{f"swiglu{a}": functools.partial(SwiGLUAligned, align_to=a) for a in (32, 64, 128)},
}
FAMILIES = {"dinov2": DinoVisionTransformer, "dinov3": DinoV3VisionTransformer}

_SIZES = {
    "s": dict(embed_dim=384, depth=12, num_heads=6, ffn="mlp"),
    "b": dict(embed_dim=768, depth=12, num_heads=12, ffn="mlp"),
    "l": dict(embed_dim=1024, depth=24, num_heads=16, ffn="mlp"),
    "g": dict(embed_dim=1536, depth=40, num_heads=24, ffn="swiglu"),
}

_REGISTRY: dict[str, dict[str, Any]] = {
    # Tiny model for CPU tests: 2 heads of 32 dims, 4 blocks, 64 wide.
    "vit_test": dict(embed_dim=64, depth=4, num_heads=2, ffn="mlp", patch_size=14, num_register_tokens=0),
}
for _size, _dims in _SIZES.items():
    for _patch in (14, 16):
        _REGISTRY[f"vit_{_size}{_patch}"] = dict(_dims, patch_size=_patch, num_register_tokens=0)
        _REGISTRY[f"vit_{_size}{_patch}_reg4"] = dict(_dims, patch_size=_patch, num_register_tokens=4)
_REGISTRY["vit_test_reg4"] = dict(_REGISTRY["vit_test"], num_register_tokens=4)

# DINOv3 releases (facebookresearch/dinov3 hub builders): name -> (dim, depth, heads, ffn_ratio, ffn).
_DINOV3 = {
    "s16": (384, 12, 6, 4.0, "mlp"),
    "s16plus": (384, 12, 6, 6.0, "swiglu"),
    "b16": (768, 12, 12, 4.0, "mlp"),
    "l16": (1024, 24, 16, 4.0, "mlp"),
    "l16plus": (1024, 24, 16, 6.0, "swiglu"),
    "h16plus": (1280, 32, 20, 6.0, "swiglu"),
    "7b16": (4096, 40, 32, 3.0, "swiglu64"),
}
for _name, (_dim, _depth, _heads, _ratio, _ffn) in _DINOV3.items():
    _REGISTRY[f"vit_{_name}_dinov3"] = dict(family="dinov3", embed_dim=_dim, depth=_depth, num_heads=_heads,
                                            mlp_ratio=_ratio, ffn=_ffn, patch_size=16, num_register_tokens=4)
# The 7B has no qkv bias and a separate norm for local crops' class tokens (used in training only).
_REGISTRY["vit_7b16_dinov3"].update(qkv_bias=False, untie_global_and_local_cls_norm=True)
_REGISTRY["vit_test_dinov3"] = dict(family="dinov3", embed_dim=64, depth=4, num_heads=2, mlp_ratio=4.0, ffn="mlp",
                                    patch_size=16, num_register_tokens=4)
_REGISTRY["vit_test_dinov3_swiglu"] = dict(_REGISTRY["vit_test_dinov3"], mlp_ratio=6.0, ffn="swiglu")


def list_models() -> list[str]:
    return sorted(_REGISTRY)


def model_defaults(name: str) -> dict[str, Any]:
    if name not in _REGISTRY:
        raise KeyError(f"unknown model '{name}'; known: {', '.join(list_models())}")
    return dict(_REGISTRY[name])


def build_vit(**kwargs: Any) -> DinoVisionTransformer | DinoV3VisionTransformer:
    """Build from plain arguments (``ffn`` as a string, ``family`` dinov2 | dinov3 | timm), remembering them so
    exports can rebuild it. Arguments without a ``family`` are DINOv2 (what older exports hold); ``timm`` is a
    timm student's ``arch_config()``."""
    kwargs = dict(kwargs)
    if kwargs.get("family") == "timm":  # a timm student (models/timm_backbone.py): its own arch record
        from .timm_backbone import TimmBackbone

        for key in ("family", "embed_dim", "patch_size", "num_register_tokens"):  # implied by the timm model
            kwargs.pop(key, None)
        return TimmBackbone(**kwargs)
    ffn = kwargs.pop("ffn", "mlp")
    family = kwargs.pop("family", "dinov2")
    if ffn not in FFN_LAYERS:
        raise ValueError(f"ffn must be one of {sorted(FFN_LAYERS)}, got '{ffn}'")
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got '{family}'")
    cls = FAMILIES[family]
    model = cls(mlp_layer=FFN_LAYERS[ffn], **kwargs)
    # Record every plain argument, defaults included, so an export fully describes the architecture.
    params = inspect.signature(cls.__init__).parameters
    full = {k: p.default for k, p in params.items()
            if k not in ("self", "attn_layer") and not isinstance(p.default, type)}
    full.update(kwargs)
    if family == "dinov2":
        full["interpolate_antialias"] = model.interpolate_antialias
        full["interpolate_offset"] = model.interpolate_offset
        model._arch_kwargs = dict(full, ffn=ffn)
    else:
        model._arch_kwargs = dict(full, ffn=ffn, family=family)
    return model


def random_init_like(model, seed: int = 0) -> DinoVisionTransformer | DinoV3VisionTransformer:
    """A randomly initialised net of ``model``'s architecture (``arch_config()``), in eval mode, the global RNG
    seeded first so the baseline is the same on every rerun: what a trained backbone is compared with."""
    torch.manual_seed(seed)
    return build_vit(**model.arch_config()).eval()


# Keys that only shape training, not the weights; exports drop them.
TRAINING_ONLY_KEYS = ("drop_path_rate", "drop_path_uniform", "efficient_drop_path", "attn_backend")


def create_model(name: str, **overrides: Any) -> DinoVisionTransformer | DinoV3VisionTransformer:
    """Build a registry variant; any constructor argument can be overridden (e.g. ``embed_dim=64``).
    ``timm:NAME`` builds a randomly initialised timm model as a backbone (``models/timm_backbone.py``)."""
    if is_timm_name(name):
        return create_timm_backbone(name, **overrides)
    kwargs = model_defaults(name)
    kwargs.update({k: v for k, v in overrides.items() if v is not None or k == "init_values"})
    model = build_vit(**kwargs)
    model.variant = name
    return model


__all__ = ["create_model", "build_vit", "random_init_like",
           "list_models", "model_defaults", "FFN_LAYERS", "FAMILIES", "TRAINING_ONLY_KEYS"]
