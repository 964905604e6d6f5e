"""Pretraining config schema (defaults = DINOv2's ``ssl_default_config.yaml`` where it has one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..config import ModelConfig, ParallelConfig, check_choices, check_parallel_config, choices


LastLayer = choices("LastLayer", ("weight_norm", "weight_norm_fixed", "linear"), __name__)


@dataclass
class HeadConfig:
    n_prototypes: int = 65536
    hidden_dim: int = 2048
    bottleneck_dim: int = 256
    nlayers: int = 3
    last_layer: LastLayer = LastLayer.weight_norm
    """The prototype layer: weight_norm (DINOv2: weight norm with a trained gain) | linear (DINOv3: a plain
    linear layer) | weight_norm_fixed (DINO v1: the gain fixed at 1)."""


@dataclass
class WeightSchedule:
    """DINOv3's schedule of a loss weight (``linear_warmup_cosine_decay``): start -> peak over warmup_epochs,
    then half a cosine peak -> end over cosine_epochs, then end."""

    start: float = 1.0
    peak: float = 1.0
    end: float = 1.0
    warmup_epochs: float = 0
    cosine_epochs: float = 0


@dataclass
class DinoConfig:
    loss_weight: float = 1.0
    head: HeadConfig = field(default_factory=HeadConfig)
    koleo_loss_weight: float = 0.1
    local_loss_weight_schedule: Optional[WeightSchedule] = None
    """DINOv3's reweighting of the local-crop DINO terms (``reweight_dino_local_loss``; its Gram stage: 1 -> 0.5
    over one epoch, its high-resolution stage: 0.5). null: weight 1, as DINOv2."""


@dataclass
class IbotConfig:
    loss_weight: float = 1.0
    mask_sample_probability: float = 0.5
    """Probability that a global crop is masked at all."""
    mask_ratio_min_max: list[float] = field(default_factory=lambda: [0.1, 0.5])
    separate_head: bool = False
    head: HeadConfig = field(default_factory=HeadConfig)


Centering = choices("Centering", ("centering", "sinkhorn_knopp"), __name__)
Device = choices("Device", ("auto", "cpu", "cuda"), __name__)
Blur = choices("Blur", ("released", "paper"), __name__)
LrSchedule = choices("LrSchedule", ("cosine", "constant", "rise"), __name__)
ResizeMode = choices("ResizeMode", ("bicubic", "bilinear", "nearest", "area"), __name__)


@dataclass
class TeacherConfig:
    centering: Centering = Centering.centering
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
    clip_per_module: bool = True
    """Clip the backbone and each head on its own norm (both official codes); false: one norm per student."""
    decay_tokens: bool = True
    """Weight-decay the cls / position / register / storage / mask tokens and the prototype gain, as both
    official codes do; false exempts them (like norms and biases)."""
    adamw_beta1: float = 0.9
    adamw_beta2: float = 0.999
    backbone_warmup_steps: int = 0
    """Continued pretraining: after ``train.head_warmup_steps`` the backbone's lr ramps linearly from 0 to the
    schedule's over these steps, while the heads keep the schedule's lr (0: the backbone follows the schedule)."""
    lr_schedule: LrSchedule = LrSchedule.cosine
    """cosine (DINOv2: warm-up, then cosine to min_lr) | constant (DINOv3: warm-up, then the peak lr to the end,
    so training can be extended or stopped at any point; later phases keep their own cosine) | rise (DINOv3's
    high-resolution adaptation: half a cosine from 0 up to the peak lr over warmup_epochs, then the peak)."""


@dataclass
class CropsConfig:
    global_crops_scale: list[float] = field(default_factory=lambda: [0.32, 1.0])
    local_crops_number: int = 8
    local_crops_scale: list[float] = field(default_factory=lambda: [0.05, 0.32])
    blur: Blur = Blur.released
    """released (the official code: global crop 1 never blurred, crop 2 with p=0.9, locals 0.5) | paper (the
    papers' wording: crop 1 always, crop 2 with p=0.1)"""
    horizontal_flip: bool = True
    """false: no flips (DINOv3's ViT-7B recipe)."""


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
    device: Device = Device.auto
    """auto (CUDA when available) | cpu | cuda (each rank takes the GPU of its local rank)"""
    stop_after: Optional[int] = None
    """Leave after this many steps of this invocation (with a checkpoint); rerunning resumes."""
    progress: bool = True
    head_warmup_steps: int = 0
    """Continued pretraining (needs model.pretrained): the first N steps train the new DINO/iBOT heads against
    the frozen released backbone (student = teacher backbone, no backbone updates, the EMA moves the teacher's
    heads only); then the backbone trains too, its lr ramped over ``optim.backbone_warmup_steps``."""
    accumulate: int = 1
    """Gradient accumulation: micro-batches of ``batch_size_per_gpu`` per optimizer step (global batch = per-GPU
    batch x GPUs x accumulate; the lr follows it). Exact for the DINO/iBOT losses and their centring; KoLeo stays
    a per-micro-batch statistic (docs/training.md)."""


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
    resize_mode: ResizeMode = ResizeMode.bicubic
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

    check_choices(cfg)  # enum fields (teacher.centering, model.attn_backend, ...) of a config built in Python
    total = sum(p.fraction for p in cfg.phases)
    if not cfg.phases or abs(total - 1.0) > 1e-6:
        raise ConfigError(f"phases: fractions must sum to 1, got {total}")
    if not cfg.data.paths:
        raise ConfigError("data.paths: give at least one image folder, file list or shard path")
    check_parallel_config(cfg.parallel)
    ratio = list(cfg.ibot.mask_ratio_min_max)
    if len(ratio) != 2 or not 0 <= ratio[0] <= ratio[1] < 1:
        raise ConfigError(f"ibot.mask_ratio_min_max: need [min, max] with 0 <= min <= max < 1, got {ratio}")
    check_ranges(cfg)
    validate_continue(cfg)
    validate_sizes(cfg)
    if getattr(cfg, "gram", None) is not None:
        validate_gram(cfg.gram)
    if getattr(cfg, "model", None) is not None:  # distillation: each student's model (distill_config.py)
        check_dinov3_keys(cfg.model, "model")
    for i, student in enumerate(getattr(cfg, "students", None) or []):
        check_dinov3_keys(student.model, f"students.{i}.model")


def _need(ok: bool, key: str, msg: str) -> None:
    from ..config import ConfigError

    if not ok:
        raise ConfigError(f"{key}: {msg}")


def check_ranges(cfg: PretrainConfig) -> None:
    """Values the loop would otherwise trip over mid-run (a modulo by zero, an empty schedule, a crop scale the
    augmentation rejects), checked before anything is written. Shared with distillation."""
    t = cfg.train
    for key in ("epochs", "epoch_length", "log_every", "checkpoint_every", "keep_last", "accumulate"):
        _need(getattr(t, key) >= 1, f"train.{key}", f"must be >= 1, got {getattr(t, key)}")
    _need(t.stop_after is None or t.stop_after >= 1, "train.stop_after", f"must be >= 1 or null, got {t.stop_after}")
    _need(cfg.data.num_workers >= 0, "data.num_workers", f"must be >= 0, got {cfg.data.num_workers}")
    for i, ph in enumerate(cfg.phases):
        key = f"phases.{i}"
        _need(ph.fraction > 0, f"{key}.fraction", f"must be > 0, got {ph.fraction}")
        _need(ph.batch_size_per_gpu >= 1, f"{key}.batch_size_per_gpu", f"must be >= 1, got {ph.batch_size_per_gpu}")
        for size in ("global_crops_size", "local_crops_size"):
            _need(getattr(ph, size) >= 1, f"{key}.{size}", f"must be >= 1 px, got {getattr(ph, size)}")
        _need(ph.lr_scale > 0, f"{key}.lr_scale", f"must be > 0, got {ph.lr_scale}")
        _need(0 <= ph.warmup_fraction < 1, f"{key}.warmup_fraction", f"must be in [0, 1), got {ph.warmup_fraction}")
    names = [ph.name for ph in cfg.phases]
    _need(len(set(names)) == len(names), "phases", f"names must be distinct (metrics log them), got {names}")
    c = cfg.crops
    _need(c.local_crops_number >= 0, "crops.local_crops_number", f"must be >= 0, got {c.local_crops_number}")
    for key in ("global_crops_scale", "local_crops_scale"):
        s = list(getattr(c, key))
        _need(len(s) == 2 and 0 < s[0] <= s[1] <= 1, f"crops.{key}", f"need [min, max] with 0 < min <= max <= 1, "
              f"got {s}")
    _need(0 <= cfg.ibot.mask_sample_probability <= 1, "ibot.mask_sample_probability",
          f"a probability in [0, 1], got {cfg.ibot.mask_sample_probability}")
    tc = cfg.teacher
    for key in ("teacher_temp", "warmup_teacher_temp", "student_temp"):
        _need(getattr(tc, key) > 0, f"teacher.{key}", f"a temperature must be > 0, got {getattr(tc, key)}")
    for key in ("momentum_teacher", "final_momentum_teacher", "center_momentum"):
        _need(0 <= getattr(tc, key) <= 1, f"teacher.{key}", f"a momentum in [0, 1], got {getattr(tc, key)}")
    o = cfg.optim
    _need(o.base_lr >= 0, "optim.base_lr", f"must be >= 0, got {o.base_lr}")  # 0: a run that must not move
    for key in ("min_lr", "warmup_epochs", "clip_grad", "freeze_last_layer_epochs"):
        _need(getattr(o, key) >= 0, f"optim.{key}", f"must be >= 0, got {getattr(o, key)}")
    for key in ("adamw_beta1", "adamw_beta2"):
        _need(0 <= getattr(o, key) < 1, f"optim.{key}", f"must be in [0, 1), got {getattr(o, key)}")


def validate_continue(cfg) -> None:
    """Head warm-up and loaded heads (continued pretraining) only where they mean something."""
    from ..config import phase_steps

    t, o = cfg.train, cfg.optim
    _need(t.head_warmup_steps >= 0, "train.head_warmup_steps", f"must be >= 0, got {t.head_warmup_steps}")
    _need(o.backbone_warmup_steps >= 0, "optim.backbone_warmup_steps", f"must be >= 0, got {o.backbone_warmup_steps}")
    students = getattr(cfg, "students", None)
    if students is not None:  # distillation: its teacher is frozen throughout and its students start fresh
        _need(t.head_warmup_steps == 0, "train.head_warmup_steps", "pretraining only (continued pretraining from "
              "model.pretrained); distillation has no backbone to keep")
        _need(o.backbone_warmup_steps == 0, "optim.backbone_warmup_steps", "pretraining only")
        for i, s in enumerate(students):
            _need(s.model.pretrained_heads is None, f"students.{i}.model.pretrained_heads",
                  "pretraining only (distillation's heads come from teacher_model.path and student_heads)")
        return
    m = cfg.model
    if t.head_warmup_steps:
        _need(bool(m.pretrained), "train.head_warmup_steps", "a head warm-up keeps a released backbone frozen: set "
              "model.pretrained (a random backbone would give the heads nothing to learn from)")
        total = phase_steps(cfg)[-1][1]
        _need(t.head_warmup_steps < total, "train.head_warmup_steps",
              f"{t.head_warmup_steps} leaves no step for the backbone (the run has {total} steps)")
    _need(not m.pretrained_heads or bool(m.pretrained), "model.pretrained_heads",
          "heads are loaded to go with a pretrained backbone: set model.pretrained too")
    _need(m.pretrained_heads != "", "model.pretrained_heads", "give auto, a path or null")


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

    for key in ("first_step", "refresh_every", "warmup_steps"):
        if getattr(g, key) < 0:
            raise ConfigError(f"gram.{key}: must be >= 0, got {getattr(g, key)}")
    if g.max_refreshes is not None and g.max_refreshes < 0:
        raise ConfigError(f"gram.max_refreshes: must be >= 0 or null, got {g.max_refreshes}")


__all__ = ["PretrainConfig", "PhaseConfig", "CropSizeConfig", "GramConfig", "validate", "validate_gram", "validate_continue"]
