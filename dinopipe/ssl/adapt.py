"""Continued pretraining from a released backbone without wrecking it (dinov2 #204, #431; dinov3 #207, #289).

A release ships a backbone without its DINO/iBOT heads. Fresh heads give random targets: at the recipe's lr the
backbone then follows noise until the heads catch up, and what the release knew is lost (one user saw kNN fall
from 80 % to 10 %). Three remedies, all opt-in (the default is DINOv2's: fresh heads, one lr schedule):

- **head warm-up** (``train.head_warmup_steps``): for the first steps only the heads train, against the frozen
  released backbone (student backbone = teacher backbone, run without gradients, no EMA on it, so it stays
  bit for bit the release); then the backbone trains too, its lr ramped from 0 over
  ``optim.backbone_warmup_steps`` while the heads keep the schedule's lr. The ramps are two per-step arrays
  next to the lr (``backbone_frozen``, ``backbone_lr_scale``); param groups flagged ``is_backbone`` take the
  scale (``param_groups.apply_optim_schedules``).
- **a slower backbone** (``optim.backbone_lr_mult``): the backbone's lr a fraction of the heads' for the whole
  run (fine-tuning practice), on top of the layer-wise decay; it multiplies ``backbone_lr_scale``.
- **loaded heads** (``model.pretrained_heads``): the heads a previous dinopipe run saved, so a second adaptation
  does not start cold; shapes are checked against the configured heads before the run (exit 2 naming the key).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np
import torch
from torch import Tensor

from .base import build_head
from .config import HeadConfig
from .schedules import linear_warmup_cosine_decay

AUTO = "auto"


def head_warmup_schedules(cfg: Any, total: int) -> dict[str, np.ndarray]:
    """``backbone_frozen`` (1 while only the heads train) and ``backbone_lr_scale`` (0 while frozen, then a
    linear 0 -> 1 ramp over ``optim.backbone_warmup_steps``, then 1; all times ``optim.backbone_lr_mult``), or {}
    when none is configured (the schedules, and so metrics.jsonl, stay those of a plain run)."""
    frozen = int(getattr(getattr(cfg, "train", None), "head_warmup_steps", 0) or 0)
    ramp = int(getattr(getattr(cfg, "optim", None), "backbone_warmup_steps", 0) or 0)
    mult = float(getattr(getattr(cfg, "optim", None), "backbone_lr_mult", 1.0))
    if not frozen and not ramp and mult == 1.0:
        return {}
    scale = mult * linear_warmup_cosine_decay(0.0, 1.0, 1.0, ramp, total, freeze=min(frozen, total))
    flag = np.zeros(total, dtype=np.float64)
    flag[:frozen] = 1.0
    return {"backbone_frozen": flag, "backbone_lr_scale": scale}


def heads_source(model_cfg: Any) -> Optional[str]:
    """Where ``model.pretrained_heads`` points: None (fresh heads), or the path to read heads from."""
    src = model_cfg.pretrained_heads
    if not src:
        return None
    return str(model_cfg.pretrained) if str(src) == AUTO else str(src)


def expected_heads(cfg: Any) -> dict[str, HeadConfig]:
    """Head name -> the configured shape the student trains (iBOT's only with ``ibot.separate_head``)."""
    out = {"dino_head": cfg.dino.head}
    if cfg.ibot.separate_head:
        out["ibot_head"] = cfg.ibot.head
    return out


def check_heads(sds: Mapping[str, Mapping[str, Tensor]], cfg: Any, embed_dim: int, source: str) -> None:
    """Raise ConfigError, naming the key, unless ``sds`` (heads read from ``source``) are exactly the heads the
    config builds on a backbone of width ``embed_dim`` (same tensors, same shapes)."""
    from ..config import ConfigError

    want = expected_heads(cfg)
    extra = sorted(set(sds) - set(want))
    if extra:
        hint = " (set ibot.separate_head=true to train it)" if extra == ["ibot_head"] else ""
        raise ConfigError(f"model.pretrained_heads: {source} holds {extra} that this config does not train{hint}")
    for name, hcfg in want.items():
        if name not in sds:
            raise ConfigError(f"model.pretrained_heads: {source} has no {name} (it holds {sorted(sds)}); use "
                              "null for fresh heads" + (" or ibot.separate_head=false" if name == "ibot_head" else ""))
        with torch.device("meta"):
            ref = build_head(embed_dim, hcfg).state_dict()
        got = sds[name]
        for key in sorted(set(ref) | set(got)):
            if key not in got or key not in ref:
                where = "missing in the file" if key not in got else "not in the configured head"
                raise ConfigError(f"model.pretrained_heads: {name}.{key} is {where} ({source}); the saved head is "
                                  f"another kind than {name.split('_')[0]}.head (last_layer={hcfg.last_layer})")
            if tuple(got[key].shape) != tuple(ref[key].shape):
                section = "dino" if name == "dino_head" else "ibot"
                raise ConfigError(f"model.pretrained_heads: {name}.{key} has shape {tuple(got[key].shape)} in "
                                  f"{source}, but {section}.head on this {embed_dim}-wide backbone makes "
                                  f"{tuple(ref[key].shape)}; set {section}.head to the saved head's shape or use "
                                  "null for fresh heads")


def read_heads(cfg: Any, load_heads, embed_dim: int) -> dict[str, dict[str, Tensor]]:
    """The heads to start from ({} = fresh), checked against the config. ``auto`` without saved heads: fresh;
    an explicit path without heads: ConfigError."""
    from ..config import ConfigError

    src = heads_source(cfg.model)
    if src is None:
        return {}
    if load_heads is None:
        raise TypeError("model.pretrained_heads is set: pass load_heads (e.g. dinopipe.hub.load_heads)")
    if str(cfg.model.pretrained_heads) != AUTO and not Path(src).exists():
        raise ConfigError(f"model.pretrained_heads: {src} does not exist")
    sds = load_heads(src)
    if not sds:
        if str(cfg.model.pretrained_heads) == AUTO:
            return {}
        raise ConfigError(f"model.pretrained_heads: {src} holds no DINO heads (a dinopipe pretraining run, its "
                          "export/teacher folder or a checkpoints/step_N folder has them); use auto or null")
    check_heads(sds, cfg, embed_dim, src)
    return sds


__all__ = ["head_warmup_schedules", "heads_source", "check_heads", "read_heads", "expected_heads", "AUTO"]
