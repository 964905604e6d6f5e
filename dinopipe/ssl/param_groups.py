"""AdamW parameter groups for ViT pretraining: layer-wise lr decay, no weight decay where it hurts, and a
flag on the head's last layer so it can be frozen (BEiT, Bao et al. 2022, for layer decay; DINOv2's
``param_groups.py`` for the rest).

Each group carries ``lr_multiplier``, ``wd_multiplier`` and ``is_last_layer``; the loop applies the step's
schedules with :func:`apply_optim_schedules`. As both official codes (dinov2 ``utils/param_groups.py:80``,
dinov3 ``train/param_groups.py:99``), only biases, norms and LayerScale ``gamma`` are exempt from weight
decay: tokens (``cls_token``, ``pos_embed``, ``register_tokens``, ``storage_tokens``, ``mask_token``) and the
prototype gain (``last_layer_gain``, DINOv2's ``weight_g``) are decayed. ``decay_tokens=False`` (config
``optim.decay_tokens``) exempts them too. Norms are recognised by module type as well as by name; wrapper
prefixes of torch.compile, activation checkpointing and FSDP1 are stripped before matching.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from torch import nn

from ..utils.torch_compat import norm_base

_WRAPPER_TOKENS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "module.")
_TOKEN_NAMES = ("cls_token", "pos_embed", "register_tokens", "storage_tokens", "mask_token")
_NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, norm_base())
_BLOCK_RE = re.compile(r"(?:^|\.)blocks\.(\d+)\.")


def clean_name(name: str) -> str:
    for token in _WRAPPER_TOKENS:
        name = name.replace(token, "")
    return name


def vit_layer_id(name: str, num_layers: int) -> int:
    """Depth of a backbone parameter (name relative to the backbone): 0 for the patch embedding and the
    tokens, i + 1 for ``blocks.i``, ``num_layers + 1`` for everything after the blocks (final norm)."""
    name = clean_name(name)
    first = name.split(".")[0]
    if first in _TOKEN_NAMES or first == "patch_embed":
        return 0
    m = _BLOCK_RE.search(name)
    if m:
        return int(m.group(1)) + 1
    return num_layers + 1


def vit_lr_decay_rate(name: str, lr_decay_rate: float, num_layers: int) -> float:
    """DINOv2's ``get_vit_lr_decay_rate``: ``lr_decay_rate ** (num_layers + 1 - layer_id)``."""
    return lr_decay_rate ** (num_layers + 1 - vit_layer_id(name, num_layers))


@dataclass
class ParamSpec:
    name: str
    param: nn.Parameter
    lr_multiplier: float
    wd_multiplier: float
    is_last_layer: bool
    is_backbone: bool = False
    """Inside a backbone: its lr takes the continued-pretraining ramp (``backbone_lr_scale``, ssl/adapt.py)."""


def _is_backbone(module: nn.Module) -> bool:
    return isinstance(getattr(module, "blocks", None), nn.ModuleList) and hasattr(module, "patch_embed")


def param_specs(model: nn.Module, lr_decay_rate: float = 0.9, patch_embed_lr_mult: float = 0.2,
                decay_tokens: bool = True) -> list[ParamSpec]:
    """One :class:`ParamSpec` per trainable parameter of ``model`` (a backbone, a head, or a container of
    both such as the student ``ModuleDict``). Backbones are found by structure (``blocks`` + ``patch_embed``);
    parameters outside any backbone (heads) get lr multiplier 1."""
    backbones = {prefix: m for prefix, m in model.named_modules() if _is_backbone(m)}
    owner_type: dict[str, type] = {}
    for mod_name, module in model.named_modules():
        for p_name, _ in module.named_parameters(recurse=False):
            owner_type[f"{mod_name}.{p_name}" if mod_name else p_name] = type(module)

    specs = []
    for full_name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        name = clean_name(full_name)
        lr_mult = 1.0
        # The innermost backbone that owns this parameter decides its depth.
        prefix = max((p for p in backbones if p == "" or full_name.startswith(p + ".")), key=len, default=None)
        if prefix is not None:
            rel = full_name[len(prefix) + 1:] if prefix else full_name
            lr_mult = vit_lr_decay_rate(rel, lr_decay_rate, len(backbones[prefix].blocks))
            if clean_name(rel).startswith("patch_embed."):
                lr_mult *= patch_embed_lr_mult
        parts = name.split(".")
        leaf, owner = parts[-1], (parts[-2] if len(parts) > 1 else "")
        no_decay = (
            leaf == "bias"
            or leaf == "gamma"  # LayerScale (timm's and DINOv2's name)
            or (not decay_tokens and (leaf in _TOKEN_NAMES or leaf == "last_layer_gain"))
            or issubclass(owner_type.get(full_name, nn.Module), _NORM_TYPES)
            or "norm" in owner
        )
        specs.append(ParamSpec(name, param, lr_mult, 0.0 if no_decay else 1.0, "last_layer" in name,
                               prefix is not None))
    return specs


def build_param_groups(
    model: nn.Module, lr_decay_rate: float = 0.9, patch_embed_lr_mult: float = 0.2, decay_tokens: bool = True
) -> list[dict]:
    """AdamW groups, parameters fused by identical (lr_multiplier, wd_multiplier, is_last_layer).

    Pass the *student* (backbone and heads) only; the EMA teacher is not optimised. Groups carry plain
    float/bool fields, so optimizer state dicts stay checkpointable.
    """
    fused: "OrderedDict[tuple, dict]" = OrderedDict()
    for s in param_specs(model, lr_decay_rate, patch_embed_lr_mult, decay_tokens):
        key = (s.lr_multiplier, s.wd_multiplier, s.is_last_layer, s.is_backbone)
        group = fused.setdefault(key, {"params": [], "lr_multiplier": s.lr_multiplier,
                                       "wd_multiplier": s.wd_multiplier, "is_last_layer": s.is_last_layer,
                                       "is_backbone": s.is_backbone})
        group["params"].append(s.param)
    return list(fused.values())


def apply_optim_schedules(optimizer, lr: float, weight_decay: float, last_layer_lr: Optional[float] = None,
                          backbone_lr_scale: float = 1.0) -> None:
    """Set each group's lr and weight decay for this step: ``(last_layer_lr if is_last_layer else lr) *
    lr_multiplier`` (times ``backbone_lr_scale`` for backbone groups: the continued-pretraining ramp) and
    ``weight_decay * wd_multiplier`` (groups without the fields get multiplier 1)."""
    last_layer_lr = lr if last_layer_lr is None else last_layer_lr
    for group in optimizer.param_groups:
        base = last_layer_lr if group.get("is_last_layer", False) else lr
        if group.get("is_backbone", False):
            base = base * backbone_lr_scale
        group["lr"] = base * group.get("lr_multiplier", 1.0)
        group["weight_decay"] = weight_decay * group.get("wd_multiplier", 1.0)


__all__ = [
    "ParamSpec", "apply_optim_schedules", "build_param_groups", "clean_name", "param_specs", "vit_layer_id",
    "vit_lr_decay_rate",
]
