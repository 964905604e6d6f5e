"""Pretraining config schema (defaults = DINOv2's ``ssl_default_config.yaml`` where it has one). The checks
(``validate`` and its parts) are in ``config_checks.py``, which imports this schema (for annotations only); this
module imports nothing of it, so the two form no circle."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..config import ModelConfig, ParallelConfig, choices


LastLayer = choices("LastLayer", ("weight_norm", "weight_norm_fixed", "linear"), __name__)


@dataclass
class HeadConfig:
    n_prototypes: int = 65536
    """Prototypes (output dimension) of the head: the classes the DINO/iBOT targets are spread over."""
    hidden_dim: int = 2048
    """Width of the head's hidden MLP layers."""
    bottleneck_dim: int = 256
    """Width of the L2-normalised bottleneck before the prototype layer."""
    nlayers: int = 3
    """MLP layers before the bottleneck (1 = a single linear layer)."""
    last_layer: LastLayer = LastLayer.weight_norm
    """The prototype layer: weight_norm (DINOv2: weight norm with a trained gain) | linear (DINOv3: a plain
    linear layer) | weight_norm_fixed (DINO v1: the gain fixed at 1)."""


@dataclass
class WeightSchedule:
    """DINOv3's schedule of a loss weight (``linear_warmup_cosine_decay``): start -> peak over warmup_epochs,
    then half a cosine peak -> end over cosine_epochs, then end."""

    start: float = 1.0
    """Weight at step 0."""
    peak: float = 1.0
    """Weight at the end of the warm-up."""
    end: float = 1.0
    """Weight after the cosine (kept to the end of the run)."""
    warmup_epochs: float = 0
    """Epochs of the linear rise from start to peak."""
    cosine_epochs: float = 0
    """Epochs of the half cosine from peak to end (0: jump to end after the warm-up)."""


@dataclass
class DinoConfig:
    loss_weight: float = 1.0
    """Weight of the DINO loss (CLS token, global and local crops) in the total loss; 0 turns it off."""
    head: HeadConfig = field(default_factory=HeadConfig)
    koleo_loss_weight: float = 0.1
    """Weight of the KoLeo regulariser that spreads the student's CLS embeddings within a batch; 0 turns it off."""
    koleo_distributed: bool = False
    """DINOv3's ``koleo_loss_distributed``: each rank's CLS features find their nearest neighbour among the
    global batch (gathered across ranks) instead of the rank's own batch; its high-resolution stage uses it."""
    koleo_group_size: Optional[int] = None
    """With koleo_distributed: neighbours are searched within consecutive groups of this many images of the
    global batch (a multiple of the per-GPU batch; DINOv3's high-res stage: 16); null: the whole global batch."""
    koleo_topk: int = 1
    """With koleo_distributed: the loss averages over this many nearest neighbours (DINOv3: 1)."""
    local_loss_weight_schedule: Optional[WeightSchedule] = None
    """DINOv3's reweighting of the local-crop DINO terms (``reweight_dino_local_loss``; its Gram stage: 1 -> 0.5
    over one epoch, its high-resolution stage: 0.5). null: weight 1, as DINOv2."""


@dataclass
class IbotConfig:
    loss_weight: float = 1.0
    """Weight of the iBOT loss (masked patch tokens of the global crops); 0 turns it off."""
    mask_sample_probability: float = 0.5
    """Probability that a global crop is masked at all."""
    mask_ratio_min_max: list[float] = field(default_factory=lambda: [0.1, 0.5])
    """Range of the fraction of patches masked in a masked crop (block masking; ratios spread over the batch)."""
    separate_head: bool = False
    """true: iBOT gets its own head (ibot.head); false: it shares the DINO head, as DINOv2's default."""
    head: HeadConfig = field(default_factory=HeadConfig)


Centering = choices("Centering", ("centering", "sinkhorn_knopp"), __name__)
Device = choices("Device", ("auto", "cpu", "cuda"), __name__)
Blur = choices("Blur", ("released", "paper"), __name__)
ScheduleShape = choices("ScheduleShape", ("dinov2", "dinov3"), __name__)
Reader = choices("Reader", ("rgb", "array"), __name__)
AugmentOn = choices("AugmentOn", ("cpu", "gpu", "auto"), __name__)
LrSchedule = choices("LrSchedule", ("cosine", "constant", "rise"), __name__)
GramTokens = choices("GramTokens", ("all", "masked", "unmasked"), __name__)
ResizeMode = choices("ResizeMode", ("bicubic", "bilinear", "nearest", "area"), __name__)


@dataclass
class TeacherConfig:
    centering: Centering = Centering.centering
    """centering (EMA centre) | sinkhorn_knopp"""
    momentum_teacher: float = 0.992
    """EMA momentum of the teacher at the start (cosine schedule up to final_momentum_teacher)."""
    final_momentum_teacher: float = 1.0
    """EMA momentum at the end of training (1.0: the teacher freezes at the end)."""
    warmup_teacher_temp: float = 0.04
    """Teacher softmax temperature at the start; it rises linearly to teacher_temp."""
    teacher_temp: float = 0.07
    """Teacher softmax temperature after the warm-up (lower: sharper targets)."""
    warmup_teacher_temp_epochs: float = 30
    """Epochs of the teacher-temperature warm-up (the DINO loss often rises during it)."""
    student_temp: float = 0.1
    """Student softmax temperature."""
    center_momentum: float = 0.9
    """teacher.centering=centering: EMA momentum of the centre subtracted from the teacher's logits."""


@dataclass
class OptimConfig:
    base_lr: float = 0.004
    """lr = base_lr * sqrt(global batch / 1024) (DINOv2's sqrt_wrt_1024 rule)."""
    scale_lr_with_batch: bool = True
    """true: scale base_lr by sqrt(global batch / 1024); false: base_lr is the peak lr as given."""
    min_lr: float = 1.0e-6
    """lr at the end of the cosine decay."""
    warmup_epochs: float = 10
    """Epochs of linear lr warm-up from 0 to the peak (first phase)."""
    weight_decay: float = 0.04
    """AdamW weight decay at the start (cosine schedule up to weight_decay_end)."""
    weight_decay_end: float = 0.4
    """AdamW weight decay at the end of training."""
    layerwise_decay: float = 0.9
    """Layer-wise lr decay: block i of L gets lr x decay^(L + 1 - i), the patch embedding the smallest; 1.0 turns it off."""
    patch_embed_lr_mult: float = 0.2
    """lr multiplier of the patch embedding."""
    freeze_last_layer_epochs: float = 1
    """Epochs during which the heads' prototype layer gets no updates (stabilises the start)."""
    clip_grad: float = 3.0
    """Gradient norm clipping threshold (per module, see clip_per_module); 0 turns clipping off."""
    clip_per_module: bool = True
    """Clip the backbone and each head on its own norm (both official codes); false: one norm per student."""
    decay_tokens: bool = True
    """Weight-decay the cls / position / register / storage / mask tokens and the prototype gain, as both
    official codes do; false exempts them (like norms and biases)."""
    adamw_beta1: float = 0.9
    """AdamW beta1."""
    adamw_beta2: float = 0.999
    """AdamW beta2."""
    schedule_shape: ScheduleShape = ScheduleShape.dinov2
    """How lr, weight decay, momentum and teacher temperature are sampled per step: dinov2 (its CosineScheduler:
    the warm-up ends on the peak) | dinov3 (its linear_warmup_cosine_decay: the warm-up stops one step short, the
    cosine ends on its final value). Loss-weight schedules (local-crop, Gram) are DINOv3's and always dinov3."""
    backbone_warmup_steps: int = 0
    """Continued pretraining: after ``train.head_warmup_steps`` the backbone's lr ramps linearly from 0 to the
    schedule's over these steps, while the heads keep the schedule's lr (0: the backbone follows the schedule)."""
    backbone_lr_mult: float = 1.0
    """Continued pretraining: the backbone's lr relative to the heads' (on top of layerwise_decay and the ramp
    above), in (0, 1]; fine-tuning recipes move a released backbone 5-10x slower than the new heads so it keeps
    what it knows (docs/pretrain.md, "Continuing from a release"). 1.0: one lr for all (pretraining)."""
    lr_schedule: LrSchedule = LrSchedule.cosine
    """cosine (DINOv2: warm-up, then cosine to min_lr; later phases: their own cosine) | constant (DINOv3: warm-up,
    then the peak lr to the end, so training can be extended or stopped at any point; a later phase holds its own
    peak, e.g. DINOv3's Gram stage at 3/5 of it) | rise (DINOv3's
    high-resolution adaptation: half a cosine from 0 up to the peak lr over warmup_epochs, then the peak)."""


@dataclass
class CropsConfig:
    global_crops_scale: list[float] = field(default_factory=lambda: [0.32, 1.0])
    """[min, max] area fraction of the image that a global crop covers (RandomResizedCrop)."""
    local_crops_number: int = 8
    """Local crops per image (0: global crops only)."""
    local_crops_scale: list[float] = field(default_factory=lambda: [0.05, 0.32])
    """[min, max] area fraction of the image that a local crop covers."""
    blur: Blur = Blur.released
    """released (the official code: global crop 1 never blurred, crop 2 with p=0.9, locals 0.5) | paper (the
    papers' wording: crop 1 always, crop 2 with p=0.1)"""
    horizontal_flip: bool = True
    """false: no flips (DINOv3's ViT-7B recipe)."""


@dataclass
class CropSizeConfig:
    """One (global, local, Gram-teacher) crop-size triple of a multi-size phase and its probability."""

    global_crops_size: int = 224
    """Global crop side in pixels for batches that draw this triple."""
    local_crops_size: int = 98
    """Local crop side in pixels for batches that draw this triple."""
    gram_crops_size: Optional[int] = None
    """Size at which the Gram teacher sees the global crops (same boxes); null = the global size."""
    probability: float = 1.0
    """Chance that a batch draws this triple (the phase's probabilities sum to 1)."""


@dataclass
class PhaseConfig:
    """One resolution phase. Phases run in order; their fractions of ``train.epochs`` must sum to 1."""

    name: str = "base"
    """Phase name, logged with each step's metrics and shown on the report's plots."""
    fraction: float = 1.0
    """Share of the run's steps (train.epochs x train.epoch_length) spent in this phase."""
    global_crops_size: int = 224
    """Global crop side in pixels (a multiple of the patch size)."""
    local_crops_size: int = 98
    """Local crop side in pixels (a multiple of the patch size)."""
    batch_size_per_gpu: int = 64
    """Images per process per micro-batch in this phase."""
    lr_scale: float = 1.0
    """Peak lr of this phase relative to the base lr (later phases: a lower, compressed cosine)."""
    warmup_fraction: float = 0.0
    """Warm-up of a later phase, as a fraction of its own steps (the first phase uses optim.warmup_epochs)."""
    momentum_teacher: Optional[float] = None
    """Teacher EMA momentum held at this value through the phase (DINOv3's Gram-anchoring and high-resolution
    stages: 0.999, after 0.994 in pretraining); null: the run's teacher.momentum_teacher schedule."""
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
    """DataLoader worker processes per training process (decode and crop); 0 decodes in the process."""
    persistent_workers: bool = False
    """Keep each phase's DataLoader workers between epochs (they still stop at a phase switch)."""
    channels: int = 3
    """Image channels, 1-16. 3: photos through Pillow (8-bit RGB). Any other count: .npy / TIFF tiles of any bit
    depth, read with their channels (docs/multichannel.md); model.in_chans follows it."""
    mean: Optional[list[float]] = None
    """Per-channel normalisation mean on the reader's value scale (print it with `dinopipe channel-stats PATH`);
    null: ImageNet's (3 channels only)."""
    std: Optional[list[float]] = None
    """Per-channel normalisation std (see mean)."""
    reader: Optional[Reader] = None
    """rgb (Pillow, 8-bit RGB) | array (npy / TIFF with their bands and bit depth; float tensors); null: rgb for
    3 channels, array otherwise."""
    augment_on: AugmentOn = AugmentOn.cpu
    """cpu: workers decode and crop (uint8 crops, normalised on the device) | gpu: workers read bytes, the device
    decodes (nvJPEG) and crops, same draws per (seed, epoch, sample) | auto: gpu when training on CUDA. RGB
    single-size phases only; others (N channels, Gram crops, multi-size) stay on the CPU path."""


@dataclass
class TrainConfig:
    output_dir: str = "runs/pretrain"
    """Run folder: config.yaml, metrics.jsonl, checkpoints/, export/; rerunning with it resumes."""
    epochs: int = 100
    """Length of the run in epochs of epoch_length steps."""
    epoch_length: int = 1250
    """Steps per 'epoch' (DINOv2's OFFICIAL_EPOCH_LENGTH): schedules are written in these epochs."""
    seed: int = 0
    """Seed of the initial weights, the data order and every augmentation (a resumed run repeats them)."""
    log_every: int = 10
    """Steps between rows of metrics.jsonl (and the first step, and each phase's last)."""
    checkpoint_every: int = 500
    """Steps between DCP checkpoints (each phase's end is checkpointed too)."""
    keep_last: int = 3
    """Checkpoints kept on disk (older ones are deleted after a newer one is complete)."""
    checkpoint_dir: str = ""
    """Where checkpoints go ('' = <output_dir>/checkpoints): a folder, or a URL such as s3://bucket/run/ckpt
    (credentials from the standard provider chain, endpoint from AWS_ENDPOINT_URL_S3; docs/storage.md)."""
    max_skipped_in_a_row: int = 50
    """Stop with exit 65 (naming the shards) after this many steps in a row skipped because a rank had no readable
    image; 0 = never."""
    max_corrupt_fraction: float = 0.5
    """Stop with exit 65 (naming the shards) when more than this fraction of the images read by this invocation
    were unreadable (checked after 256 images); 1.0 = never."""
    device: Device = Device.auto
    """auto (CUDA when available) | cpu | cuda (each rank takes the GPU of its local rank)"""
    stop_after: Optional[int] = None
    """Leave after this many steps of this invocation (with a checkpoint); rerunning resumes."""
    progress: bool = True
    """Show a progress bar on rank 0."""
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
    """Turn Gram anchoring on (DINOv3's refinement stage)."""
    loss_weight: float = 1.0
    """Weight after the warm-up (DINOv3's ViT-7B: 2.0 when anchoring, 1.5 in high-res adaptation)."""
    loss_weight_start: Optional[float] = None
    """Weight at ``first_step``, rising linearly to ``loss_weight`` over ``warmup_steps`` (null = loss_weight)."""
    warmup_steps: int = 0
    """Steps of the linear rise from loss_weight_start to loss_weight after first_step."""
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
    """Antialias when a higher-resolution Gram teacher's patch grid is resized to the student's."""
    remove_neg: bool = False
    """Clip negative similarities to 0 in both Gram matrices (an option of DINOv3's loss; off in its recipes)."""
    tokens_used: GramTokens = GramTokens.all
    """Which student global-crop patches enter the loss: all (DINOv3's recipes) | masked | unmasked (the iBOT-masked
    or the visible ones; these need image_level false, as DINOv3 asserts)."""
    image_level: bool = True
    """One Gram matrix per image (DINOv3's ``img_level: true``, its recipes); false: one matrix over all selected
    patches of the batch (memory grows with their count squared)."""


@dataclass
class KnnProbeConfig:
    """kNN of the EMA teacher on a labelled held-out set at a few points of the run, written to RUN/knn.jsonl and
    plotted beside the losses in the pipeline report: the losses alone do not show whether the backbone learns."""

    train: Optional[str] = None
    """Labelled gallery: a folder of class sub-folders or webdataset shards (null: no kNN during pretraining)."""
    val: Optional[str] = None
    """Labelled queries with the same classes as knn.train (the pipeline passes its held-out eval set)."""
    points: int = 4
    """Evaluations over the run: one before the first step (the random init) and points - 1 evenly spaced
    after it, the last at the end of training."""
    max_queries: int = 256
    """At most this many queries (the first ones, the same at every point), to keep each evaluation cheap."""
    k: int = 20
    """Neighbours that vote (weighted kNN, temperature 0.07, as DINO); a gallery smaller than k uses all of it."""
    img_size: Optional[int] = None
    """Eval crop size (resize to 256/224 of it, centre crop); null: the size the backbone was built for."""


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
    """Resolution phases in order (a list of entries with the keys below); fractions sum to 1."""
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    gram: GramConfig = field(default_factory=GramConfig)
    knn: KnnProbeConfig = field(default_factory=KnnProbeConfig)


__all__ = ["PretrainConfig", "PhaseConfig", "CropSizeConfig", "GramConfig", "KnnProbeConfig"]
