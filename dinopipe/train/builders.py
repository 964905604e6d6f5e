"""What every training stage (pretrain, distill) builds the same way: step ranges of the resolution phases,
per-step schedules, multi-crop data loaders per phase, the loop, and the command-line entry."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable, Optional, Sequence

from ..config import ConfigError, exit_on_config_error, load_config, phase_steps
from ..data.loader import DataPosition, build_train_loader
from ..data.pool_index import open_pool as open_indexed_pool
from ..data.transforms import MultiCropAugmentation, MultiCropCollator
from ..logs import setup_logging
from ..ssl.schedules import Piece, build_ssl_schedules, piecewise, scaled_lr
from .dist import DistInfo, LaunchError, destroy
from .loop import LoopConfig, NonFiniteLossError, Phase, Trainer
from .signals import worker_ignore_signals

log = logging.getLogger(__name__)

EXIT_NON_FINITE = 3  # the loss or gradients became nan/inf; the last good checkpoint is kept

# ``cfg`` below is any stage config with the sections phases, crops, ibot (masking), optim, teacher
# (temperatures, momentum), data, train (PretrainConfig, DistillConfig).


def build_schedules(cfg: Any, world_size: int) -> dict:
    """Per-step arrays. The first phase follows DINOv2's schedules; each later phase restarts the lr with its
    own (lower, compressed) cosine — DINOv2 §4's short high-resolution stage — while weight decay, teacher
    momentum and temperature run over the whole run."""
    o, t = cfg.optim, cfg.teacher
    bounds = phase_steps(cfg)
    total = bounds[-1][1]

    def peak(ph):
        rule = "sqrt" if o.scale_lr_with_batch else "none"
        return scaled_lr(o.base_lr, ph.batch_size_per_gpu * world_size, rule=rule) * ph.lr_scale

    first_end = bounds[0][1]
    base = build_ssl_schedules(total, cfg.train.epoch_length, peak(cfg.phases[0]), o.min_lr, o.warmup_epochs,
                               o.weight_decay, o.weight_decay_end, t.momentum_teacher, t.final_momentum_teacher,
                               t.warmup_teacher_temp, t.teacher_temp, t.warmup_teacher_temp_epochs,
                               o.freeze_last_layer_epochs)
    if len(cfg.phases) == 1:
        lr = base.lr.values
    else:
        first = build_ssl_schedules(first_end, cfg.train.epoch_length, peak(cfg.phases[0]), o.min_lr,
                                    o.warmup_epochs).lr.values
        pieces = [first]
        for ph, (s, e) in zip(cfg.phases[1:], bounds[1:]):
            n = e - s
            pieces.append(Piece("cosine", n, peak(ph), o.min_lr, warmup_steps=int(ph.warmup_fraction * n),
                                warmup_start=o.min_lr))
        lr = piecewise(pieces)
    last_layer = lr.copy()
    frozen = min(int(round(o.freeze_last_layer_epochs * cfg.train.epoch_length)), total)
    last_layer[:frozen] = 0.0
    return {"lr": lr, "wd": base.weight_decay.values, "last_layer_lr": last_layer,
            "momentum": base.momentum.values, "teacher_temp": base.teacher_temp.values}


def build_phases(cfg: Any, info: DistInfo, refs, read, patch_size: int) -> list[Phase]:
    collator = MultiCropCollator(patch_size, tuple(cfg.ibot.mask_ratio_min_max), cfg.ibot.mask_sample_probability)
    phases = []
    for ph, (start, end) in zip(cfg.phases, phase_steps(cfg)):
        aug = MultiCropAugmentation(
            global_size=ph.global_crops_size, local_size=ph.local_crops_size, n_local=cfg.crops.local_crops_number,
            global_scale=tuple(cfg.crops.global_crops_scale), local_scale=tuple(cfg.crops.local_crops_scale))

        def loader(pos: DataPosition, aug=aug, ph=ph):
            return build_train_loader(refs, read, aug, collator, ph.batch_size_per_gpu, info.rank, info.world_size,
                                      cfg.train.seed, pos, num_workers=cfg.data.num_workers,
                                      pin_memory=info.device.type == "cuda", worker_init_fn=worker_ignore_signals,
                                      persistent_workers=cfg.data.persistent_workers)

        phases.append(Phase(ph.name, start, end, ph.batch_size_per_gpu, ph.global_crops_size,
                            ph.local_crops_size, build_loader=loader))
    return phases


def open_pool(cfg: Any):
    """(pool, read): the compact memory-mapped pool index (curation's, else built once in the run directory)."""
    try:
        pool = open_indexed_pool(cfg.data.paths, cache_dir=os.path.join(cfg.train.output_dir, "pool_index"))
        return pool, pool.read
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"data.paths: {exc}") from None


def train(cfg: Any, task, optimizer, info: DistInfo, refs, read, patch_size: int) -> int:
    """Run the generic loop for ``task`` over the configured phases; returns the exit code."""
    phases = build_phases(cfg, info, refs, read, patch_size)
    loop_cfg = LoopConfig(seed=cfg.train.seed, clip_grad=cfg.optim.clip_grad, log_every=cfg.train.log_every,
                          checkpoint_every=cfg.train.checkpoint_every, keep_last=cfg.train.keep_last,
                          stop_after=cfg.train.stop_after, progress=cfg.train.progress)
    trainer = Trainer(task, optimizer, build_schedules(cfg, info.world_size), phases, cfg.train.output_dir, info,
                      loop_cfg, pool_size=len(refs))
    return trainer.fit()


def stage_main(name: str, schema: type, validate: Callable[[Any], None], run: Callable[[Any], int],
               argv: Optional[Sequence[str]], doc: Optional[str]) -> int:
    """``dinopipe NAME --config X.yaml key=value ...``: config errors exit 2 before any work."""
    import argparse

    p = argparse.ArgumentParser(prog=f"dinopipe {name}", description=doc)
    p.add_argument("--config", default=None, help=f"YAML file (configs/{name}/...)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    args = p.parse_args(argv)
    try:
        cfg = load_config(schema, args.config, args.overrides)
        validate(cfg)
    except ConfigError as exc:
        exit_on_config_error(exc)
    setup_logging()
    clean = False  # every rank got here together: the final barrier is safe
    try:
        rc = run(cfg)
        clean = True
        return rc
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        exit_on_config_error(exc)
    except NonFiniteLossError as exc:  # all ranks agree on it (it comes out of the step's all-reduce)
        clean = True
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_NON_FINITE
    finally:
        destroy(clean)


__all__ = ["phase_steps", "build_schedules", "build_phases", "open_pool", "train", "stage_main", "EXIT_NON_FINITE",
       ]
