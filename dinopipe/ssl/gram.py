"""Gram anchoring (Siméoni et al. 2025, "DINOv3", §4).

Long SSL runs keep improving global (CLS) quality while their dense patch features degrade: patch tokens
drift towards the CLS token and lose locality. DINOv3 regularises the *structure* of the patch features, not
the features themselves: the student's per-image Gram matrix of L2-normalised patch tokens (cosine
similarity of every patch pair) is pulled towards the Gram matrix of an earlier, frozen copy of the EMA
teacher (the "Gram teacher"), which is refreshed from the EMA teacher every so often. The Gram teacher may
see the same crops at a higher resolution, its patch grid resampled to the student's (smoother, better
localised targets: DINOv3 §4.3).

Here: the loss (:func:`gram_loss`), the resampling of a teacher's patch grid (:func:`resample_patch_grid`),
when the Gram teacher is copied (:func:`refresh_steps`) and the per-step arrays the training loop hands the
task (:func:`gram_schedules`: ``gram_weight``, ``gram_refresh``), and :class:`GramTeacher`, the frozen copy.
Everything is a pure function of the config and the step, so a resumed run refreshes at exactly the same
steps; the copy's weights themselves are checkpointed (they are an earlier teacher: not rebuildable).
"""

from __future__ import annotations

import copy
import math
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .ema import local_tensor
from .schedules import linear_warmup_cosine_decay, weight_schedule

from .config import GramConfig


def gram_loss(student: Tensor, teacher: Tensor, normalize: bool = True, remove_neg: bool = False,
              image_level: bool = True) -> Tensor:
    """Mean squared difference of Gram matrices: student, teacher (B, N, D) -> scalar, one Gram matrix per image;
    with ``image_level`` false (DINOv3's ``img_level: false``) one Gram matrix over all tokens of the batch, which
    may then also be given as (T, D) (the selected tokens of ``gram.tokens_used``).

    In float32 whatever the compute dtype (the matrices are (B, N, N) sums of D products)."""
    if student.shape != teacher.shape or student.dim() != (3 if image_level else student.dim()) \
            or student.dim() not in (2, 3):
        raise ValueError(f"gram_loss needs two {'(B, N, D)' if image_level else '(B, N, D) or (T, D)'} tensors of "
                         f"one shape, got {tuple(student.shape)} and {tuple(teacher.shape)}")
    s, t = student.float(), teacher.float()
    if normalize:
        s, t = F.normalize(s, dim=-1), F.normalize(t, dim=-1)
    if not image_level:
        s, t = s.reshape(-1, s.shape[-1]), t.reshape(-1, t.shape[-1])  # (T, D): one matrix over the batch
    gs, gt = s @ s.transpose(-1, -2), t @ t.transpose(-1, -2)  # (B, N, N) or (T, T)
    if remove_neg:
        gs, gt = gs.clamp_min(0.0), gt.clamp_min(0.0)
    return F.mse_loss(gs, gt)


def resample_patch_grid(patches: Tensor, grid: tuple[int, int], size: tuple[int, int], mode: str = "bicubic",
                        antialias: bool = False) -> Tensor:
    """(B, h*w, D) patch tokens on an h x w grid -> (B, H*W, D) on ``size`` = (H, W), by image interpolation."""
    h, w = grid
    if patches.shape[1] != h * w:
        raise ValueError(f"{patches.shape[1]} patch tokens do not form a {h}x{w} grid")
    if (h, w) == tuple(size):
        return patches
    x = patches.transpose(1, 2).unflatten(-1, (h, w))  # (B, D, h, w)
    kw = {} if mode in ("nearest", "area") else {"align_corners": False, "antialias": antialias}
    x = F.interpolate(x.float(), size=tuple(size), mode=mode, **kw).to(patches.dtype)
    return x.flatten(2).transpose(1, 2)  # (B, H*W, D)


def refresh_steps(cfg: GramConfig, total_steps: int) -> list[int]:
    """Steps before whose forward the Gram teacher is copied from the EMA teacher: ``first_step``, then every
    ``refresh_every`` steps, at most ``max_refreshes`` more times, all before ``total_steps``."""
    if not cfg.enabled or cfg.first_step >= total_steps:
        return []
    out = [cfg.first_step]
    if cfg.refresh_every > 0:
        n = math.ceil((total_steps - cfg.first_step) / cfg.refresh_every) - 1  # refreshes that fit
        if cfg.max_refreshes is not None:
            n = min(n, cfg.max_refreshes)
        out += [cfg.first_step + k * cfg.refresh_every for k in range(1, n + 1)]
    return out


def gram_schedules(cfg: GramConfig, total_steps: int) -> dict[str, np.ndarray]:
    """Per-step arrays: ``gram_weight`` (0 before the first copy, then a cosine ramp to ``loss_weight``) and
    ``gram_refresh`` (1.0 at the steps whose forward starts with a copy of the EMA teacher)."""
    weight = np.zeros(total_steps, dtype=np.float64)
    refresh = np.zeros(total_steps, dtype=np.float64)
    steps = refresh_steps(cfg, total_steps)
    if steps:
        start = cfg.loss_weight if cfg.loss_weight_start is None else cfg.loss_weight_start
        n = total_steps - cfg.first_step
        # DINOv3's loss_weight_schedule: half a cosine start -> loss_weight over warmup_steps, then constant.
        weight[cfg.first_step:] = linear_warmup_cosine_decay(start, start, cfg.loss_weight, 0, n,
                                                             cosine=min(cfg.warmup_steps, n), shape="dinov3")
        refresh[steps] = 1.0
    return {"gram_weight": weight, "gram_refresh": refresh}


def loss_weight_schedules(cfg, total_steps: int) -> dict[str, np.ndarray]:
    """The loss-weight arrays a stage config asks for: ``dino_local_weight`` (DINOv3's local-crop reweighting)
    and the Gram ones (``gram_weight``, ``gram_refresh``)."""
    out = {}
    dino = getattr(cfg, "dino", None)
    if dino is not None and getattr(dino, "local_loss_weight_schedule", None) is not None:
        out["dino_local_weight"] = weight_schedule(dino.local_loss_weight_schedule, total_steps, cfg.train.epoch_length)
    if getattr(cfg, "gram", None) is not None and cfg.gram.enabled:
        out.update(gram_schedules(cfg.gram, total_steps))
    return out


class GramTeacher(nn.Module):
    """The frozen Gram teacher: a backbone copied from the EMA teacher's at the refresh steps.

    Sharded like the EMA teacher (same parallelize call), so a refresh copies local shards one to one with no
    communication; checkpointed with the run so a resume continues against the same anchor."""

    def __init__(self, teacher_backbone: nn.Module, cfg: GramConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.backbone = copy.deepcopy(teacher_backbone)
        for blk in getattr(self.backbone, "blocks", []):
            blk.drop_path_rate = 0.0
        self.backbone.requires_grad_(False).eval()

    def train(self, mode: bool = True) -> "GramTeacher":
        return super().train(False)  # always inference (no RoPE augmentation, no stochastic depth)

    @torch.no_grad()
    def refresh_(self, teacher_backbone: nn.Module) -> None:
        """Copy the EMA teacher's parameters and buffers (local shards under FSDP2; both sharded alike)."""
        mine = list(self.backbone.named_parameters()) + list(self.backbone.named_buffers())
        theirs = dict(teacher_backbone.named_parameters()) | dict(teacher_backbone.named_buffers())
        for name, p in mine:
            if name not in theirs:
                raise RuntimeError(f"Gram teacher parameter '{name}' has no counterpart in the EMA teacher")
            dst, src = local_tensor(p), local_tensor(theirs[name])
            if dst.shape != src.shape:
                raise RuntimeError(f"Gram teacher '{name}': shard {tuple(dst.shape)} vs teacher {tuple(src.shape)} "
                                   "(the two must be sharded identically)")
            dst.copy_(src)

    @torch.no_grad()
    def targets(self, crops: Tensor, student_grid: tuple[int, int]) -> Tensor:
        """Patch tokens (2B, h*w, D) of the Gram teacher on ``crops``, resampled to the student's grid."""
        out = self.backbone.forward_features_list([crops])[0]["x_norm_patchtokens"]
        p = self.backbone.patch_size
        grid = (crops.shape[-2] // p, crops.shape[-1] // p)
        return resample_patch_grid(out, grid, student_grid, str(self.cfg.resize_mode), self.cfg.resize_antialias)

    def loss(self, student_patches: Tensor, crops: Tensor, student_grid: tuple[int, int],
             targets: Optional[Tensor] = None, masks: Optional[Tensor] = None) -> Tensor:
        """``masks`` (B, N) bool, the student's iBOT masks: with ``tokens_used`` masked / unmasked only those
        patches of student and targets enter the (batch-level) Gram matrix, as DINOv3's ``tokens_used``."""
        t = self.targets(crops, student_grid) if targets is None else targets
        s, used = student_patches, str(self.cfg.tokens_used)
        if used != "all":
            if masks is None:
                raise ValueError(f"gram.tokens_used={used} needs the student's masks")
            keep = masks if used == "masked" else ~masks
            s, t = s[keep], t[keep]  # (T, D)
        return gram_loss(s, t, remove_neg=self.cfg.remove_neg, image_level=self.cfg.image_level)


__all__ = ["GramTeacher", "gram_loss", "gram_schedules", "loss_weight_schedules", "refresh_steps", "resample_patch_grid"]
