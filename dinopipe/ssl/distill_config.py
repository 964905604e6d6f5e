"""Distillation config schema. Sections shared with pretraining (phases, crops, optim, teacher temperatures
and EMA momentum, data, train, parallel) mean the same thing; see dinopipe/ssl/config.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..config import ConfigError, ModelConfig
from ..train.parallel import ParallelConfig
from .config import CropsConfig, DataConfig, DinoConfig, IbotConfig, OptimConfig, PhaseConfig, TeacherConfig, TrainConfig


@dataclass
class TeacherModelConfig:
    path: str = "???"
    """A dinopipe pretraining run (heads available -> DINOv2's recipe), or anything dinopipe.load accepts
    (a bare backbone such as released DINOv2 weights -> feature distillation)."""
    num_heads: Optional[int] = None
    """Only for foreign files whose heads are not 64-dimensional."""


@dataclass
class StudentConfig:
    name: str = "student"
    """Folder name of this student's export (RUN/export/NAME)."""
    model: ModelConfig = field(default_factory=lambda: ModelConfig(name="vit_s14", drop_path_rate=0.0))
    lr_scale: float = 1.0
    """This student's lr relative to the schedule (each student has its own optimizer)."""


@dataclass
class FeatureLossConfig:
    loss: str = "cosine"
    """cosine | smooth_l1 (on L2-normalised features)."""
    cls_weight: float = 1.0
    patch_weight: float = 1.0


@dataclass
class DistillConfig:
    mode: str = "auto"
    """auto (ssl when the teacher run has heads, else feature) | ssl | feature."""
    teacher_model: TeacherModelConfig = field(default_factory=TeacherModelConfig)
    student_heads: str = "new"
    """ssl mode: ``new`` (DINOv2: fresh student heads) | ``teacher`` (each student starts from a trainable copy
    of the teacher's heads, behind a new linear map from the student's width to the teacher's when they differ,
    so the prototypes the targets are built on are there from step 0)."""
    students: list[StudentConfig] = field(default_factory=lambda: [StudentConfig()])
    dino: DinoConfig = field(default_factory=lambda: DinoConfig(koleo_loss_weight=0.0))
    ibot: IbotConfig = field(default_factory=lambda: IbotConfig(mask_sample_probability=0.0))
    """ssl mode: iBOT on all patch tokens of both global crops; students see unmasked crops by default."""
    feature: FeatureLossConfig = field(default_factory=FeatureLossConfig)
    teacher: TeacherConfig = field(default_factory=lambda: TeacherConfig(momentum_teacher=0.994))
    """Temperatures of the teacher's targets; ``momentum_teacher`` is the students' EMA momentum."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(layerwise_decay=1.0, warmup_epochs=5))
    crops: CropsConfig = field(default_factory=CropsConfig)
    phases: list[PhaseConfig] = field(default_factory=lambda: [PhaseConfig()])
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(output_dir="runs/distill"))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


def validate(cfg: DistillConfig) -> None:
    from .config import validate as validate_common

    validate_common(cfg)  # phases, centering, data paths, mask ratios
    if cfg.mode not in ("auto", "ssl", "feature"):
        raise ConfigError(f"mode: expected auto | ssl | feature, got '{cfg.mode}'")
    if cfg.student_heads not in ("new", "teacher"):
        raise ConfigError(f"student_heads: expected new | teacher, got '{cfg.student_heads}'")
    if cfg.feature.loss not in ("cosine", "smooth_l1"):
        raise ConfigError(f"feature.loss: expected cosine | smooth_l1, got '{cfg.feature.loss}'")
    names = [s.name for s in cfg.students]
    if not names or len(set(names)) != len(names):
        raise ConfigError(f"students: need at least one, with distinct names (got {names})")


__all__ = ["DistillConfig", "StudentConfig", "TeacherModelConfig", "FeatureLossConfig", "validate"]
