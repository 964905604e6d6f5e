"""``run_training(cfg, task_cls)``: the one body of every training stage (pretrain, distill), and the
train-layer side of the task interface (``dinopipe/ssl/base.py``).

A task declares what it holds (groups to shard, forward methods, checkpoint states, backbones to export);
this module does the distributed work on it: FSDP2 ``parallelize`` and forward-method registration, DCP
state wrapping, gathering full state dicts and writing exports. The loop (``loop.py``) sees a ``LoopTask``.
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch

from .. import hub
from ..config import ParallelConfig, save_config
from ..export import save_backbone, save_heads
from ..models import build_vit
from ..ssl.base import TeacherStudentTask
from ..ssl.param_groups import build_param_groups
from .builders import open_pool, train
from .checkpoint import ModelOptimState, full_state_dict
from .dist import DistInfo, all_reduce_sum_fn, get_info, init_distributed
from .parallel import parallelize

log = logging.getLogger(__name__)


def build_task(task_cls: type[TeacherStudentTask], cfg: Any, all_reduce_fn=None) -> TeacherStudentTask:
    """The task, with the readers it needs for files (pretrained backbones, a distillation teacher)."""
    return task_cls(cfg, all_reduce_fn=all_reduce_fn, load_backbone=hub.load, load_heads=hub.load_heads)


def parallelize_task(task: TeacherStudentTask, info: DistInfo, pcfg: Optional[ParallelConfig] = None) -> str:
    """Shard trained and frozen modules alike (so EMA copies pair local shards with their students one to
    one); frozen ones (no backward) always reshard after forward. Returns the compute dtype in effect."""
    trained, frozen = task.shard_groups()
    task.compute_dtype = parallelize(trained, info, pcfg)
    parallelize(frozen, info, pcfg, frozen=True)
    if info.distributed:
        from torch.distributed.fsdp import register_fsdp_forward_method

        for backbone in task.backbones():
            for method in task.forward_methods:  # called instead of forward(): FSDP2 must unshard around them
                register_fsdp_forward_method(backbone, method)
    return task.compute_dtype


def checkpoint_states(task: TeacherStudentTask, optimizer: Any = None) -> dict[str, ModelOptimState]:
    """The task's resumable state as DCP Statefuls, by checkpoint name."""
    return {name: ModelOptimState(module, opt) for name, (module, opt) in task.state_modules(optimizer).items()}


def export_task(task: TeacherStudentTask, run_dir: str | Path, step: int) -> None:
    """Each kept backbone (+ heads) consolidated to RUN/export/NAME, loadable by dinopipe.load without
    torch.distributed. Collective under FSDP: every rank gathers, rank 0 writes."""
    for spec in task.export_specs(step):
        backbone_sd = full_state_dict(spec.backbone)
        heads_sd = {name: full_state_dict(m) for name, m in spec.heads.items()}
        if not get_info().is_main:
            continue
        model = build_vit(**spec.backbone.arch_config())
        model.load_state_dict(backbone_sd)
        out = Path(run_dir) / "export" / spec.name
        save_backbone(model, out, extra=spec.extra)
        if heads_sd:
            save_heads(out, heads_sd)
        log.info("exported %s backbone to %s", spec.name, out)


class LoopTask:
    """What the generic loop drives: the task's forward, EMA and clip groups, plus the train layer's
    checkpoint states and export around it."""

    def __init__(self, task: TeacherStudentTask) -> None:
        self.task = task
        self.metric_keys = getattr(task, "metric_keys", ())  # the loop reduces exactly these (dinopipe/train/metrics.py)
        if hasattr(task, "begin_accumulation"):  # teacher targets over all micro-batches (train.accumulate)
            self.begin_accumulation = task.begin_accumulation

    def __call__(self, batch: Any, values: dict[str, float]):
        return self.task(batch, values)

    def trainable_parameters(self):
        return self.task.trainable_parameters()

    def clip_groups(self):
        return self.task.clip_groups()

    def after_step(self, values: dict[str, float]) -> None:
        self.task.after_step(values)

    def checkpoint_states(self, optimizer) -> dict[str, Any]:
        return checkpoint_states(self.task, optimizer)

    def export(self, run_dir: Path, step: int) -> None:
        export_task(self.task, run_dir, step)


def run_training(cfg: Any, task_cls: type[TeacherStudentTask]) -> int:
    """Load the pool -> init distributed -> write the config -> build, shard, optimize -> loop. Returns the
    exit code. Config mistakes were caught by the stage's validate() before this runs."""
    refs, read = open_pool(cfg)  # a wrong data path is a config error: exit 2 before anything is written
    info = init_distributed(cfg.train.device)
    if info.is_main:
        save_config(cfg, cfg.train.output_dir)
    torch.manual_seed(cfg.train.seed)  # same initial weights on every rank and every rerun
    task = build_task(task_cls, cfg, all_reduce_fn=all_reduce_sum_fn()).to(info.device)
    parallelize_task(task, info, cfg.parallel)
    o = cfg.optim
    optimizer = task.build_optimizer(partial(build_param_groups, lr_decay_rate=o.layerwise_decay,
                                             patch_embed_lr_mult=o.patch_embed_lr_mult, decay_tokens=o.decay_tokens),
                                     betas=(o.adamw_beta1, o.adamw_beta2))
    return train(cfg, LoopTask(task), optimizer, info, refs, read, task.data_patch_size)


__all__ = ["run_training", "build_task", "parallelize_task", "checkpoint_states", "export_task", "LoopTask"]
