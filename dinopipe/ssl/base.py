"""The teacher–student base every training stage builds on (open_clip's ``task/`` classes: the subclass is
its loss).

A stage (pretraining in ``task.py``, distillation in ``distill.py``) adds its heads and ``compute_loss``; this
class owns the rest: moving the batch to the device and building the crop list, corrupt-image counts in the
logs, the EMA of the kept model(s), which modules train and which are frozen, which extra forward methods
FSDP2 must hook, the per-student optimizers, what a checkpoint holds and which backbones are exported.

Distribution, checkpoint files and export files are the train layer's business (``dinopipe/train/run.py``):
it reads the declarations below (``shard_groups``, ``forward_methods``, ``state_modules``, ``export_specs``)
and never reaches into a stage's attributes. Files are read through callables the train layer hands in
(``load_backbone``, ``load_heads``), so this layer imports only models and configs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from torch import Tensor, nn

from ..models import DINOHead
from .adamw import ShardLocalAdamW
from .config import HeadConfig
from .ema import ema_update_
from .losses import koleo_loss, koleo_loss_distributed

LoadBackbone = Callable[..., nn.Module]
"""``dinopipe.load``-like: (path, **kwargs) -> backbone module."""
LoadHeads = Callable[[Any], dict[str, dict[str, Tensor]]]
"""(path) -> {head name: state dict} of the heads exported with a backbone ({} for a bare backbone)."""


# -- heads ------------------------------------------------------------------------------------------------


def head_config(sd: Mapping[str, Tensor]) -> HeadConfig:
    """The shape of a saved DINOHead (layers, widths, prototypes), read from its weights."""
    linear = sorted((int(k.split(".")[1]), v) for k, v in sd.items()
                    if k.startswith("mlp.") and k.endswith(".weight") and v.dim() == 2)
    kind = ("weight_norm" if "last_layer_gain" in sd else "linear" if "plain_last_layer" in sd
            else "weight_norm_fixed")
    return HeadConfig(n_prototypes=int(sd["last_layer.weight"].shape[0]), hidden_dim=int(linear[0][1].shape[0]),
                      bottleneck_dim=int(linear[-1][1].shape[0]), nlayers=len(linear), last_layer=kind)


def build_head(in_dim: Optional[int] = None, cfg: Optional[HeadConfig] = None,
               state_dict: Optional[Mapping[str, Tensor]] = None) -> DINOHead:
    """The one way to make a DINO head: fresh from a config, or rebuilt from a state dict (shape, input width
    and learnable gain or not all read from the weights, which are then loaded). ``head_config(sd)`` with a
    new ``in_dim`` gives a fresh head shaped like a saved one (a student's head next to its teacher's)."""
    if state_dict is None:
        if in_dim is None or cfg is None:
            raise TypeError("build_head: give in_dim and cfg, or a state_dict")
        return DINOHead(in_dim, cfg.n_prototypes, cfg.hidden_dim, cfg.bottleneck_dim, cfg.nlayers,
                        last_layer=str(cfg.last_layer))
    cfg = cfg or head_config(state_dict)
    first = min((k for k in state_dict if k.startswith("mlp.") and k.endswith(".weight")),
                key=lambda k: int(k.split(".")[1]))
    head = DINOHead(int(state_dict[first].shape[1]), cfg.n_prototypes, cfg.hidden_dim, cfg.bottleneck_dim,
                    cfg.nlayers, last_layer=head_config(state_dict).last_layer)
    head.load_state_dict(dict(state_dict))
    return head


def n_prototypes(head: DINOHead) -> int:
    return int(head.last_layer.weight.shape[0])


def koleo_per_global_crop(g_cls: Tensor, distributed: bool = False, gather=None, rank: int = 0,
                          group_size: Optional[int] = None, topk: int = 1) -> Tensor:
    """KoLeo on the student's global-crop CLS features, one term per global crop (2B rows: crop 1, crop 2).

    ``distributed`` (DINOv3's ``koleo_loss_distributed``): each crop's neighbours are searched in its group of the
    global batch (``gather``: the train layer's differentiable all-gather, None in one process; ``rank``: this
    rank), see :func:`koleo_loss_distributed`; otherwise within this rank's batch, as DINOv2."""
    if not distributed:
        return sum(koleo_loss(c) for c in g_cls.chunk(2))  # type: ignore[return-value]
    return sum(koleo_loss_distributed(c, gather, rank, group_size, topk)  # type: ignore[return-value]
               for c in g_cls.chunk(2))


# -- optimizers -------------------------------------------------------------------------------------------


def adamw_impl(device: torch.device) -> dict[str, bool]:
    """AdamW's implementation for parameters on ``device``: the fused kernel on CUDA (one launch per dtype and
    device for every parameter of a group, step counters on the device: no host work per parameter), the
    multi-tensor ``foreach`` one elsewhere (torch's default on CPU is the per-parameter for-loop)."""
    return {"fused": True} if device.type == "cuda" else {"foreach": True}


class MultiOptimizer:
    """One optimizer per trained group behind the interface the loop uses (param_groups, zero_grad, step)."""

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


# -- what the train layer reads ---------------------------------------------------------------------------


@dataclass
class ExportSpec:
    """One kept backbone to write to RUN/export/NAME (with its heads when a later stage needs them)."""

    name: str
    backbone: nn.Module
    heads: dict[str, nn.Module] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    """Written into the export's config.json (step, source, ...)."""


class TeacherStudentTask(nn.Module):
    """Base of the training tasks. A subclass sets up its groups (``nn.ModuleDict``s holding a ``backbone``
    and heads) in ``__init__`` and implements the declarations and ``compute_loss``."""

    forward_methods: tuple[str, ...] = ("forward_features_list",)
    """Backbone methods the tasks call instead of forward(): FSDP2 must unshard the root params around them."""

    def __init__(self, cfg: Any, all_reduce_fn: Optional[Callable] = None,
                 load_backbone: Optional[LoadBackbone] = None, load_heads: Optional[LoadHeads] = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.all_reduce_fn = all_reduce_fn
        self.all_gather_fn: Optional[Callable] = None
        """Differentiable all-gather across ranks (set by the train layer in a multi-process run; None alone)."""
        self.rank = 0
        self.load_backbone, self.load_heads = load_backbone, load_heads
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.compute_dtype = "fp32"  # set by the train layer's parallelize; reported in metrics.jsonl

    # -- declared by each stage ---------------------------------------------------------------------------
    def trained_groups(self) -> dict[str, nn.ModuleDict]:
        """Checkpoint name -> a group the optimizer trains (one per student)."""
        raise NotImplementedError

    def kept_groups(self) -> dict[str, tuple[nn.ModuleDict, nn.ModuleDict]]:
        """Checkpoint name -> (EMA copy, the trained group it follows): the models a run keeps and exports."""
        raise NotImplementedError

    def frozen_groups(self) -> list[nn.ModuleDict]:
        """Groups that never train and are never saved (a distillation teacher, reloaded from its path)."""
        return []

    def loss_modules(self) -> dict[str, nn.Module]:
        """Loss modules with state that must resume (teacher centres)."""
        return {}

    def export_specs(self, step: int) -> list[ExportSpec]:
        raise NotImplementedError

    @property
    def data_patch_size(self) -> int:
        """Patch size the iBOT masks are drawn on (the collator's grid)."""
        raise NotImplementedError

    def compute_loss(self, batch: dict, crops: list[Tensor], values: dict) -> tuple[Tensor, dict[str, Any]]:
        raise NotImplementedError

    # -- what the train layer reads -----------------------------------------------------------------------
    def shard_groups(self) -> tuple[list[nn.Module], list[nn.Module]]:
        """(trained modules, frozen modules) for parallelize: each backbone and head is sharded on its own.
        EMA copies are sharded exactly like their students, so the EMA pairs local shards one to one."""
        trained = [m for g in self.trained_groups().values() for m in g.values()]
        frozen = [m for g in self.frozen_groups() for m in g.values()]
        frozen += [m for ema, _ in self.kept_groups().values() for m in ema.values()]
        return trained, frozen

    def backbones(self) -> list[nn.Module]:
        """Every backbone the task runs (for forward-method registration)."""
        groups = list(self.trained_groups().values()) + self.frozen_groups()
        groups += [ema for ema, _ in self.kept_groups().values()]
        return [g["backbone"] for g in groups]

    def state_modules(self, optimizer: Any = None) -> dict[str, tuple[nn.Module, Optional[torch.optim.Optimizer]]]:
        """Checkpoint name -> (module, its optimizer or None). Frozen groups are not saved. ``optimizer``: used
        for trained groups that ``build_optimizer`` did not make (a caller's own optimizer)."""
        out: dict[str, tuple[nn.Module, Optional[torch.optim.Optimizer]]] = {}
        kept = self.kept_groups()
        for name, group in self.trained_groups().items():
            out[name] = (group, self.optimizers.get(name, optimizer))
        for name, (ema, _) in kept.items():
            out[name] = (ema, None)
        if self.loss_modules():
            out["loss_state"] = (nn.ModuleDict(self.loss_modules()), None)
        return out

    def lr_scales(self) -> dict[str, float]:
        """Trained group name -> its lr relative to the schedule (missing: 1)."""
        return {}

    def build_optimizer(self, param_groups_fn: Callable[[nn.Module], list[dict]],
                        betas: tuple[float, float] = (0.9, 0.999)) -> MultiOptimizer:
        """AdamW per trained group (students must not share moments), each group's lr scaled by ``lr_scales``;
        fused on CUDA, foreach elsewhere (:func:`adamw_impl`), its update run on the local shards of FSDP2's
        DTensors (:class:`~dinopipe.ssl.adamw.ShardLocalAdamW`: no DTensor dispatch per op and group)."""
        scales = self.lr_scales()
        for name, group in self.trained_groups().items():
            groups = param_groups_fn(group)
            for g in groups:
                g["lr_multiplier"] *= scales.get(name, 1.0)
            device = next(group.parameters()).device
            self.optimizers[name] = ShardLocalAdamW(groups, betas=betas, **adamw_impl(device))
        return MultiOptimizer(self.optimizers)

    # -- loop interface -----------------------------------------------------------------------------------
    def trainable_parameters(self) -> Iterator[nn.Parameter]:
        for group in self.trained_groups().values():
            yield from group.parameters()

    def clip_groups(self) -> list[list[nn.Parameter]]:
        """Gradient sets clipped on their own. Official (``optim.clip_per_module``, default): each backbone and
        each head separately (dinov2 ``train/train.py:253,259``; dinov3 ``train/train.py:489-493``), so the heads'
        large gradients do not set the backbone's scale. Off: one set per student. Students never share one."""
        per_module = getattr(getattr(self.cfg, "optim", None), "clip_per_module", True)
        groups = self.trained_groups().values()
        if per_module:
            return [list(m.parameters()) for g in groups for m in g.values()]
        return [list(g.parameters()) for g in groups]

    def prepare_batch(self, batch: dict) -> tuple[dict, list[Tensor]]:
        """The batch on the trained models' device, and the crops in forward order (globals, then locals)."""
        if batch.get("global_crops") is None:  # the loop skips such steps on every rank (train/step_data.py)
            raise ValueError(f"a batch without images reached the task ({batch.get('corrupt')} unreadable)")
        device = next(self.trainable_parameters()).device
        batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        crops = [batch["global_crops"]] + ([batch["local_crops"]] if batch.get("local_crops") is not None else [])
        return batch, crops

    def forward(self, batch: dict, values: dict) -> tuple[Tensor, dict[str, Any]]:
        batch, crops = self.prepare_batch(batch)
        loss, logs = self.compute_loss(batch, crops, values)
        for reason, n in (batch.get("corrupt") or {}).items():  # per-rank counts of images that failed to decode
            logs[f"corrupt/{reason}"] = n
        logs["compute_dtype"] = self.compute_dtype
        return loss, logs

    def after_step(self, values: dict) -> None:
        for ema, group in self.kept_groups().values():
            ema_update_(ema, group, values["momentum"])


__all__ = ["TeacherStudentTask", "ExportSpec", "MultiOptimizer", "adamw_impl", "build_head", "head_config", "n_prototypes",
           "koleo_per_global_crop", "LoadBackbone", "LoadHeads"]
