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
from ..models import create_model, is_timm_name, list_models, model_defaults, timm_name_error
from ..ssl.distill import DistillTask
from ..ssl.distill_config import DistillConfig, check_teacher_channels, resolve_mode
from ..ssl.distill_config import validate as validate_fields
from .builders import stage_main
from .run import run_training


def validate(cfg: DistillConfig) -> None:
    """Field checks, then the ones that need the teacher's files (its heads, its patch size: metadata, no
    model is built), so that every mistake exits 2 before a process group or a run directory exists."""
    validate_fields(cfg)
    path = cfg.teacher_model.path
    try:
        arch = check_backbone_file(path, num_heads=cfg.teacher_model.num_heads)
    except (CheckpointError, OSError) as exc:
        raise ConfigError(f"teacher_model.path: {exc}") from None
    check_teacher_channels(cfg, int(arch.get("in_chans", 3)))
    check_students(cfg, int(arch["patch_size"]))
    resolve_mode(cfg, has_heads(path))


# ModelConfig keys a timm student cannot honour (left at their null defaults, or refused).
_VIT_ONLY_KEYS = ("patch_size", "num_register_tokens", "ffn", "num_heads", "embed_dim", "depth", "pretrained",
                  "rope_rescale", "rope_shift", "rope_jitter", "untie_cls_and_patch_norms",
                  "untie_global_and_local_cls_norm")


def _timm_stride(name: str) -> int:
    """A timm model's total stride, read from a build on ``meta`` (no memory, no weights)."""
    import torch

    with torch.device("meta"):
        return int(create_model(name).patch_size)


def check_students(cfg: DistillConfig, t_patch: Optional[int] = None) -> None:
    """Each student's name (a registry ViT or ``timm:NAME``), and crops that fit every model: a multiple of
    each ViT's (and the teacher's) patch size, at least one output token of each CNN (its total stride).
    Also run by ``dinopipe pipeline`` before the teacher exists (``t_patch`` None)."""
    patches = {t_patch} if t_patch else set()
    strides: dict[int, str] = {}
    for i, s in enumerate(cfg.students):
        if s.model.pretrained:  # students start from random init (DINOv2 §5); a set value must not be ignored
            raise ConfigError(f"students[{i}].model.pretrained: students are trained from random init; "
                              f"'{s.model.pretrained}' would not be read. Remove the key")
        if is_timm_name(s.model.name):
            err = timm_name_error(s.model.name)
            if err:
                raise ConfigError(f"students[{i}].model.name: {err}")
            vit_only = [k for k in _VIT_ONLY_KEYS if getattr(s.model, k) is not None]
            if vit_only:
                raise ConfigError(f"students[{i}].model.{vit_only[0]}: a ViT setting, but {s.model.name} is a timm "
                                  f"model (random init; of the model keys only img_size and drop_path_rate apply)")
            strides[_timm_stride(s.model.name)] = s.model.name
            continue
        if s.model.name not in list_models():
            raise ConfigError(f"students[{i}].model.name: unknown model '{s.model.name}' (choose from "
                              f"{', '.join(list_models())}, or any timm model as timm:NAME)")
        patches.add(int({**model_defaults(s.model.name), **s.model.create_kwargs()}["patch_size"]))
    for ph in cfg.phases:
        for size in (ph.global_crops_size, ph.local_crops_size):
            if size != ph.global_crops_size and not cfg.crops.local_crops_number:
                continue  # no local crops
            bad = sorted(p for p in patches if size % p)
            if bad:  # crops must tile into every ViT student's and the teacher's patches
                raise ConfigError(f"phases[{ph.name}]: crop size {size} is not a multiple of patch size(s) {bad}")
            small = sorted((st, n) for st, n in strides.items() if size < st)
            if small:
                raise ConfigError(f"phases[{ph.name}]: crop size {size} is below the total stride {small[0][0]} of "
                                  f"student {small[0][1]} (no output token); use crops >= {small[-1][0]} px "
                                  f"(or crops.local_crops_number=0)")


def run(cfg: DistillConfig) -> int:
    return run_training(cfg, DistillTask)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return stage_main("distill", DistillConfig, validate, run, argv, __doc__)


if __name__ == "__main__":
    sys.exit(main())
