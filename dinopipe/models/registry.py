"""Named backbone variants. ``create_model(name, **overrides)`` builds one; every CPU test uses ``vit_test``.

DINOv2 sizes: S/B/L/g = 384/768/1024/1536 wide, 12/12/24/40 deep, 64-dim heads; g uses SwiGLU with
DINOv2's hidden-size rule. Each exists with patch 14 and 16 and with 4 registers (``_reg4``).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from timm.layers import Mlp

from .block import SwiGLU
from .vit import DinoVisionTransformer

FFN_LAYERS: dict[str, Callable] = {"mlp": Mlp, "swiglu": SwiGLU}

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


def list_models() -> list[str]:
    return sorted(_REGISTRY)


def model_defaults(name: str) -> dict[str, Any]:
    if name not in _REGISTRY:
        raise KeyError(f"unknown model '{name}'; known: {', '.join(list_models())}")
    return dict(_REGISTRY[name])


def build_vit(**kwargs: Any) -> DinoVisionTransformer:
    """Build from plain arguments (``ffn`` as a string), remembering them so exports can rebuild it."""
    kwargs = dict(kwargs)
    ffn = kwargs.pop("ffn", "mlp")
    if ffn not in FFN_LAYERS:
        raise ValueError(f"ffn must be one of {sorted(FFN_LAYERS)}, got '{ffn}'")
    model = DinoVisionTransformer(mlp_layer=FFN_LAYERS[ffn], **kwargs)
    # Record every plain argument, defaults included, so an export fully describes the architecture.
    params = inspect.signature(DinoVisionTransformer.__init__).parameters
    full = {k: p.default for k, p in params.items() if k != "self" and not isinstance(p.default, type)}
    full.update(kwargs)
    full["interpolate_antialias"] = model.interpolate_antialias
    full["interpolate_offset"] = model.interpolate_offset
    model._arch_kwargs = dict(full, ffn=ffn)
    return model


# Keys that only shape training, not the weights; exports drop them.
TRAINING_ONLY_KEYS = ("drop_path_rate", "drop_path_uniform", "efficient_drop_path", "attn_backend")


def create_model(name: str, **overrides: Any) -> DinoVisionTransformer:
    """Build a registry variant; any constructor argument can be overridden (e.g. ``embed_dim=64``)."""
    kwargs = model_defaults(name)
    kwargs.update({k: v for k, v in overrides.items() if v is not None or k == "init_values"})
    model = build_vit(**kwargs)
    model.variant = name
    return model


__all__ = ["create_model", "build_vit", "list_models", "model_defaults", "FFN_LAYERS", "TRAINING_ONLY_KEYS"]
