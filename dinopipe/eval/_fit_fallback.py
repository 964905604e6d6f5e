"""TEMPORARY stand-in for ``dinopipe.eval.head_train.fit_dense_head`` (issue 50; built on another branch).

The seg and detect heads call :func:`fit_dense_head` with the shared signature; at merge the lead replaces the
import in ``seg_heads`` / ``detect`` with the real one (which trains through dinopipe.train's loop: progress,
resume, FSDP2 / bf16) and deletes this file. What this one assumes of the real one:

- ``cfg`` keys: ``epochs``, ``lr``, ``backbone_lr`` (0 = frozen: no grad, eval mode), ``device``, ``out``;
  optional ``weight_decay``, ``seed``, ``warmup`` (fraction of steps), ``features`` (``(backbone, x) -> feats``,
  default the stride-16 patch grid of :func:`dinopipe.eval.pyramid.patch_grid` on ``x`` padded to 32).
- The loader yields ``(x, target)``; ``pred = head(feats)``, or ``head(feats, target)`` for a head with
  ``takes_targets = True`` (torchvision detectors compute their losses inside); ``loss_fn(pred, target)``
  returns ``(loss, logs)``.
- ``val_fn(backbone, head) -> dict`` is called once after training; the result carries its keys.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterable

import torch
from torch import nn

from .pyramid import pad_to, patch_grid


def grid_features(backbone: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return patch_grid(backbone, pad_to(x))


def fit_dense_head(backbone: nn.Module, head: nn.Module, train_loader: Iterable, val_fn: Callable,
                   loss_fn: Callable, cfg: dict) -> dict:
    device = torch.device(cfg.get("device", "cpu"))
    torch.manual_seed(int(cfg.get("seed", 0)))
    features = cfg.get("features", grid_features)
    backbone.to(device)
    head.to(device)
    tune = float(cfg.get("backbone_lr", 0.0)) > 0
    backbone.requires_grad_(tune)
    bb_ids = {id(p) for p in backbone.parameters()}
    groups = [{"params": [p for p in head.parameters() if id(p) not in bb_ids and p.requires_grad],
               "lr": float(cfg["lr"])}]
    if tune:
        groups.append({"params": list(backbone.parameters()), "lr": float(cfg["backbone_lr"])})
    for g in groups:
        g["base_lr"] = g["lr"]
    opt = torch.optim.AdamW(groups, weight_decay=float(cfg.get("weight_decay", 1e-4)))
    epochs = int(cfg["epochs"])
    steps = max(1, epochs * len(train_loader))
    warm = int(float(cfg.get("warmup", 0.05)) * steps)
    step, logs, t0 = 0, {}, time.time()
    for _ in range(epochs):
        head.train()
        backbone.train(tune)
        for x, y in train_loader:
            x = x.to(device) if torch.is_tensor(x) else x
            scale = (step + 1) / warm if step < warm else 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))
            for g in opt.param_groups:
                g["lr"] = g["base_lr"] * scale
            with torch.set_grad_enabled(tune):
                feats = features(backbone, x)
            pred = head(feats, y) if getattr(head, "takes_targets", False) else head(feats)
            loss, logs = loss_fn(pred, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
    head.eval()
    backbone.eval()
    res = {"steps": step, "train_seconds": round(time.time() - t0, 2),
           "train_loss": round(float(loss.detach()), 6) if step else None,
           **{k: round(float(v), 6) for k, v in logs.items()}}
    with torch.no_grad():
        res.update(val_fn(backbone, head))
    return res


__all__ = ["fit_dense_head", "grid_features"]
