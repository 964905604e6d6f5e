"""``dinopipe distill --config configs/distill/X.yaml [key=value ...]``: load config -> build -> run -> close.

Same loop, phases, checkpoints, resume and preemption handling as pretraining; the task differs.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Optional, Sequence

import torch

from ..config import ConfigError, save_config
from ..ssl.distill import DistillTask
from ..ssl.distill_config import DistillConfig, validate
from ..ssl.param_groups import build_param_groups
from .builders import open_pool, stage_main, train
from .dist import all_reduce_sum_fn, init_distributed


def run(cfg: DistillConfig) -> int:
    refs, read = open_pool(cfg)
    info = init_distributed(cfg.train.device)
    if info.is_main:
        save_config(cfg, cfg.train.output_dir)
    torch.manual_seed(cfg.train.seed)
    task = DistillTask(cfg, all_reduce_fn=all_reduce_sum_fn()).to(info.device)
    task.parallelize(info, cfg.parallel)
    o = cfg.optim
    optimizer = task.build_optimizer(partial(build_param_groups, lr_decay_rate=o.layerwise_decay,
                                             patch_embed_lr_mult=o.patch_embed_lr_mult))
    # Crops must tile into every student's and the teacher's patches.
    patches = {task.teacher["backbone"].patch_size} | {s["backbone"].patch_size for s in task.students.values()}
    for ph in cfg.phases:
        for size in (ph.global_crops_size, ph.local_crops_size):
            bad = [p for p in patches if size % p]
            if bad and (size == ph.global_crops_size or cfg.crops.local_crops_number):
                raise ConfigError(f"phases[{ph.name}]: crop size {size} is not a multiple of patch size(s) {bad}")
    return train(cfg, task, optimizer, info, refs, read, task.teacher["backbone"].patch_size)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return stage_main("distill", DistillConfig, validate, run, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
