"""The random draws of the multi-crop recipe, as numbers: one row per crop, drawn from a sample's seed on the
image's full-size coordinates, *before* any pixel is decoded.

Both augmentation paths render from these rows: the CPU path (:mod:`.fast_crops`, which picks a reduced JPEG
decoding scale from them) and the GPU path (:mod:`.gpu_augment`, which decodes and crops a whole batch on the
device). The draws consume a ``torch.Generator`` seeded with the sample's seed in exactly the order in which
torchvision's v2 transforms of :class:`.transforms.MultiCropAugmentation` consume torch's global generator
(RandomResizedCrop's 10 tries, the flip, RandomApply(ColorJitter) with its permutation and four factors,
RandomGrayscale, RandomApply(GaussianBlur) with its sigma, RandomSolarize), so a (seed, epoch, sample) gives
the same crops, flips and colour draws on every path, including the reference one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

# Columns of a parameter row.
TOP, LEFT, HEIGHT, WIDTH, FLIP, JITTER, ORDER, FACTORS, GREY, BLUR, SIGMA, SOLARIZE = (
    0, 1, 2, 3, 4, 5, 6, 10, 14, 15, 16, 17)
N_COLS = 18
"""top, left, height, width (full-size pixels), flip, jitter on, jitter order (4: 0 brightness, 1 contrast,
2 saturation, 3 hue), factors (brightness, contrast, saturation, hue), greyscale, blur, sigma, solarise."""

JITTER_RANGES = ((0.6, 1.4), (0.6, 1.4), (0.8, 1.2), (-0.1, 0.1))
"""ColorJitter(brightness=0.4, contrast=0.4, saturation=0.2, hue=0.1) of DINOv2 (and torchvision's ranges)."""
BLUR_SIGMA = (0.1, 2.0)
RATIO = (3 / 4, 4 / 3)


@dataclass(frozen=True)
class CropSpec:
    """One crop of the recipe: output size, area scale range, blur and solarisation probabilities."""

    size: int
    scale: tuple[float, float]
    blur_p: float
    solarize_p: Optional[float] = None  # None: no RandomSolarize in this crop's pipeline (no draw either)


@dataclass(frozen=True)
class Recipe:
    """The crops of one sample (global 1, global 2, locals...) and the draws they share."""

    crops: tuple[CropSpec, ...]
    n_global: int = 2
    flip: bool = True
    jitter_p: float = 0.8
    grey_p: float = 0.2

    @property
    def sizes(self) -> list[int]:
        return [c.size for c in self.crops]


def dinov2_recipe(global_size: int = 224, local_size: int = 98, n_local: int = 8,
                  global_scale: Sequence[float] = (0.32, 1.0), local_scale: Sequence[float] = (0.05, 0.32),
                  blur_p: Sequence[float] = (0.0, 0.9, 0.5), solarize_p: float = 0.2, flip: bool = True,
                  jitter_p: float = 0.8, grey_p: float = 0.2) -> Recipe:
    """The recipe of MultiCropAugmentation: blur_p = (global 1, global 2, local), solarisation on global 2."""
    gs, ls = (float(global_scale[0]), float(global_scale[1])), (float(local_scale[0]), float(local_scale[1]))
    crops = (CropSpec(global_size, gs, blur_p[0]), CropSpec(global_size, gs, blur_p[1], solarize_p),
             *[CropSpec(local_size, ls, blur_p[2]) for _ in range(n_local)])
    return Recipe(crops, 2, flip, jitter_p, grey_p)


_LOG_R = [float(v) for v in torch.log(torch.tensor(RATIO))]  # float32 values, as RandomResizedCrop keeps them


def _uniform(g: torch.Generator, lo, hi) -> float:
    return torch.empty(1).uniform_(lo, hi, generator=g).item()


def _applies(g: torch.Generator, p: float) -> bool:
    return bool(torch.rand(1, generator=g) < p)  # torchvision: `if torch.rand(1) >= p: skip`


def random_resized_crop(g: torch.Generator, height: int, width: int, scale: Sequence[float]
                        ) -> tuple[int, int, int, int]:
    """(top, left, h, w): torchvision v2 RandomResizedCrop.make_params, drawing from ``g``."""
    area = height * width
    for _ in range(10):
        target_area = area * _uniform(g, scale[0], scale[1])
        aspect = torch.exp(torch.empty(1).uniform_(_LOG_R[0], _LOG_R[1], generator=g)).item()
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            i = int(torch.randint(0, height - h + 1, size=(1,), generator=g).item())
            j = int(torch.randint(0, width - w + 1, size=(1,), generator=g).item())
            return i, j, h, w
    in_ratio = float(width) / float(height)  # fallback: central crop
    if in_ratio < min(RATIO):
        w, h = width, int(round(width / min(RATIO)))
    elif in_ratio > max(RATIO):
        h, w = height, int(round(height * max(RATIO)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def draw(recipe: Recipe, seed: int, height: int, width: int) -> np.ndarray:
    """(n_crops, N_COLS) float64 rows for an image of ``height`` x ``width`` (full size, upright)."""
    g = torch.Generator().manual_seed(int(seed))
    out = np.zeros((len(recipe.crops), N_COLS), dtype=np.float64)
    for k, spec in enumerate(recipe.crops):
        row = out[k]
        row[TOP:WIDTH + 1] = random_resized_crop(g, height, width, spec.scale)
        if recipe.flip:
            row[FLIP] = _applies(g, 0.5)
        row[FACTORS:FACTORS + 4] = (1.0, 1.0, 1.0, 0.0)
        row[ORDER:ORDER + 4] = (0, 1, 2, 3)
        if _applies(g, recipe.jitter_p):
            row[JITTER] = 1
            row[ORDER:ORDER + 4] = torch.randperm(4, generator=g).numpy()
            row[FACTORS:FACTORS + 4] = [_uniform(g, lo, hi) for lo, hi in JITTER_RANGES]
        row[GREY] = _applies(g, recipe.grey_p)
        if _applies(g, spec.blur_p):
            row[BLUR], row[SIGMA] = 1, _uniform(g, *BLUR_SIGMA)
        if spec.solarize_p is not None:
            row[SOLARIZE] = _applies(g, spec.solarize_p)
    return out


def draft_scale(recipe: Recipe, params: np.ndarray, limit: int = 8) -> int:
    """The largest JPEG DCT reduction (1, 2, 4 or 8) at which every crop's source region still covers its
    output size: min over crops of min(h, w) / size, rounded down to a power of two."""
    room = min(min(p[HEIGHT], p[WIDTH]) / s for p, s in zip(params, recipe.sizes))
    s = 1
    while s * 2 <= min(room, limit):
        s *= 2
    return s


__all__ = ["CropSpec", "Recipe", "dinov2_recipe", "draw", "draft_scale", "random_resized_crop", "N_COLS",
           "JITTER_RANGES", "BLUR_SIGMA", "RATIO"]
