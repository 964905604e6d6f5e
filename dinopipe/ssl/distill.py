"""Distillation of a frozen teacher into one or more smaller students (DINOv2 §5, whose code was never
released; DINOv3 distils several students sharing one teacher forward).

Two modes:
- ``ssl`` — DINOv2's recipe, for a dinopipe pretraining run whose heads were exported: the students learn
  the DINO (CLS prototypes) and iBOT losses against the frozen teacher's own heads, with new student heads,
  iBOT on every patch token of both global crops, no masking and no stochastic depth by default; each
  student's EMA is the model kept.
- ``feature`` — for a bare backbone (released weights have no heads): cosine (or smooth-L1) distance of the
  student's CLS and patch tokens, through learned projections, to the teacher's; the student's patch grid
  is resampled to the teacher's when patch size or resolution differ.

One teacher forward per step feeds every student; each student has its own optimizer, EMA, checkpoint
state and export. The teacher is never written into checkpoints.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn

from ..config import ConfigError
from ..hub import load as load_backbone
from ..hub import save_backbone
from ..models import DINOHead, build_vit, create_model
from ..train.checkpoint import ModelOptimState, full_state_dict
from ..train.parallel import ParallelConfig, ema_update_, parallelize, reshard_
from .distill_config import DistillConfig
from .losses import DINOLoss, IBOTPatchLoss, koleo_loss

log = logging.getLogger(__name__)


# -- teacher ----------------------------------------------------------------------------------------------


def _heads_file(path: Path) -> Optional[Path]:
    for cand in (path / "export" / "teacher" / "heads.safetensors", path / "heads.safetensors"):
        if cand.is_file():
            return cand
    return None


def head_from_state_dict(sd: dict[str, Tensor]) -> DINOHead:
    """Rebuild a DINOHead from its weights' shapes (layers, widths, prototypes, learnable gain or not)."""
    linear = sorted((int(k.split(".")[1]), v) for k, v in sd.items() if k.startswith("mlp.") and k.endswith(".weight")
                    and v.dim() == 2)
    in_dim, hidden = linear[0][1].shape[1], linear[0][1].shape[0]
    head = DINOHead(in_dim, sd["last_layer.weight"].shape[0], hidden_dim=hidden, bottleneck_dim=linear[-1][1].shape[0],
                    nlayers=len(linear), norm_last_layer="last_layer_gain" not in sd)
    head.load_state_dict(sd)
    return head


def load_teacher(cfg: DistillConfig) -> tuple[nn.Module, dict[str, DINOHead]]:
    path = Path(cfg.teacher_model.path)
    backbone = load_backbone(path, num_heads=cfg.teacher_model.num_heads)
    heads: dict[str, DINOHead] = {}
    hf = _heads_file(path) if path.is_dir() else None
    if hf is not None:
        sd = load_file(str(hf))
        for name in ("dino_head", "ibot_head"):
            part = {k[len(name) + 1:]: v for k, v in sd.items() if k.startswith(name + ".")}
            if part:
                heads[name] = head_from_state_dict(part)
    return backbone, heads


def resample_patch_tokens(x: Tensor, src_hw: tuple[int, int], dst_hw: tuple[int, int]) -> Tensor:
    """(B, h*w, D) tokens on one grid -> (B, H*W, D) on another (bilinear), e.g. patch 16 -> patch 14."""
    if src_hw == dst_hw:
        return x
    B, _, D = x.shape
    grid = x.transpose(1, 2).reshape(B, D, *src_hw)
    return F.interpolate(grid, size=dst_hw, mode="bilinear", align_corners=False).flatten(2).transpose(1, 2)


def _grid(crops: Tensor, patch: int) -> tuple[int, int]:
    return crops.shape[-2] // patch, crops.shape[-1] // patch


class MultiOptimizer:
    """One optimizer per student behind the interface the loop uses (param_groups, zero_grad, step)."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for opt in self.optimizers.values():
            opt.step()


# -- task -------------------------------------------------------------------------------------------------


class DistillTask(nn.Module):
    def __init__(self, cfg: DistillConfig, all_reduce_fn=None) -> None:
        super().__init__()
        self.cfg = cfg
        t_backbone, t_heads = load_teacher(cfg)
        self.mode = cfg.mode if cfg.mode != "auto" else ("ssl" if "dino_head" in t_heads else "feature")
        if self.mode == "ssl" and "dino_head" not in t_heads:
            raise ValueError(f"mode=ssl needs the teacher's heads, but {cfg.teacher_model.path} has none "
                             f"(a bare backbone); use mode=feature")
        if self.mode == "feature" and cfg.dino.koleo_loss_weight:
            raise ConfigError("dino.koleo_loss_weight: KoLeo is a term of the ssl-mode losses; this run distils "
                              "features (a teacher without heads, or mode=feature), so set it to 0")
        self.teacher = nn.ModuleDict({"backbone": t_backbone, **(t_heads if self.mode == "ssl" else {})})
        self.teacher.requires_grad_(False).eval()
        t_dim = t_backbone.embed_dim
        self.students = nn.ModuleDict()
        for s in cfg.students:
            backbone = create_model(s.model.name, **s.model.create_kwargs())
            # Students see unmasked crops: a parameter that never gets a gradient must be frozen, or its
            # optimizer state would be missing from checkpoints and resuming would fail.
            backbone.mask_token.requires_grad_(False)
            if self.mode == "ssl":
                mods = {name: self._student_head(h, backbone.embed_dim, t_dim) for name, h in t_heads.items()}
            else:
                mods = {"proj_cls": nn.Linear(backbone.embed_dim, t_dim), "proj_patch": nn.Linear(backbone.embed_dim, t_dim)}
            self.students[s.name] = nn.ModuleDict({"backbone": backbone, **mods})
        self.emas = copy.deepcopy(self.students).requires_grad_(False)
        t = cfg.teacher
        if self.mode == "ssl":
            self.dino_loss = DINOLoss(t_heads["dino_head"].last_layer.weight.shape[0], t.student_temp,
                                      t.center_momentum, t.centering, all_reduce_fn=all_reduce_fn)
            ibot = t_heads.get("ibot_head", t_heads["dino_head"])
            self.ibot_loss = IBOTPatchLoss(ibot.last_layer.weight.shape[0], t.student_temp, t.center_momentum,
                                           t.centering, all_reduce_fn=all_reduce_fn)
        self.optimizers: dict[str, torch.optim.Optimizer] = {}

    def _student_head(self, head: DINOHead, in_dim: int, t_dim: int) -> nn.Module:
        if self.cfg.student_heads == "new":
            return self._new_head_like(head, in_dim)
        # A trainable copy of the teacher's head; a linear map carries the student's width to the teacher's.
        copied = copy.deepcopy(head).requires_grad_(True)
        return copied if in_dim == t_dim else nn.Sequential(nn.Linear(in_dim, t_dim), copied)

    @staticmethod
    def _new_head_like(head: DINOHead, in_dim: int) -> DINOHead:
        lin = [m for m in head.mlp if isinstance(m, nn.Linear)]
        return DINOHead(in_dim, head.last_layer.weight.shape[0], hidden_dim=lin[0].out_features,
                        bottleneck_dim=lin[-1].out_features, nlayers=len(lin))

    # -- set-up -------------------------------------------------------------------------------------------
    def parallelize(self, info, pcfg: Optional[ParallelConfig] = None) -> None:
        # Students train; the teacher and the EMAs never run backward, so they always reshard after forward.
        self.compute_dtype = parallelize([m for s in self.students.values() for m in s.values()], info, pcfg)
        frozen = list(self.teacher.values()) + [m for s in self.emas.values() for m in s.values()]
        parallelize(frozen, info, pcfg, frozen=True)
        if info.distributed:
            from torch.distributed.fsdp import register_fsdp_forward_method

            for group in [self.teacher] + list(self.students.values()) + list(self.emas.values()):
                register_fsdp_forward_method(group["backbone"], "forward_features_list")

    def build_optimizer(self, param_groups_fn) -> MultiOptimizer:
        o = self.cfg.optim
        for s in self.cfg.students:
            groups = param_groups_fn(self.students[s.name])
            for g in groups:
                g["lr_multiplier"] *= s.lr_scale
            self.optimizers[s.name] = torch.optim.AdamW(groups, betas=(o.adamw_beta1, o.adamw_beta2))
        return MultiOptimizer(self.optimizers)

    # -- loop interface ---------------------------------------------------------------------------------------
    def trainable_parameters(self):
        return self.students.parameters()

    def clip_groups(self) -> list[list[nn.Parameter]]:
        """Each student's gradients are clipped on their own: students must not slow each other down."""
        return [list(s.parameters()) for s in self.students.values()]

    def set_phase(self, phase) -> None:
        self.phase = phase

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
        patches = resample_patch_tokens(g["x_norm_patchtokens"], _grid(crops[0], student["backbone"].patch_size), t_grid)
        head = student["ibot_head"] if "ibot_head" in student else student["dino_head"]
        n_patch = t_grid[0] * t_grid[1]
        weights = torch.full((n_g * n_patch,), 1.0 / n_patch, device=patches.device)
        ibot = self.ibot_loss(head(patches.flatten(0, 1)), t["patch_probs"], n_images=n_g, masks_weight=weights)
        loss = self.cfg.dino.loss_weight * dino + self.cfg.ibot.loss_weight * ibot
        logs = {"dino_loss": dino.detach(), "ibot_loss": ibot.detach()}
        if self.cfg.dino.koleo_loss_weight:  # off by default for distillation; on, as in pretraining
            koleo = sum(koleo_loss(c) for c in g["x_norm_clstoken"].chunk(2))  # per global crop
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
            p = resample_patch_tokens(o["x_norm_patchtokens"], _grid(c, student["backbone"].patch_size),
                                      _grid(c, self.teacher["backbone"].patch_size))
            patch_loss = patch_loss + dist(student["proj_patch"](p), to["x_norm_patchtokens"])
        loss = (f.cls_weight * cls_loss + f.patch_weight * patch_loss) / len(outs)
        return loss, {"cls_loss": cls_loss.detach() / len(outs), "patch_loss": patch_loss.detach() / len(outs)}

    def forward(self, batch: dict, values: dict) -> tuple[Tensor, dict[str, Any]]:
        device = next(self.students.parameters()).device
        batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        crops = [batch["global_crops"]] + ([batch["local_crops"]] if batch.get("local_crops") is not None else [])
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
        for reason, n in (batch.get("corrupt") or {}).items():
            logs[f"corrupt/{reason}"] = n
        logs["compute_dtype"] = getattr(self, "compute_dtype", "fp32")
        return total, logs

    def after_step(self, values: dict) -> None:
        for name in self.students:
            ema_update_(self.emas[name], self.students[name], values["momentum"])

    def checkpoint_states(self, optimizer) -> dict[str, Any]:
        states: dict[str, Any] = {}
        for name in self.students:
            states[f"student.{name}"] = ModelOptimState(self.students[name], self.optimizers[name])
            states[f"ema.{name}"] = ModelOptimState(self.emas[name])
        if self.mode == "ssl":
            states["loss_state"] = ModelOptimState(nn.ModuleDict({"dino": self.dino_loss, "ibot": self.ibot_loss}))
        return states  # the frozen teacher is never saved: it is reloaded from its own path

    def export(self, run_dir: Path, step: int) -> None:
        """Each student's EMA backbone to RUN/export/NAME (collective under FSDP: every rank calls this)."""
        from ..train.dist import get_info

        for name, ema in self.emas.items():
            sd = full_state_dict(ema["backbone"])
            if get_info().is_main:
                model = build_vit(**ema["backbone"].arch_config())
                model.load_state_dict(sd)
                save_backbone(model, Path(run_dir) / "export" / name,
                              extra={"step": step, "source": f"dinopipe distill ({self.mode}), EMA of student '{name}'",
                                     "teacher": str(self.cfg.teacher_model.path)})


__all__ = ["DistillTask", "MultiOptimizer", "load_teacher", "head_from_state_dict", "resample_patch_tokens"]
