"""The DINOv2 self-supervised task: student (backbone + DINO/iBOT heads), EMA teacher, and the losses.

Per step (Oquab et al. 2023, §3 and App. A): the teacher sees the 2 global crops unmasked; the student sees
all crops in one packed forward, with iBOT masks on its global crops. Losses: DINO on CLS prototypes
(every student crop vs. the other teacher global crops), iBOT on the masked patch tokens, KoLeo on the
student's global-crop CLS features. The teacher follows the student by EMA after each optimizer step.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Optional

import torch
from torch import Tensor, nn

from ..models import create_model
from ..models.channels import expand_patch_embed, in_chans_of
from ..utils.norm import set_input_norm
from .adapt import heads_source, read_heads
from .base import ExportSpec, LoadBackbone, TeacherStudentTask, build_head, koleo_per_global_crop
from .config import PretrainConfig
from .ema import ema_update_, reshard_
from .gram import GramTeacher
from .losses import DINOLoss, IBOTPatchLoss

log = logging.getLogger(__name__)

_TRAINING_KWARGS = ("drop_path_rate", "drop_path_uniform", "efficient_drop_path", "attn_backend")
_DINOV3_TRAINING_KWARGS = ("rope_rescale", "rope_shift", "rope_jitter", "rope_dtype")


def build_backbone(cfg: PretrainConfig, load_backbone: Optional[LoadBackbone] = None) -> nn.Module:
    """Fresh backbone from the registry, or released / earlier weights for continued pretraining (read with
    ``load_backbone``, i.e. ``dinopipe.load``, which the train layer hands in)."""
    kwargs = cfg.model.create_kwargs()
    if cfg.model.pretrained:
        if load_backbone is None:
            raise TypeError("model.pretrained is set: pass load_backbone (e.g. dinopipe.load) to read it")
        # Keep the file's architecture (incl. its position-embedding grid; other sizes are interpolated).
        # Training-only DINOv3 settings (RoPE augmentations) apply too when given (they change no weights).
        extra = {k: kwargs[k] for k in _DINOV3_TRAINING_KWARGS if k in kwargs}
        model = load_backbone(cfg.model.pretrained, num_heads=cfg.model.num_heads,
                              **{k: kwargs[k] for k in _TRAINING_KWARGS}, **extra)
        log.info("initialised backbone from %s", cfg.model.pretrained)
        model = match_channels(model, cfg.model).train()
    else:
        model = create_model(cfg.model.name, **kwargs)
    set_input_norm(model, cfg.data.mean, cfg.data.std)  # N channels: exports record the statistics
    return model


def match_channels(model: nn.Module, mcfg) -> nn.Module:
    """A pretrained RGB backbone for N-channel data: expand its patch embedding (model.expand_patch_embed)."""
    want = getattr(mcfg, "in_chans", None)
    have = in_chans_of(model)
    if want is None or want == have:
        return model
    if have != 3:
        from ..config import ConfigError

        raise ConfigError(f"model.in_chans: {mcfg.pretrained} takes {have} channels; only RGB (3-channel) weights "
                          f"can be expanded to {want}")
    log.info("expanding the patch embedding from 3 to %d channels (%s)", want, mcfg.expand_patch_embed)
    return expand_patch_embed(model, want, str(mcfg.expand_patch_embed), mcfg.rgb_channels)


class SSLTask(TeacherStudentTask):
    """DINOv2 pretraining: the student (backbone + DINO head [+ iBOT head]) and its EMA, the teacher."""

    metric_keys = ("dino_loss", "ibot_loss", "koleo_loss", "gram_loss", "n_masked", "n_images")
    """Every number ``compute_loss`` logs (the loop reduces exactly these over ranks; gram_loss only while on)."""

    def __init__(self, cfg: PretrainConfig, all_reduce_fn=None, load_backbone: Optional[LoadBackbone] = None,
                 load_heads=None) -> None:
        super().__init__(cfg, all_reduce_fn, load_backbone, load_heads)
        backbone = build_backbone(cfg, load_backbone)
        dim = backbone.embed_dim
        saved = read_heads(cfg, load_heads, dim)  # model.pretrained_heads: a previous run's heads ({}: fresh)
        student = {"backbone": backbone, "dino_head": build_head(dim, cfg.dino.head)}
        if cfg.ibot.separate_head:
            student["ibot_head"] = build_head(dim, cfg.ibot.head)
        for name, sd in saved.items():
            student[name].load_state_dict(dict(sd))
        if saved:
            log.info("heads %s loaded from %s", sorted(saved), heads_source(cfg.model))
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
        # Plain Python numbers for the compiled loss (no config object for dynamo to trace and guard on).
        self._loss_weights = (float(cfg.dino.loss_weight), float(cfg.ibot.loss_weight),
                              float(cfg.dino.koleo_loss_weight), bool(cfg.dino.koleo_distributed))
        # Gram anchoring (DINOv3): a frozen copy of the EMA teacher, refreshed at the steps gram.py schedules.
        self.gram = GramTeacher(self.teacher["backbone"], cfg.gram) if cfg.gram.enabled else None

    # -- declarations -----------------------------------------------------------------------------------
    def trained_groups(self) -> dict[str, nn.ModuleDict]:
        return {"student": self.student}

    def kept_groups(self) -> dict[str, tuple[nn.ModuleDict, nn.ModuleDict]]:
        return {"teacher": (self.teacher, self.student)}

    def loss_modules(self) -> dict[str, nn.Module]:
        return {"dino": self.dino_loss, "ibot": self.ibot_loss}

    # The Gram teacher: frozen, sharded like the EMA teacher (so a refresh copies shard to shard) and saved with
    # every checkpoint (it is an earlier teacher, not rebuildable from the current state): resume stays exact.
    def shard_groups(self) -> tuple[list[nn.Module], list[nn.Module]]:
        trained, frozen = super().shard_groups()
        return trained, frozen + ([self.gram.backbone] if self.gram is not None else [])

    def backbones(self) -> list[nn.Module]:
        return super().backbones() + ([self.gram.backbone] if self.gram is not None else [])

    def state_modules(self, optimizer=None) -> dict:
        out = super().state_modules(optimizer)
        if self.gram is not None:
            out["gram_teacher"] = (self.gram.backbone, None)
        return out

    @property
    def data_patch_size(self) -> int:
        return self.student["backbone"].patch_size

    def export_specs(self, step: int) -> list[ExportSpec]:
        """The EMA teacher's backbone + heads (heads: a later distillation can use DINOv2's recipe)."""
        heads = {name: m for name, m in self.teacher.items() if name != "backbone"}
        return [ExportSpec("teacher", self.teacher["backbone"], heads,
                           {"step": step, "source": "dinopipe pretrain (EMA teacher)"})]

    # -- loss -------------------------------------------------------------------------------------------
    def _heads(self, group: nn.ModuleDict, cls: Tensor, patches: Tensor) -> tuple[Tensor, Tensor]:
        """CLS -> DINO logits, masked patches -> iBOT logits (one head call when the head is shared)."""
        if "ibot_head" in group:
            return group["dino_head"](cls), group["ibot_head"](patches)
        logits = group["dino_head"](torch.cat([cls, patches]))
        # split, not two slices: its backward is one cat of the two gradients, where each slice's backward writes
        # a zero-filled (rows, 65,536) gradient and a third kernel adds them (~3 GB a ViT-S/14 b=64 step)
        cls_logits, patch_logits = logits.split([cls.shape[0], patches.shape[0]])
        return cls_logits, patch_logits

    @torch.no_grad()
    def _teacher_logits(self, batch: dict) -> tuple[Tensor, Tensor]:
        self.teacher.eval()
        out = self.teacher["backbone"].forward_features_list([batch["global_crops"]])[0]
        patches = out["x_norm_patchtokens"].flatten(0, 1)[batch["mask_indices"]]  # (M, D)
        cls_logits, patch_logits = self._heads(self.teacher, out["x_norm_clstoken"], patches)
        reshard_(self.teacher)  # no backward will free the gathered copies; the EMA needs the fp32 shards
        return cls_logits, patch_logits

    @torch.no_grad()
    def _teacher_targets(self, batch: dict, values: dict) -> tuple[Tensor, Tensor]:
        if getattr(self, "_queued_targets", None):  # computed for the whole accumulated batch
            return self._queued_targets.pop(0)
        cls_logits, patch_logits = self._teacher_logits(batch)
        temp = values["teacher_temp"]
        return self.dino_loss.teacher_probs(cls_logits, temp), self.ibot_loss.teacher_probs(patch_logits, temp)

    @torch.no_grad()
    def begin_accumulation(self, batches: list[dict], values: dict) -> None:
        """Gradient accumulation (train.accumulate=K): the teacher's targets of all K micro-batches first, with
        centring / Sinkhorn-Knopp (and the centre's update) over their union, as one batch K times larger would
        have them; each micro-batch's forward then takes its own rows. Holds K micro-batches' prototype scores."""
        logits = [self._teacher_logits(self.prepare_batch(b)[0]) for b in batches]
        temp = values["teacher_temp"]
        cls = self.dino_loss.teacher_probs(torch.cat([c for c, _ in logits]), temp)
        patch = self.ibot_loss.teacher_probs(torch.cat([p for _, p in logits]), temp)
        self._queued_targets = list(zip(cls.split([c.shape[0] for c, _ in logits]),
                                        patch.split([p.shape[0] for _, p in logits])))

    # -- head warm-up (continued pretraining, ssl/adapt.py) -------------------------------------------------
    def build_optimizer(self, param_groups_fn, betas=(0.9, 0.999)):
        opt = super().build_optimizer(param_groups_fn, betas)
        if self.cfg.train.head_warmup_steps:
            for o in self.optimizers.values():
                init_adamw_state_(o)
        return opt

    def after_step(self, values: dict) -> None:
        if values.get("backbone_frozen", 0.0) > 0:  # the teacher's backbone stays the release, bit for bit
            for name, module in self.student.items():
                if name != "backbone":
                    ema_update_(self.teacher[name], module, values["momentum"])
            return
        super().after_step(values)

    def _student_features(self, crops: list[Tensor], masks: list, values: dict) -> list[dict]:
        """The student backbone's packed forward; without gradients while the head warm-up freezes it."""
        backbone = self.student["backbone"]
        if values.get("backbone_frozen", 0.0) <= 0:
            return backbone.forward_features_list(crops, masks)
        with torch.no_grad():
            outs = backbone.forward_features_list(crops, masks)
        reshard_(backbone)  # no backward will free the gathered copies
        return outs

    def compute_loss(self, batch: dict, crops: list[Tensor], values: dict) -> tuple[Tensor, dict[str, Any]]:
        cfg = self.cfg
        teacher_cls, teacher_patch = self._teacher_targets(batch, values)
        self.student.train()
        masks = [batch["masks"]] + [None] * (len(crops) - 1)
        outs = self._student_features(crops, masks, values)  # one packed forward
        g_cls = outs[0]["x_norm_clstoken"]  # (2B, D)
        l_cls = outs[1]["x_norm_clstoken"] if len(outs) > 1 else g_cls[:0]
        patches = outs[0]["x_norm_patchtokens"].flatten(0, 1)[batch["mask_indices"]]  # (M, D)
        cls_logits, patch_logits = self._heads(self.student, torch.cat([g_cls, l_cls]), patches)
        n_g = g_cls.shape[0]
        loss, dino, ibot, koleo = self.loss_terms(cls_logits, teacher_cls, patch_logits, teacher_patch,
                                                  batch["masks_weight"], g_cls, len(outs) > 1,
                                                  values.get("dino_local_weight", 1.0))
        d = cfg.dino
        if d.koleo_distributed:  # a collective inside: outside the compiled loss
            koleo = koleo_per_global_crop(g_cls, True, self.all_gather_fn, self.rank, d.koleo_group_size, d.koleo_topk)
            loss = loss + d.koleo_loss_weight * koleo
        logs = {"dino_loss": dino.detach(), "ibot_loss": ibot.detach(), "koleo_loss": koleo.detach(),
                "n_masked": int(batch["mask_indices"].numel()), "n_images": int(batch.get("n_images", n_g // 2))}
        gram = self._gram_loss(batch, outs[0]["x_norm_patchtokens"], values)
        if gram is not None:
            loss = loss + values["gram_weight"] * gram
            logs["gram_loss"] = gram.detach()
        return loss, logs

    compiled_methods = ("loss_terms",)
    """Methods the train layer compiles with the blocks when ``parallel.compile`` is on (fullgraph: no graph break)."""

    def loss_terms(self, cls_logits: Tensor, teacher_cls: Tensor, patch_logits: Tensor, teacher_patch: Tensor,
                   masks_weight: Tensor, g_cls: Tensor, has_local: bool, local_weight: float
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The student's losses from its head outputs: (weighted sum, DINO, iBOT, KoLeo). Tensors in, tensors out
        and no collective (DINOv3's distributed KoLeo is added by the caller), so it compiles as one graph."""
        n_g = g_cls.shape[0]
        g_logits, l_logits = cls_logits.split([n_g, cls_logits.shape[0] - n_g])  # one cat in backward, as _heads
        dino = self.dino_loss(g_logits, teacher_cls, l_logits if has_local else None, local_weight=local_weight)
        ibot = self.ibot_loss(patch_logits, teacher_patch, n_images=n_g, masks_weight=masks_weight)
        w_dino, w_ibot, w_koleo, koleo_distributed = self._loss_weights
        koleo = g_cls.new_zeros((), dtype=torch.float32) if koleo_distributed else koleo_per_global_crop(g_cls)
        loss = w_dino * dino + w_ibot * ibot + w_koleo * koleo
        return loss, dino, ibot, koleo

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
        return self.gram.loss(student_patches, crops, grid, targets=targets, masks=batch["masks"])


@torch.no_grad()
def init_adamw_state_(opt: torch.optim.Optimizer) -> None:
    """AdamW's state as its first step would create it (step 0, zero moments), for every parameter now: a
    parameter without a gradient for the first steps (the frozen backbone of a head warm-up) otherwise has no
    state in the checkpoints written meanwhile, and resuming from one would fail on the missing keys (or, with
    torch's zero-gradient initialisation, start its moments from a fake step)."""
    for group in opt.param_groups:
        on_device = group.get("fused") or group.get("capturable")  # their step counters live with the params
        for p in group["params"]:
            if not opt.state.get(p):
                step = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                opt.state[p] = {"step": step,
                                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


__all__ = ["SSLTask", "build_backbone", "init_adamw_state_"]
