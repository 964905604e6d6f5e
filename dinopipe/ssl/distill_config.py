"""Distillation config schema. Sections shared with pretraining (phases, crops, optim, teacher temperatures
and EMA momentum, data, train, parallel) mean the same thing; see dinopipe/ssl/config.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..config import ConfigError, ModelConfig, ParallelConfig, PatchEmbedExpand, choices
from .config import CropsConfig, DataConfig, DinoConfig, IbotConfig, OptimConfig, PhaseConfig, TeacherConfig, TrainConfig


@dataclass
class TeacherModelConfig:
    path: str = "???"
    """A dinopipe pretraining run (heads available -> DINOv2's recipe), or anything dinopipe.load accepts
    (a bare backbone such as released DINOv2 weights -> feature distillation)."""
    num_heads: Optional[int] = None
    """Only for foreign files whose heads are not 64-dimensional."""
    expand_patch_embed: Optional[PatchEmbedExpand] = None
    """An RGB teacher for data.channels other than 3: expand its patch embedding as continued pretraining does
    (mean | rgb_map, docs/multichannel.md). null: such a teacher is refused (exit 2)."""
    rgb_channels: Optional[list[int]] = None
    """rgb_map: the input channels (0-based) holding red, green and blue."""


@dataclass
class StudentConfig:
    name: str = "student"
    """Folder name of this student's export (RUN/export/NAME)."""
    model: ModelConfig = field(default_factory=lambda: ModelConfig(name="vit_s14", drop_path_rate=0.0))
    """``model.name``: a registry ViT, or any timm model as ``timm:NAME`` (e.g. timm:convnext_tiny,
    timm:resnet50; random init, feature mode only; of the other model keys only img_size and drop_path_rate
    apply)."""
    lr_scale: float = 1.0
    """This student's lr relative to the schedule (each student has its own optimizer)."""


DistillMode = choices("DistillMode", ("auto", "ssl", "feature"), __name__)
FeatureLoss = choices("FeatureLoss", ("cosine", "smooth_l1"), __name__)
StudentHeads = choices("StudentHeads", ("new", "teacher"), __name__)


@dataclass
class FeatureLossConfig:
    loss: FeatureLoss = FeatureLoss.cosine
    """cosine | smooth_l1 (on L2-normalised features)."""
    cls_weight: float = 1.0
    """feature mode: weight of the loss on the CLS token."""
    patch_weight: float = 1.0
    """feature mode: weight of the loss on the patch tokens."""


@dataclass
class DistillConfig:
    mode: DistillMode = DistillMode.auto
    """auto (ssl when the teacher run has heads and every student is a ViT, else feature) | ssl | feature."""
    teacher_model: TeacherModelConfig = field(default_factory=TeacherModelConfig)
    student_heads: StudentHeads = StudentHeads.new
    """ssl mode: ``new`` (DINOv2: fresh student heads) | ``teacher`` (each student starts from a trainable copy
    of the teacher's heads, behind a new linear map from the student's width to the teacher's when they differ,
    so the prototypes the targets are built on are there from step 0)."""
    students: list[StudentConfig] = field(default_factory=lambda: [StudentConfig()])
    """The students trained together against one teacher forward (a list of entries with the keys below)."""
    dino: DinoConfig = field(default_factory=lambda: DinoConfig(koleo_loss_weight=0.0))
    ibot: IbotConfig = field(default_factory=lambda: IbotConfig(mask_sample_probability=0.0))
    """ssl mode: iBOT on all patch tokens of both global crops; students see unmasked crops by default."""
    feature: FeatureLossConfig = field(default_factory=FeatureLossConfig)
    teacher: TeacherConfig = field(default_factory=lambda: TeacherConfig(momentum_teacher=0.994))
    """Temperatures of the teacher's targets; ``momentum_teacher`` is the students' EMA momentum."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(layerwise_decay=1.0, warmup_epochs=5))
    crops: CropsConfig = field(default_factory=CropsConfig)
    phases: list[PhaseConfig] = field(default_factory=lambda: [PhaseConfig()])
    """Resolution phases in order (a list of entries with the keys below); fractions sum to 1."""
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(output_dir="runs/distill"))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


def validate(cfg: DistillConfig) -> None:
    from .config_checks import validate as validate_common

    validate_common(cfg)  # enum fields (mode, feature.loss, ...), phases, data paths, mask ratios
    names = [s.name for s in cfg.students]
    if not names or len(set(names)) != len(names):
        raise ConfigError(f"students: need at least one, with distinct names (got {names})")
    for i, s in enumerate(cfg.students):
        if not s.lr_scale > 0:
            raise ConfigError(f"students.{i}.lr_scale: must be > 0, got {s.lr_scale}")
    f = cfg.feature
    if f.cls_weight < 0 or f.patch_weight < 0 or f.cls_weight + f.patch_weight == 0:
        raise ConfigError(f"feature.cls_weight / feature.patch_weight: need >= 0 and not both 0, got "
                          f"{f.cls_weight} / {f.patch_weight}")


def check_teacher_channels(cfg: DistillConfig, teacher_chans: int) -> None:
    """The teacher takes data.channels, or is an RGB teacher that teacher_model.expand_patch_embed expands;
    raises ConfigError naming the key otherwise. Called before the run (from the teacher's recorded
    architecture) and again by the task (from what it loaded)."""
    want, tm = cfg.data.channels, cfg.teacher_model
    if teacher_chans == want:
        return
    if teacher_chans != 3:
        raise ConfigError(f"teacher_model.path: {tm.path} takes {teacher_chans} channels but data.channels is "
                          f"{want}; only an RGB (3-channel) teacher can be expanded")
    if tm.expand_patch_embed is None:
        raise ConfigError(f"teacher_model.expand_patch_embed: {tm.path} is an RGB teacher and data.channels is "
                          f"{want}; set teacher_model.expand_patch_embed=mean (or rgb_map with "
                          f"teacher_model.rgb_channels) to expand its patch embedding, or continue pretraining it "
                          f"on the {want}-channel data first (docs/multichannel.md)")
    if tm.expand_patch_embed == "rgb_map":
        rgb = tm.rgb_channels or []
        if len(rgb) != 3 or len(set(rgb)) != 3 or not all(0 <= c < want for c in rgb):
            raise ConfigError(f"teacher_model.rgb_channels: rgb_map needs 3 distinct channel indices in "
                              f"[0, {want}), got {tm.rgb_channels}")


def resolve_mode(cfg: DistillConfig, has_heads: bool) -> str:
    """The distillation mode for a teacher with or without exported DINO heads (``auto`` picks); raises
    ConfigError, naming the key, for a mode or loss term that teacher cannot serve. Called before the run
    starts (from the teacher's files) and again by the task (from what it loaded)."""
    other = [(i, s.model.name) for i, s in enumerate(cfg.students) if str(s.model.name).startswith("timm:")]
    mode = cfg.mode if cfg.mode != "auto" else ("ssl" if has_heads and not other else "feature")
    if mode == "ssl" and other:
        i, name = other[0]
        raise ConfigError(f"students[{i}].model.name: '{name}' is not a ViT; students of other architectures "
                          f"distil features (their pooled and dense features through learned projections), not "
                          f"the DINO/iBOT heads of mode=ssl: set mode=feature (or auto), or use a registry ViT")
    if mode == "ssl" and not has_heads:
        raise ConfigError(f"mode: mode=ssl needs the teacher's heads, but {cfg.teacher_model.path} has none "
                          f"(a bare backbone); use mode=feature")
    if mode == "feature" and cfg.dino.koleo_loss_weight:
        raise ConfigError("dino.koleo_loss_weight: KoLeo is a term of the ssl-mode losses; this run distils "
                          "features (a teacher without heads, or mode=feature), so set it to 0")
    return mode


__all__ = ["DistillConfig", "check_teacher_channels",
           "resolve_mode", "StudentConfig", "TeacherModelConfig", "FeatureLossConfig", "validate"]
