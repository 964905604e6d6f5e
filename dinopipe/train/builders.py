"""What every training stage (pretrain, distill) builds the same way: step ranges of the resolution phases,
per-step schedules, multi-crop data loaders per phase, the loop, and the command-line entry."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable, Optional, Sequence

from ..config import ConfigError, exit_on_config_error, load_config, phase_steps
from ..utils.exits import EXIT_BAD_DATA, EXIT_UNFINISHED, UnfinishedError, check_writable
from ..data.pool_index import Ranks
from ..data.pool_index import open_pool as open_indexed_pool
from ..logs import setup_logging
from ..utils.safe_load import CheckpointError
from ..ssl.adapt import head_warmup_schedules
from ..ssl.gram import loss_weight_schedules
from ..ssl.schedules import Piece, build_ssl_schedules, linear_warmup_cosine_decay, piecewise, scaled_lr
from .dist import DistInfo, LaunchError, all_reduce_max_scalar, barrier, end_rank, init_distributed
from .highres import phase_loader, phase_sizes
from .knn_probe import build_probe
from .loop import LoopConfig, NonFiniteLossError, Phase, Trainer
from .step_data import TooMuchBadData
from .lr_record import LrBasis

log = logging.getLogger(__name__)

EXIT_NON_FINITE = 3  # the loss or gradients became nan/inf; the last good checkpoint is kept

# ``cfg`` below is any stage config with the sections phases, crops, ibot (masking), optim, teacher
# (temperatures, momentum), data, train (PretrainConfig, DistillConfig).


def global_batches(cfg: Any, world_size: int) -> list[int]:
    """Each phase's global batch per optimizer step: per-GPU batch x world size x accumulated micro-batches."""
    k = max(1, int(getattr(cfg.train, "accumulate", 1)))
    return [ph.batch_size_per_gpu * world_size * k for ph in cfg.phases]


def peak_lrs(cfg: Any, batches: Sequence[int]) -> list[float]:
    """Each phase's peak lr derived from the given global batches (DINOv2's sqrt rule unless switched off)."""
    o = cfg.optim
    rule = "sqrt" if o.scale_lr_with_batch else "none"
    return [scaled_lr(o.base_lr, b, rule=rule) * ph.lr_scale for ph, b in zip(cfg.phases, batches)]


def lr_basis(cfg: Any, world_size: int) -> LrBasis:
    """The schedules as a function of the global batch the lr is derived from: the loop builds them from this
    invocation's batch for a new run and from the checkpoint's recorded batch on resume (lr_record.py)."""
    return LrBasis(global_batches(cfg, world_size), lambda b: build_schedules(cfg, lr_batches=b),
                   lambda b: peak_lrs(cfg, b))


def build_schedules(cfg: Any, world_size: int = 1, lr_batches: Optional[Sequence[int]] = None) -> dict:
    """Per-step arrays. The first phase follows DINOv2's schedules; each later phase restarts the lr with its
    own (lower, compressed) cosine — DINOv2 §4's short high-resolution stage — or, with ``lr_schedule: constant``,
    holds its own peak (DINOv3's Gram stage); weight decay and teacher temperature run over the whole run, the
    teacher momentum too unless a phase sets its own (``phases[].momentum_teacher``). The peak lrs come from
    ``lr_batches`` (per phase), by default this world size's global batches."""
    o, t = cfg.optim, cfg.teacher
    bounds = phase_steps(cfg)
    total = bounds[-1][1]
    peaks = peak_lrs(cfg, global_batches(cfg, world_size) if lr_batches is None else lr_batches)

    first_end = bounds[0][1]
    shape = str(getattr(o, "schedule_shape", "dinov2"))
    base = build_ssl_schedules(total, cfg.train.epoch_length, peaks[0], o.min_lr, o.warmup_epochs,
                               o.weight_decay, o.weight_decay_end, t.momentum_teacher, t.final_momentum_teacher,
                               t.warmup_teacher_temp, t.teacher_temp, t.warmup_teacher_temp_epochs,
                               o.freeze_last_layer_epochs, shape=shape)
    constant = getattr(o, "lr_schedule", "cosine") == "constant"  # DINOv3: warm-up then the peak lr

    def first_lr(n: int):  # the first phase's lr: the one schedule shape (ssl/schedules.py)
        top = peaks[0]
        warm = int(round(o.warmup_epochs * cfg.train.epoch_length))
        if getattr(o, "lr_schedule", "cosine") == "rise":  # DINOv3 high-res adaptation: cosine 0 -> peak
            return linear_warmup_cosine_decay(0.0, 0.0, top, 0, n, cosine=warm, shape=shape)
        return linear_warmup_cosine_decay(0.0, top, top if constant else o.min_lr, warm, n, shape=shape)

    if len(cfg.phases) == 1:
        lr = first_lr(total)
    else:
        pieces = [first_lr(first_end)]
        for i, (ph, (s, e)) in enumerate(zip(cfg.phases[1:], bounds[1:]), start=1):
            n, warm = e - s, int(ph.warmup_fraction * (e - s))
            if constant:  # DINOv3: each stage holds its own peak (the Gram stage: 3e-5 after 5e-5)
                pieces.append(linear_warmup_cosine_decay(o.min_lr, peaks[i], peaks[i], warm, n, shape=shape))
            else:
                pieces.append(Piece("cosine", n, peaks[i], o.min_lr, warmup_steps=warm, warmup_start=o.min_lr))
        lr = piecewise(pieces)
    momentum = base.momentum.values.copy()
    for ph, (s, e) in zip(cfg.phases, bounds):
        if getattr(ph, "momentum_teacher", None) is not None:  # DINOv3's later stages: their own constant momentum
            momentum[s:e] = ph.momentum_teacher
    last_layer = lr.copy()
    last_layer[:int(round(o.freeze_last_layer_epochs * cfg.train.epoch_length))] = 0.0
    out = {"lr": lr, "wd": base.weight_decay.values, "last_layer_lr": last_layer,
           "momentum": momentum, "teacher_temp": base.teacher_temp.values}
    out.update(loss_weight_schedules(cfg, total))  # dino_local_weight, gram_weight, gram_refresh (ssl/gram.py)
    out.update(head_warmup_schedules(cfg, total))  # backbone_frozen, backbone_lr_scale (ssl/adapt.py)
    return out


def build_phases(cfg: Any, info: DistInfo, refs, read, patch_size: int) -> list[Phase]:
    phases = []
    for ph, (start, end) in zip(cfg.phases, phase_steps(cfg)):
        g, loc = phase_sizes(cfg, ph)  # a high-res adaptation phase draws its sizes per batch (highres.py)
        phases.append(Phase(ph.name, start, end, ph.batch_size_per_gpu, g, loc,
                            build_loader=phase_loader(cfg, ph, info, refs, read, patch_size)))
    return phases


def open_pool(cfg: Any):
    """(pool, read): the compact memory-mapped pool index (curation's, else built once in the run directory).

    Opened by all ranks together: the process group starts here (``init_distributed`` is idempotent; nothing is
    written before the paths are known to hold images), each rank stats only its share of the shards, and rank 0
    builds a missing index while the others wait on the process group."""
    info = init_distributed(cfg.train.device)
    ranks = Ranks(info.rank, info.world_size, lambda flag: all_reduce_max_scalar(1.0 if flag else 0.0) > 0, barrier)
    try:
        pool = open_indexed_pool(cfg.data.paths, cache_dir=os.path.join(cfg.train.output_dir, "pool_index"),
                                 ranks=ranks)
        return pool, pool.read
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"data.paths: {exc}") from None


def train(cfg: Any, task, optimizer, info: DistInfo, refs, read, patch_size: int) -> int:
    """Run the generic loop for ``task`` over the configured phases; returns the exit code."""
    phases = build_phases(cfg, info, refs, read, patch_size)
    loop_cfg = LoopConfig(seed=cfg.train.seed, clip_grad=cfg.optim.clip_grad, log_every=cfg.train.log_every,
                          checkpoint_every=cfg.train.checkpoint_every, keep_last=cfg.train.keep_last,
                          stop_after=cfg.train.stop_after, progress=cfg.train.progress,
                          accumulate=int(getattr(cfg.train, "accumulate", 1)),
                          checkpoint_dir=str(getattr(cfg.train, "checkpoint_dir", "") or ""),
                          max_skipped_in_a_row=int(getattr(cfg.train, "max_skipped_in_a_row", 50)),
                          max_corrupt_fraction=float(getattr(cfg.train, "max_corrupt_fraction", 0.5)))
    probe = build_probe(cfg, getattr(task, "task", task), info, phases[-1].end)  # the teacher's kNN (knn.*)
    trainer = Trainer(task, optimizer, lr_basis(cfg, info.world_size), phases, cfg.train.output_dir, info,
                      loop_cfg, pool_size=len(refs), probe=probe)
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
        key = "train.output_dir" if hasattr(cfg, "train") else "output_dir"  # pretrain / distill, pipeline
        out = getattr(getattr(cfg, "train", cfg), "output_dir", None)
        if out:  # a stage whose schema writes an output folder: checked before any work
            check_writable(out, key)
    except ConfigError as exc:
        exit_on_config_error(exc)
    setup_logging()
    clean = False  # every rank got here together: the final barrier is safe
    done = None
    try:
        rc = run(cfg)
        clean = True
        done = rc
        return rc
    except (LaunchError, CheckpointError) as exc:  # incl. a checkpoint refused as unsafe: the user's input
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        exit_on_config_error(exc)
    except NonFiniteLossError as exc:  # all ranks agree on it (it comes out of the step's all-reduce)
        clean = True
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_NON_FINITE
    except TooMuchBadData as exc:  # decided on the reduced data reports: every rank raises it in the same step
        clean = True
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_DATA
    except UnfinishedError as exc:  # the store stayed unavailable for its whole retry budget: rerun
        print(f"unfinished: {exc} -- {exc.why}; rerun the same command", file=sys.stderr)
        return EXIT_UNFINISHED
    finally:
        end_rank(clean, done)


__all__ = ["phase_steps", "build_schedules", "global_batches", "peak_lrs", "lr_basis", "build_phases", "open_pool",
           "train", "stage_main", "EXIT_NON_FINITE"]
