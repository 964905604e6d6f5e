"""Distillation of a frozen teacher into one or more smaller students (DINOv2 §5, whose code was never
released; DINOv3 distils several students sharing one teacher forward).

Two modes:
- ``ssl`` — DINOv2's recipe, for a dinopipe pretraining run whose heads were exported: the students learn
  the DINO (CLS prototypes) and iBOT losses against the frozen teacher's own heads, with new student heads,
  iBOT on every patch token of both global crops, no masking and no stochastic depth by default; each
  student's EMA is the model kept.
- ``feature`` — for a bare backbone (released weights have no heads): cosine (or smooth-L1) distance of the
  student's CLS and patch tokens, through learned projections, to the teacher's; the student's patch grid
  is resampled to the teacher's when patch size or resolution differ. The only mode for students of other
  architectures (``timm:NAME``, e.g. a ConvNeXt or a ResNet): their pooled feature stands for the CLS token
  and their last feature map, resized to the teacher's patch grid, for the patch tokens.

One teacher forward per step feeds every student; each student has its own optimizer, EMA, checkpoint
state and export. The teacher is never written into checkpoints.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models import create_model, is_timm_name
from ..models.channels import expand_patch_embed
from ..utils.norm import in_channels, set_input_norm
from .base import (ExportSpec, LoadBackbone, LoadHeads, TeacherStudentTask, build_head, head_config,
                   koleo_per_global_crop, n_prototypes)
from .distill_config import DistillConfig, check_teacher_channels, resolve_mode
from .ema import reshard_
from .losses import DINOLoss, IBOTPatchLoss

log = logging.getLogger(__name__)


def resample_patch_tokens(x: Tensor, src_hw: tuple[int, int], dst_hw: tuple[int, int]) -> Tensor:
    """(B, h*w, D) tokens on one grid -> (B, H*W, D) on another (bilinear), e.g. patch 16 -> patch 14."""
    if src_hw == dst_hw:
        return x
    B, _, D = x.shape
    grid = x.transpose(1, 2).reshape(B, D, *src_hw)
    return F.interpolate(grid, size=dst_hw, mode="bilinear", align_corners=False).flatten(2).transpose(1, 2)


def _grid(crops: Tensor, patch: int) -> tuple[int, int]:
    return crops.shape[-2] // patch, crops.shape[-1] // patch


def _student_grid(out: dict, crops: Tensor, backbone: nn.Module) -> tuple[int, int]:
    """The grid of a student's patch tokens: a CNN reports its last feature map's (h, w); a ViT's follows
    from the crop and its patch size."""
    return out.get("patch_grid") or _grid(crops, backbone.patch_size)


def create_student(model_cfg) -> nn.Module:
    """A registry ViT, or any timm model (``timm:NAME``, random init) behind the same interface."""
    if is_timm_name(model_cfg.name):
        return create_model(model_cfg.name, img_size=model_cfg.img_size, drop_path_rate=model_cfg.drop_path_rate,
                            in_chans=model_cfg.in_chans or 3)
    return create_model(model_cfg.name, **model_cfg.create_kwargs())


def match_teacher_channels(backbone: nn.Module, cfg: DistillConfig) -> nn.Module:
    """An RGB teacher for N-channel data: its patch embedding expanded as ``teacher_model.expand_patch_embed``
    says (the expansion of continued pretraining); any other mismatch is a ConfigError (checked before the run)."""
    have, want = in_channels(backbone), cfg.data.channels
    check_teacher_channels(cfg, have)
    if have == want:
        return backbone
    tm = cfg.teacher_model
    log.info("expanding the teacher's patch embedding from 3 to %d channels (%s)", want, tm.expand_patch_embed)
    return expand_patch_embed(backbone, want, str(tm.expand_patch_embed), tm.rgb_channels)


class DistillTask(TeacherStudentTask):
    """Students (backbone + heads or projections), each with its EMA, learning from one frozen teacher that
    ``load_backbone`` / ``load_heads`` (``dinopipe.load`` and its heads reader, handed in by the train
    layer) read from ``teacher_model.path``."""

    def __init__(self, cfg: DistillConfig, all_reduce_fn=None, load_backbone: Optional[LoadBackbone] = None,
                 load_heads: Optional[LoadHeads] = None) -> None:
        super().__init__(cfg, all_reduce_fn, load_backbone, load_heads)
        if load_backbone is None:
            raise TypeError("DistillTask needs load_backbone (e.g. dinopipe.load) to read the teacher")
        path = cfg.teacher_model.path
        t_backbone = match_teacher_channels(load_backbone(path, num_heads=cfg.teacher_model.num_heads), cfg)
        head_sds = load_heads(path) if load_heads is not None else {}
        self.mode = resolve_mode(cfg, has_heads="dino_head" in head_sds)  # ConfigError: checked before the run
        t_heads = {name: build_head(state_dict=sd) for name, sd in head_sds.items()}
        self.teacher = nn.ModuleDict({"backbone": t_backbone, **(t_heads if self.mode == "ssl" else {})})
        self.teacher.requires_grad_(False).eval()
        t_dim = t_backbone.embed_dim
        self.students = nn.ModuleDict()
        for s in cfg.students:
            backbone = create_student(s.model)
            set_input_norm(backbone, cfg.data.mean, cfg.data.std)  # exports record the data's statistics
            # Students see unmasked crops: a parameter that never gets a gradient must be frozen, or its
            # optimizer state would be missing from checkpoints and resuming would fail.
            if getattr(backbone, "mask_token", None) is not None:
                backbone.mask_token.requires_grad_(False)
            if self.mode == "ssl":
                mods = {name: self._student_head(sd, backbone.embed_dim, t_dim) for name, sd in head_sds.items()}
            else:
                mods = {"proj_cls": nn.Linear(backbone.embed_dim, t_dim), "proj_patch": nn.Linear(backbone.embed_dim, t_dim)}
            self.students[s.name] = nn.ModuleDict({"backbone": backbone, **mods})
        self.emas = copy.deepcopy(self.students).requires_grad_(False)
        t = cfg.teacher
        if self.mode == "ssl":
            self.dino_loss = DINOLoss(n_prototypes(t_heads["dino_head"]), t.student_temp, t.center_momentum,
                                      t.centering, all_reduce_fn=all_reduce_fn)
            ibot = t_heads.get("ibot_head", t_heads["dino_head"])
            self.ibot_loss = IBOTPatchLoss(n_prototypes(ibot), t.student_temp, t.center_momentum, t.centering,
                                           all_reduce_fn=all_reduce_fn)

    def _student_head(self, teacher_head: dict[str, Tensor], in_dim: int, t_dim: int) -> nn.Module:
        """``student_heads=new`` (DINOv2): a fresh head shaped like the teacher's (same prototypes) on the
        student's width. ``teacher``: a trainable copy of the teacher's head, behind a linear map from the
        student's width to the teacher's when they differ (measured worse at CPU scale: README, quality)."""
        if self.cfg.student_heads == "new":
            return build_head(in_dim, head_config(teacher_head))
        copied = build_head(state_dict=teacher_head).requires_grad_(True)
        return copied if in_dim == t_dim else nn.Sequential(nn.Linear(in_dim, t_dim), copied)

    # -- declarations -----------------------------------------------------------------------------------
    def trained_groups(self) -> dict[str, nn.ModuleDict]:
        return {f"student.{name}": group for name, group in self.students.items()}

    def kept_groups(self) -> dict[str, tuple[nn.ModuleDict, nn.ModuleDict]]:
        return {f"ema.{name}": (self.emas[name], self.students[name]) for name in self.students}

    def frozen_groups(self) -> list[nn.ModuleDict]:
        return [self.teacher]  # never written into checkpoints: it is reloaded from its own path

    def loss_modules(self) -> dict[str, nn.Module]:
        return {"dino": self.dino_loss, "ibot": self.ibot_loss} if self.mode == "ssl" else {}

    @property
    def data_patch_size(self) -> int:
        return self.teacher["backbone"].patch_size

    def lr_scales(self) -> dict[str, float]:
        """Each student's lr relative to the schedule (``build_optimizer``'s ``lr_scales``)."""
        return {f"student.{s.name}": s.lr_scale for s in self.cfg.students}

    def export_specs(self, step: int) -> list[ExportSpec]:
        """Each student's EMA backbone to RUN/export/NAME."""
        return [ExportSpec(name, ema["backbone"], {},
                           {"step": step, "source": f"dinopipe distill ({self.mode}), EMA of student '{name}'",
                            "teacher": str(self.cfg.teacher_model.path)})
                for name, ema in self.emas.items()]

    def metric_keys(self) -> list[str]:
        """Every number ``compute_loss`` logs: per student its loss and the parts of its mode."""
        parts = ["dino_loss", "ibot_loss", "koleo_loss"] if self.mode == "ssl" else ["cls_loss", "patch_loss"]
        return [f"{s}/{k}" for s in self.students for k in ["loss", *parts]]

    # -- loss -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _teacher_outputs(self, crops: list[Tensor], values: dict) -> dict[str, Any]:
        outs = self.teacher["backbone"].forward_features_list(crops)
        if self.mode == "feature":
            reshard_(self.teacher)  # no backward will free the gathered copies
            return {"outs": outs}
        g = outs[0]
        patches = g["x_norm_patchtokens"].flatten(0, 1)  # every patch of both global crops (no masking)
        cls_logits = self.teacher["dino_head"](g["x_norm_clstoken"])
        patch_logits = self.teacher["ibot_head" if "ibot_head" in self.teacher else "dino_head"](patches)
        reshard_(self.teacher)
        temp = values["teacher_temp"]
        return {"cls_probs": self.dino_loss.teacher_probs(cls_logits, temp),
                "patch_probs": self.ibot_loss.teacher_probs(patch_logits, temp), "outs": outs}

    def _ssl_loss(self, student: nn.ModuleDict, outs: list[dict], crops: list[Tensor], t: dict) -> tuple[Tensor, dict]:
        g = outs[0]
        n_g = g["x_norm_clstoken"].shape[0]
        cls = torch.cat([o["x_norm_clstoken"] for o in outs])
        cls_logits = student["dino_head"](cls)
        dino = self.dino_loss(cls_logits[:n_g], t["cls_probs"], cls_logits[n_g:] if len(outs) > 1 else None)
        t_grid = _grid(crops[0], self.teacher["backbone"].patch_size)
        patches = resample_patch_tokens(g["x_norm_patchtokens"], _student_grid(g, crops[0], student["backbone"]), t_grid)
        head = student["ibot_head"] if "ibot_head" in student else student["dino_head"]
        n_patch = t_grid[0] * t_grid[1]
        weights = torch.full((n_g * n_patch,), 1.0 / n_patch, device=patches.device)
        ibot = self.ibot_loss(head(patches.flatten(0, 1)), t["patch_probs"], n_images=n_g, masks_weight=weights)
        loss = self.cfg.dino.loss_weight * dino + self.cfg.ibot.loss_weight * ibot
        logs = {"dino_loss": dino.detach(), "ibot_loss": ibot.detach()}
        if self.cfg.dino.koleo_loss_weight:  # off by default for distillation; on, as in pretraining
            koleo = koleo_per_global_crop(g["x_norm_clstoken"])
            loss = loss + self.cfg.dino.koleo_loss_weight * koleo
            logs["koleo_loss"] = koleo.detach()
        return loss, logs

    def _feature_loss(self, student: nn.ModuleDict, outs: list[dict], crops: list[Tensor], t: dict) -> tuple[Tensor, dict]:
        f = self.cfg.feature

        def dist(a: Tensor, b: Tensor) -> Tensor:
            a, b = F.normalize(a.float(), dim=-1), F.normalize(b.float(), dim=-1)
            if f.loss == "cosine":
                return (1 - (a * b).sum(-1)).mean()
            return F.smooth_l1_loss(a, b, beta=0.1)

        cls_loss, patch_loss = 0.0, 0.0
        for o, to, c in zip(outs, t["outs"], crops):
            cls_loss = cls_loss + dist(student["proj_cls"](o["x_norm_clstoken"]), to["x_norm_clstoken"])
            p = resample_patch_tokens(o["x_norm_patchtokens"], _student_grid(o, c, student["backbone"]),
                                      _grid(c, self.teacher["backbone"].patch_size))
            patch_loss = patch_loss + dist(student["proj_patch"](p), to["x_norm_patchtokens"])
        loss = (f.cls_weight * cls_loss + f.patch_weight * patch_loss) / len(outs)
        return loss, {"cls_loss": cls_loss.detach() / len(outs), "patch_loss": patch_loss.detach() / len(outs)}

    def compute_loss(self, batch: dict, crops: list[Tensor], values: dict) -> tuple[Tensor, dict[str, Any]]:
        self.teacher.eval()
        t = self._teacher_outputs(crops, values)  # once, for every student
        total, logs = 0.0, {}
        for name, student in self.students.items():
            student.train()
            outs = student["backbone"].forward_features_list(crops)
            fn = self._ssl_loss if self.mode == "ssl" else self._feature_loss
            loss, parts = fn(student, outs, crops, t)
            total = total + loss
            logs[f"{name}/loss"] = loss.detach()
            logs.update({f"{name}/{k}": v for k, v in parts.items()})
        return total, logs


__all__ = ["DistillTask", "create_student", "resample_patch_tokens"]
