"""Pretraining config schema (defaults = DINOv2's ``ssl_default_config.yaml`` where it has one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..config import ModelConfig, ParallelConfig, check_parallel_config


@dataclass
class HeadConfig:
    n_prototypes: int = 65536
    hidden_dim: int = 2048
    bottleneck_dim: int = 256
    nlayers: int = 3


@dataclass
class DinoConfig:
    loss_weight: float = 1.0
    head: HeadConfig = field(default_factory=HeadConfig)
    koleo_loss_weight: float = 0.1


@dataclass
class IbotConfig:
    loss_weight: float = 1.0
    mask_sample_probability: float = 0.5
    """Probability that a global crop is masked at all."""
    mask_ratio_min_max: list[float] = field(default_factory=lambda: [0.1, 0.5])
    separate_head: bool = False
    head: HeadConfig = field(default_factory=HeadConfig)


@dataclass
class TeacherConfig:
    centering: str = "centering"
    """centering (EMA centre) | sinkhorn_knopp"""
    momentum_teacher: float = 0.992
    final_momentum_teacher: float = 1.0
    warmup_teacher_temp: float = 0.04
    teacher_temp: float = 0.07
    warmup_teacher_temp_epochs: float = 30
    student_temp: float = 0.1
    center_momentum: float = 0.9


@dataclass
class OptimConfig:
    base_lr: float = 0.004
    """lr = base_lr * sqrt(global batch / 1024) (DINOv2's sqrt_wrt_1024 rule)."""
    scale_lr_with_batch: bool = True
    min_lr: float = 1.0e-6
    warmup_epochs: float = 10
    weight_decay: float = 0.04
    weight_decay_end: float = 0.4
    layerwise_decay: float = 0.9
    patch_embed_lr_mult: float = 0.2
    freeze_last_layer_epochs: float = 1
    clip_grad: float = 3.0
    adamw_beta1: float = 0.9
    adamw_beta2: float = 0.999
    lr_schedule: str = "cosine"
    """cosine (DINOv2: warm-up, then cosine to min_lr) | constant (DINOv3: warm-up, then the peak lr to the end,
    so training can be extended or stopped at any point; later phases keep their own cosine)."""


@dataclass
class CropsConfig:
    global_crops_scale: list[float] = field(default_factory=lambda: [0.32, 1.0])
    local_crops_number: int = 8
    local_crops_scale: list[float] = field(default_factory=lambda: [0.05, 0.32])


@dataclass
class CropSizeConfig:
    """One (global, local, Gram-teacher) crop-size triple of a multi-size phase and its probability."""

    global_crops_size: int = 224
    local_crops_size: int = 98
    gram_crops_size: Optional[int] = None
    """Size at which the Gram teacher sees the global crops (same boxes); null = the global size."""
    probability: float = 1.0


@dataclass
class PhaseConfig:
    """One resolution phase. Phases run in order; their fractions of ``train.epochs`` must sum to 1."""

    name: str = "base"
    fraction: float = 1.0
    global_crops_size: int = 224
    local_crops_size: int = 98
    batch_size_per_gpu: int = 64
    lr_scale: float = 1.0
    """Peak lr of this phase relative to the base lr (later phases: a lower, compressed cosine)."""
    warmup_fraction: float = 0.0
    """Warm-up of a later phase, as a fraction of its own steps (the first phase uses optim.warmup_epochs)."""
    gram_crops_size: Optional[int] = None
    """With gram.enabled: the Gram teacher sees the global crops' boxes at this size (DINOv3 uses 2x the global
    size), its patch grid resampled to the student's; null = the student's global crops."""
    sizes: list[CropSizeConfig] = field(default_factory=list)
    """High-resolution adaptation (DINOv3 §5.1): each batch draws one (global, local, gram) size triple with
    these probabilities, fixed by (seed, data position) so ranks agree and resume is exact. When set, the
    phase's global/local/gram sizes above are not used."""


@dataclass
class DataConfig:
    paths: list[str] = field(default_factory=list)
    """Image folders, file lists or webdataset shard paths / globs (e.g. the curation output's shards/)."""
    num_workers: int = 2
    persistent_workers: bool = False
    """Keep each phase's DataLoader workers between epochs (they still stop at a phase switch)."""


@dataclass
class TrainConfig:
    output_dir: str = "runs/pretrain"
    epochs: int = 100
    epoch_length: int = 1250
    """Steps per 'epoch' (DINOv2's OFFICIAL_EPOCH_LENGTH): schedules are written in these epochs."""
    seed: int = 0
    log_every: int = 10
    checkpoint_every: int = 500
    keep_last: int = 3
    device: str = "auto"
    """auto | cpu | cuda"""
    stop_after: Optional[int] = None
    """Leave after this many steps of this invocation (with a checkpoint); rerunning resumes."""
    progress: bool = True


@dataclass
class GramConfig:
    """Gram anchoring (DINOv3 §4): MSE between the per-image Gram matrices of L2-normalised patch tokens of the
    student's global crops and of a frozen Gram teacher, a copy of the EMA teacher taken at ``first_step`` and
    refreshed every ``refresh_every`` steps at most ``max_refreshes`` times (steps count optimizer steps; the
    copy happens before that step's forward)."""

    enabled: bool = False
    loss_weight: float = 1.0
    """Weight after the warm-up (DINOv3's ViT-7B: 2.0 when anchoring, 1.5 in high-res adaptation)."""
    loss_weight_start: Optional[float] = None
    """Weight at ``first_step``, rising linearly to ``loss_weight`` over ``warmup_steps`` (null = loss_weight)."""
    warmup_steps: int = 0
    first_step: int = 0
    """The Gram teacher is first copied from the EMA teacher before this step; no Gram loss before it. With
    model.pretrained and 0 the anchor is the released backbone itself."""
    refresh_every: int = 0
    """Steps between refreshes from the EMA teacher after the first copy (0 = never)."""
    max_refreshes: Optional[int] = None
    """Refreshes after the first copy (null = no limit)."""
    resize_mode: str = "bicubic"
    """How a higher-resolution Gram teacher's patch grid is resampled to the student's (torch interpolate)."""
    resize_antialias: bool = False
    remove_neg: bool = False
    """Clip negative similarities to 0 in both Gram matrices (an option of DINOv3's loss; off in its recipes)."""


@dataclass
class PretrainConfig:
    model: ModelConfig = field(default_factory=lambda: ModelConfig(name="vit_l14", drop_path_rate=0.4,
                                                                   drop_path_uniform=True))
    dino: DinoConfig = field(default_factory=DinoConfig)
    ibot: IbotConfig = field(default_factory=IbotConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    crops: CropsConfig = field(default_factory=CropsConfig)
    phases: list[PhaseConfig] = field(default_factory=lambda: [PhaseConfig()])
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    gram: GramConfig = field(default_factory=GramConfig)


def validate(cfg: PretrainConfig) -> None:
    """Cross-field checks the type system cannot do; raise ConfigError naming the key."""
    from ..config import ConfigError

    total = sum(p.fraction for p in cfg.phases)
    if not cfg.phases or abs(total - 1.0) > 1e-6:
        raise ConfigError(f"phases: fractions must sum to 1, got {total}")
    if cfg.teacher.centering not in ("centering", "sinkhorn_knopp"):
        raise ConfigError(f"teacher.centering: expected 'centering' or 'sinkhorn_knopp', got '{cfg.teacher.centering}'")
    if not cfg.data.paths:
        raise ConfigError("data.paths: give at least one image folder, file list or shard path")
    check_parallel_config(cfg.parallel)
    lo, hi = cfg.ibot.mask_ratio_min_max
    if not 0 <= lo <= hi < 1:
        raise ConfigError(f"ibot.mask_ratio_min_max: need 0 <= min <= max < 1, got {[lo, hi]}")
    if cfg.optim.lr_schedule not in ("cosine", "constant"):
        raise ConfigError(f"optim.lr_schedule: expected 'cosine' or 'constant', got '{cfg.optim.lr_schedule}'")
    validate_sizes(cfg)
    if getattr(cfg, "gram", None) is not None:
        validate_gram(cfg.gram)
    if getattr(cfg, "model", None) is not None:  # distillation: each student's model (distill_config.py)
        check_dinov3_keys(cfg.model, "model")
    for i, student in enumerate(getattr(cfg, "students", None) or []):
        check_dinov3_keys(student.model, f"students.{i}.model")


def check_dinov3_keys(model, where: str) -> None:
    """RoPE / untied-norm keys exist only on DINOv3 backbones (registry names ``*_dinov3*``); a DINOv2 model
    given one would fail deep in its constructor, so say so here, naming the key."""
    from ..config import DINOV3_KEYS, ConfigError

    if model.pretrained or "_dinov3" in model.name:
        return
    for key in DINOV3_KEYS:
        if getattr(model, key) is not None:
            raise ConfigError(f"{where}.{key}: only DINOv3 backbones (vit_*_dinov3) have it; '{model.name}' is a "
                              "DINOv2 model (learned position embedding, no RoPE)")


def validate_sizes(cfg) -> None:
    from ..config import ConfigError

    for i, ph in enumerate(cfg.phases):
        if ph.sizes and abs(sum(s.probability for s in ph.sizes) - 1.0) > 1e-6:
            raise ConfigError(f"phases.{i}.sizes: probabilities must sum to 1, got "
                              f"{[s.probability for s in ph.sizes]}")
        if any(s.probability < 0 for s in ph.sizes):
            raise ConfigError(f"phases.{i}.sizes: probabilities must be >= 0")


def validate_gram(g: GramConfig) -> None:
    from ..config import ConfigError

    if g.resize_mode not in ("bicubic", "bilinear", "nearest", "area"):
        raise ConfigError(f"gram.resize_mode: expected bicubic | bilinear | nearest | area, got '{g.resize_mode}'")
    for key in ("first_step", "refresh_every", "warmup_steps"):
        if getattr(g, key) < 0:
            raise ConfigError(f"gram.{key}: must be >= 0, got {getattr(g, key)}")
    if g.max_refreshes is not None and g.max_refreshes < 0:
        raise ConfigError(f"gram.max_refreshes: must be >= 0 or null, got {g.max_refreshes}")


__all__ = ["PretrainConfig", "PhaseConfig", "CropSizeConfig", "GramConfig", "validate", "validate_gram"]
