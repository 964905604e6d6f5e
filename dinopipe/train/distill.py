"""dinopipe distill --config configs/distill/X.yaml [key=value ...]: train smaller students to copy a
pretrained teacher (teacher_model.path); writes the run folder train.output_dir, one export per student.

Same loop, phases, checkpoints, resume and preemption handling as pretraining. Every config key, its
default and what it does: dinopipe config --kind distill. Exit codes: 0 done, 2 a mistake in the config
or the input (nothing written), 3 the loss became NaN/inf, 124 preempted (rerun to resume), 1 a bug.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from ..config import ConfigError
from ..hub import CheckpointError, check_backbone_file, has_heads
from ..models import list_models, model_defaults
from ..ssl.distill import DistillTask
from ..ssl.distill_config import DistillConfig, resolve_mode
from ..ssl.distill_config import validate as validate_fields
from .builders import stage_main
from .run import run_training


def validate(cfg: DistillConfig) -> None:
    """Field checks, then the ones that need the teacher's files (its heads, its patch size: metadata, no
    model is built), so that every mistake exits 2 before a process group or a run directory exists."""
    validate_fields(cfg)
    path = cfg.teacher_model.path
    try:
        t_patch = int(check_backbone_file(path, num_heads=cfg.teacher_model.num_heads)["patch_size"])
    except (CheckpointError, OSError) as exc:
        raise ConfigError(f"teacher_model.path: {exc}") from None
    resolve_mode(cfg, has_heads(path))
    patches = {t_patch}
    for i, s in enumerate(cfg.students):
        if s.model.pretrained:  # students start from random init (DINOv2 §5); a set value must not be ignored
            raise ConfigError(f"students[{i}].model.pretrained: students are trained from random init; "
                              f"'{s.model.pretrained}' would not be read. Remove the key")
        if s.model.name not in list_models():
            raise ConfigError(f"students[{i}].model.name: unknown model '{s.model.name}' "
                              f"(choose from {', '.join(list_models())})")
        patches.add(int({**model_defaults(s.model.name), **s.model.create_kwargs()}["patch_size"]))
    # Crops must tile into every student's and the teacher's patches.
    for ph in cfg.phases:
        for size in (ph.global_crops_size, ph.local_crops_size):
            bad = sorted(p for p in patches if size % p)
            if bad and (size == ph.global_crops_size or cfg.crops.local_crops_number):
                raise ConfigError(f"phases[{ph.name}]: crop size {size} is not a multiple of patch size(s) {bad}")


def run(cfg: DistillConfig) -> int:
    return run_training(cfg, DistillTask)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return stage_main("distill", DistillConfig, validate, run, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
