"""``dinopipe pretrain --config configs/pretrain/X.yaml [key=value ...]``: load config -> build -> run -> close.

Rerunning the same command resumes from the run directory's latest checkpoint.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional, Sequence

import torch

from ..config import save_config
from ..ssl.config import PretrainConfig
from ..ssl.param_groups import build_param_groups
from ..ssl.task import SSLTask
from .builders import EXIT_NON_FINITE, open_pool, stage_main, train
from .checks import validate_pretrain
from .dist import all_reduce_sum_fn, init_distributed

log = logging.getLogger(__name__)
__all__ = ["run", "main", "EXIT_NON_FINITE"]


def run(cfg: PretrainConfig) -> int:
    refs, read = open_pool(cfg)  # a wrong data path is a config error: exit 2 before anything is written
    info = init_distributed(cfg.train.device)
    if info.is_main:
        save_config(cfg, cfg.train.output_dir)
    torch.manual_seed(cfg.train.seed)  # same initial weights on every rank and every rerun
    task = SSLTask(cfg, all_reduce_fn=all_reduce_sum_fn()).to(info.device)
    task.parallelize(info, cfg.parallel)
    o = cfg.optim
    optimizer = torch.optim.AdamW(build_param_groups(task.student, o.layerwise_decay, o.patch_embed_lr_mult),
                                  betas=(o.adamw_beta1, o.adamw_beta2))
    return train(cfg, task, optimizer, info, refs, read, task.student["backbone"].patch_size)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return stage_main("pretrain", PretrainConfig, validate_pretrain, run, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
