"""Settings of `dinopipe eval seg --head ...` and `dinopipe eval detect` beyond their flags: a YAML file given with
``--config`` and ``key=value`` overrides, listed by `dinopipe config --kind seg` / `--kind detect`. The flags
(``--epochs``, ``--lr``, ``--backbone-lr``, ``--img-size``, ``--batch-size``, ``--channels``, ``--device``,
``--num-heads``) stay flags; a wrong key or value exits 2 before anything is written.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..config import ConfigError


@dataclass
class Mask2FormerConfig:
    num_queries: int = 100
    """Mask queries of the decoder (Mask2Former: 100)."""
    decoder_layers: int = 10
    """Masked-attention decoder layers (Mask2Former: 10 incl. the first prediction)."""
    encoder_layers: int = 6
    """Deformable-attention layers of the pixel decoder (Mask2Former: 6)."""
    train_num_points: int = 12544
    """Points sampled per mask for the mask and dice losses (Mask2Former: 112 x 112)."""


@dataclass
class HeadFitConfig:
    weight_decay: float = 1e-4
    """AdamW weight decay (the head's, and a tuned backbone's)."""
    warmup_frac: float = 0.1
    """Fraction of the steps with a linear lr warm-up (then cosine to 0)."""
    clip_grad: float = 35.0
    """Gradient-norm clip per step (0 = none)."""
    seed: int = 0
    """Seed of the head's initialisation, the data order and the flips."""
    train_flip: bool = True
    """Random horizontal flips of the training images."""
    workers: int = 0
    """DataLoader worker processes reading the training images."""


@dataclass
class SegHeadsConfig:
    """`dinopipe eval seg --head linear|upernet|m2f` (the pyramid heads' path) beyond its flags."""

    train: HeadFitConfig = field(default_factory=HeadFitConfig)
    """How the head is trained (beyond --epochs, --lr, --backbone-lr, --batch-size)."""
    m2f: Mask2FormerConfig = field(default_factory=Mask2FormerConfig)
    """--head m2f: the Mask2Former decoder's size."""


@dataclass
class DetectConfig:
    """`dinopipe eval detect` beyond its flags."""

    train: HeadFitConfig = field(default_factory=HeadFitConfig)
    """How the detector is trained (beyond --epochs, --lr, --backbone-lr, --batch-size)."""


def check_fit_config(cfg: SegHeadsConfig | DetectConfig) -> None:
    def need(ok: bool, key: str, what: str, got) -> None:
        if not ok:
            raise ConfigError(f"{key}: must be {what}, got {got}")

    t = cfg.train
    need(t.weight_decay >= 0, "train.weight_decay", ">= 0", t.weight_decay)
    need(0 <= t.warmup_frac < 1, "train.warmup_frac", "in [0, 1)", t.warmup_frac)
    need(t.clip_grad >= 0, "train.clip_grad", ">= 0", t.clip_grad)
    need(t.workers >= 0, "train.workers", ">= 0", t.workers)
    m2f = getattr(cfg, "m2f", None)
    if m2f is not None:
        for k, v in asdict(m2f).items():
            need(v >= 1, f"m2f.{k}", ">= 1", v)


def fit_kwargs(cfg: SegHeadsConfig | DetectConfig) -> dict:
    """The training keywords train_seg / train_detector take from the config."""
    cfg = cfg.train
    return {"weight_decay": cfg.weight_decay, "warmup_frac": cfg.warmup_frac, "clip_grad": cfg.clip_grad,
            "seed": cfg.seed, "flip": cfg.train_flip, "workers": cfg.workers}


__all__ = ["Mask2FormerConfig", "HeadFitConfig", "SegHeadsConfig", "DetectConfig", "check_fit_config", "fit_kwargs"]
