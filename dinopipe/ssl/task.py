"""The DINOv2 self-supervised task: student (backbone + DINO/iBOT heads), EMA teacher, and the losses.

Per step (Oquab et al. 2023, §3 and App. A): the teacher sees the 2 global crops unmasked; the student sees
all crops in one packed forward, with iBOT masks on its global crops. Losses: DINO on CLS prototypes
(every student crop vs. the other teacher global crops), iBOT on the masked patch tokens, KoLeo on the
student's global-crop CLS features. The teacher follows the student by EMA after each optimizer step.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor, nn

from ..hub import load as load_backbone
from ..hub import save_backbone
from ..models import DINOHead, build_vit, create_model
from ..train.checkpoint import ModelOptimState, full_state_dict
from ..train.parallel import ParallelConfig, ema_update_, parallelize, reshard_
from .config import PretrainConfig
from .gram import GramTeacher
from .losses import DINOLoss, IBOTPatchLoss, koleo_loss

log = logging.getLogger(__name__)

_TRAINING_KWARGS = ("drop_path_rate", "drop_path_uniform", "efficient_drop_path", "attn_backend")
_DINOV3_TRAINING_KWARGS = ("rope_rescale", "rope_shift", "rope_jitter")


def build_backbone(cfg: PretrainConfig) -> nn.Module:
    """Fresh backbone from the registry, or released / earlier weights for continued pretraining."""
    kwargs = cfg.model.create_kwargs()
    if cfg.model.pretrained:
        # Keep the file's architecture (incl. its position-embedding grid; other sizes are interpolated).
        # Training-only DINOv3 settings (RoPE augmentations) apply too when given (they change no weights).
        extra = {k: kwargs[k] for k in _DINOV3_TRAINING_KWARGS if k in kwargs}
        model = load_backbone(cfg.model.pretrained, num_heads=cfg.model.num_heads,
                              **{k: kwargs[k] for k in _TRAINING_KWARGS}, **extra)
        log.info("initialised backbone from %s", cfg.model.pretrained)
        return model.train()
    return create_model(cfg.model.name, **kwargs)


def _head(in_dim: int, h) -> DINOHead:
    return DINOHead(in_dim, h.n_prototypes, h.hidden_dim, h.bottleneck_dim, h.nlayers)


class SSLTask(nn.Module):
    def __init__(self, cfg: PretrainConfig, all_reduce_fn=None) -> None:
        super().__init__()
        self.cfg = cfg
        backbone = build_backbone(cfg)
        dim = backbone.embed_dim
        student = {"backbone": backbone, "dino_head": _head(dim, cfg.dino.head)}
        if cfg.ibot.separate_head:
            student["ibot_head"] = _head(dim, cfg.ibot.head)
        self.student = nn.ModuleDict(student)
        self.teacher = copy.deepcopy(self.student)  # same init, as DINOv2
        for blk in self.teacher["backbone"].blocks:
            blk.drop_path_rate = 0.0  # the teacher never drops paths (it runs in eval anyway)
        self.teacher.requires_grad_(False)
        t = cfg.teacher
        self.dino_loss = DINOLoss(cfg.dino.head.n_prototypes, t.student_temp, t.center_momentum, t.centering,
                                  all_reduce_fn=all_reduce_fn)
        ibot_dim = (cfg.ibot.head if cfg.ibot.separate_head else cfg.dino.head).n_prototypes
        self.ibot_loss = IBOTPatchLoss(ibot_dim, t.student_temp, t.center_momentum, t.centering,
                                       all_reduce_fn=all_reduce_fn)
        # Gram anchoring (DINOv3): a frozen copy of the EMA teacher, refreshed at the steps gram.py schedules.
        self.gram = GramTeacher(self.teacher["backbone"], cfg.gram) if cfg.gram.enabled else None
        self.phase = None
        self.compute_dtype = "fp32"  # set by parallelize(); reported in metrics.jsonl

    # -- distribution -------------------------------------------------------------------------------
    def parallelize(self, info, pcfg: Optional[ParallelConfig] = None) -> None:
        """Same sharding for student and teacher, so the EMA update pairs local shards one to one; the
        teacher (no backward) always reshards after forward."""
        self.compute_dtype = parallelize(list(self.student.values()), info, pcfg)
        parallelize(list(self.teacher.values()), info, pcfg, frozen=True)
        if self.gram is not None:  # sharded like the EMA teacher, so a refresh copies shard to shard
            parallelize([self.gram.backbone], info, pcfg, frozen=True)
        if info.distributed:
            from torch.distributed.fsdp import register_fsdp_forward_method

            backbones = [g["backbone"] for g in (self.student, self.teacher)]
            for backbone in backbones + ([self.gram.backbone] if self.gram is not None else []):
                # The task calls this method, not forward(): FSDP2 must unshard the root params around it.
                register_fsdp_forward_method(backbone, "forward_features_list")

    # -- loop interface -------------------------------------------------------------------------------
    def trainable_parameters(self):
        return self.student.parameters()

    def set_phase(self, phase) -> None:
        self.phase = phase

    def _heads(self, group: nn.ModuleDict, cls: Tensor, patches: Tensor) -> tuple[Tensor, Tensor]:
        """CLS -> DINO logits, masked patches -> iBOT logits (one head call when the head is shared)."""
        if "ibot_head" in group:
            return group["dino_head"](cls), group["ibot_head"](patches)
        logits = group["dino_head"](torch.cat([cls, patches]))
        return logits[: cls.shape[0]], logits[cls.shape[0]:]

    @torch.no_grad()
    def _teacher_targets(self, batch: dict, values: dict) -> tuple[Tensor, Tensor]:
        self.teacher.eval()
        out = self.teacher["backbone"].forward_features_list([batch["global_crops"]])[0]
        patches = out["x_norm_patchtokens"].flatten(0, 1)[batch["mask_indices"]]  # (M, D)
        cls_logits, patch_logits = self._heads(self.teacher, out["x_norm_clstoken"], patches)
        reshard_(self.teacher)  # no backward will free the gathered copies; the EMA needs the fp32 shards
        temp = values["teacher_temp"]
        return self.dino_loss.teacher_probs(cls_logits, temp), self.ibot_loss.teacher_probs(patch_logits, temp)

    def forward(self, batch: dict, values: dict) -> tuple[Tensor, dict[str, Any]]:
        cfg = self.cfg
        device = next(self.student.parameters()).device
        batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        teacher_cls, teacher_patch = self._teacher_targets(batch, values)

        self.student.train()
        crops = [batch["global_crops"]] + ([batch["local_crops"]] if batch.get("local_crops") is not None else [])
        masks = [batch["masks"]] + [None] * (len(crops) - 1)
        outs = self.student["backbone"].forward_features_list(crops, masks)  # one packed forward
        g_cls = outs[0]["x_norm_clstoken"]  # (2B, D)
        l_cls = outs[1]["x_norm_clstoken"] if len(outs) > 1 else g_cls[:0]
        patches = outs[0]["x_norm_patchtokens"].flatten(0, 1)[batch["mask_indices"]]  # (M, D)
        cls_logits, patch_logits = self._heads(self.student, torch.cat([g_cls, l_cls]), patches)
        n_g = g_cls.shape[0]

        dino = self.dino_loss(cls_logits[:n_g], teacher_cls, cls_logits[n_g:] if len(outs) > 1 else None)
        ibot = self.ibot_loss(patch_logits, teacher_patch, n_images=n_g, masks_weight=batch["masks_weight"])
        koleo = sum(koleo_loss(c) for c in g_cls.chunk(2))  # per global crop, as DINOv2
        loss = cfg.dino.loss_weight * dino + cfg.ibot.loss_weight * ibot + cfg.dino.koleo_loss_weight * koleo
        extra = self._gram_loss(batch, outs[0]["x_norm_patchtokens"], values)
        if extra is not None:
            loss = loss + values["gram_weight"] * extra
        logs = {"dino_loss": dino.detach(), "ibot_loss": ibot.detach(), "koleo_loss": koleo.detach(),
                "n_masked": int(batch["mask_indices"].numel()), "n_images": int(batch.get("n_images", n_g // 2)),
                "compute_dtype": self.compute_dtype}
        if extra is not None:
            logs["gram_loss"] = extra.detach()
        for reason, n in (batch.get("corrupt") or {}).items():
            logs[f"corrupt/{reason}"] = n
        return loss, logs

    def _gram_loss(self, batch: dict, student_patches: Tensor, values: dict) -> Optional[Tensor]:
        """Gram anchoring of the student's global-crop patch tokens (2B, N, D); None while it is off."""
        if self.gram is None:
            return None
        if values.get("gram_refresh", 0.0) > 0:  # before this step's forward: the EMA teacher after the last step
            self.gram.refresh_(self.teacher["backbone"])
        if values.get("gram_weight", 0.0) <= 0:
            return None
        p = self.student["backbone"].patch_size
        crops = batch.get("gram_crops")
        crops = batch["global_crops"] if crops is None else crops  # no Gram crop size: the student's own crops
        grid = (batch["global_crops"].shape[-2] // p, batch["global_crops"].shape[-1] // p)
        targets = self.gram.targets(crops, grid)
        reshard_(self.gram)  # no backward will free the gathered copies
        return self.gram.loss(student_patches, crops, grid, targets=targets)

    def after_step(self, values: dict) -> None:
        ema_update_(self.teacher, self.student, values["momentum"])

    def checkpoint_states(self, optimizer) -> dict[str, Any]:
        return {
            "student": ModelOptimState(self.student, optimizer),
            "teacher": ModelOptimState(self.teacher),
            "loss_state": ModelOptimState(nn.ModuleDict({"dino": self.dino_loss, "ibot": self.ibot_loss})),
            # An earlier teacher, not rebuildable from the current state: saved so a resume keeps the anchor.
            **({"gram_teacher": ModelOptimState(self.gram.backbone)} if self.gram is not None else {}),
        }

    def export(self, run_dir: Path, step: int) -> None:
        """Consolidated teacher backbone (+ heads) under RUN/export/teacher; every rank must call this."""
        from ..train.dist import get_info

        backbone_sd = full_state_dict(self.teacher["backbone"])
        heads_sd = {name: full_state_dict(m) for name, m in self.teacher.items() if name != "backbone"}
        if not get_info().is_main:
            return
        arch = self.teacher["backbone"].arch_config()
        model = build_vit(**arch)
        model.load_state_dict(backbone_sd)
        out = Path(run_dir) / "export" / "teacher"
        save_backbone(model, out, extra={"step": step, "source": "dinopipe pretrain (EMA teacher)"})
        heads = {f"{name}.{k}": v.contiguous() for name, sd in heads_sd.items() for k, v in sd.items()}
        from safetensors.torch import save_file

        save_file(heads, str(out / "heads.safetensors"))
        log.info("exported teacher backbone to %s", out)


__all__ = ["SSLTask", "build_backbone"]
