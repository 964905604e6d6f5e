"""Labelled depth sets: ``ROOT/images/X.(jpg|jpeg|png)`` + ``ROOT/depth/X.png``.

A depth label is a single-channel 16-bit PNG of millimetres (what NYU / KITTI tools and most RGB-D cameras
write); 0 marks a pixel without a measurement. Labels are read to float metres; the image is resized to the
training square, the label is kept at its own size for evaluation (metrics and saved predictions are at the
label's size, as the official protocol compares them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset

from ..data.transforms import IMAGENET_MEAN, IMAGENET_STD
from .data import LabelError

IMAGE_EXTS = (".jpg", ".jpeg", ".png")
MM_PER_M = 1000.0


@dataclass
class DepthSet:
    source: str
    pairs: list[tuple[Path, Path]]  # (image, depth png)

    def __len__(self) -> int:
        return len(self.pairs)

    @property
    def names(self) -> list[str]:
        return [img.stem for img, _ in self.pairs]


def read_depth_png(path: str | Path) -> np.ndarray:
    """(H, W) float32 metres; 0 where the label has no measurement."""
    with Image.open(path) as im:
        if im.mode not in ("I;16", "I;16B", "I;16L", "I"):
            raise LabelError(f"{path}: depth labels must be single-channel 16-bit PNGs of millimetres, "
                             f"got PIL mode {im.mode}")
        v = np.asarray(im).astype(np.float32)
    if v.ndim != 2 or v.min() < 0 or v.max() > 65535:
        raise LabelError(f"{path}: depth labels must be (H, W) uint16 millimetres")
    return v / MM_PER_M


def write_depth_png(path: str | Path, metres: np.ndarray) -> None:
    """Metres (0 = invalid) as a uint16 millimetre PNG."""
    mm = np.clip(np.round(np.asarray(metres, np.float64) * MM_PER_M), 0, 65535).astype(np.uint16)
    Image.fromarray(mm).save(path)


def open_depth(root: str | Path) -> DepthSet:
    root = Path(root)
    img_dir, dep_dir = root / "images", root / "depth"
    if not img_dir.is_dir() or not dep_dir.is_dir():
        raise LabelError(f"{root}: a depth set needs images/ and depth/ sub-folders (images/X.jpg + depth/X.png)")
    pairs, missing = [], []
    for img in sorted(p for p in img_dir.iterdir() if p.suffix.lower() in IMAGE_EXTS):
        dep = dep_dir / (img.stem + ".png")
        (pairs.append((img, dep)) if dep.exists() else missing.append(img.name))
    if missing:
        raise LabelError(f"{root}: {len(missing)} image(s) without a depth label in depth/, e.g. {missing[:3]}")
    if not pairs:
        raise LabelError(f"{root}/images holds no {'/'.join(IMAGE_EXTS)} images")
    return DepthSet(str(root), pairs)


def max_valid_depth(data: DepthSet) -> float:
    """The largest labelled depth (metres) over the set: the head's bin range when not configured."""
    top = max(float(read_depth_png(d).max()) for _, d in data.pairs)
    if top <= 0:
        raise LabelError(f"{data.source}: every depth label is 0 (no valid pixel)")
    return top


def image_tensor(path: str | Path, size: tuple[int, int] | None) -> Tensor:
    """(3, H, W) ImageNet-normalised image, resized (bicubic) to ``size`` = (h, w) when given."""
    img = Image.open(path).convert("RGB")
    if size is not None:
        img = img.resize((size[1], size[0]), Image.BICUBIC)
    x = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float() / 255
    return (x - torch.tensor(IMAGENET_MEAN)[:, None, None]) / torch.tensor(IMAGENET_STD)[:, None, None]


class DepthTrainSet(Dataset):
    """(key, (3, s, s) image, (1, s, s) depth in metres): the label resized with nearest so that invalid
    pixels stay invalid. Random horizontal flips from (seed, epoch, index), so a resumed run repeats them;
    ``key`` = 2 * index + flipped names the exact input (a frozen backbone's features are cached by it)."""

    def __init__(self, data: DepthSet, size: int, flip: bool = True, seed: int = 0) -> None:
        self.data, self.size, self.flip, self.seed = data, size, flip, seed

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, key):
        i, epoch = key if isinstance(key, tuple) else (key, 0)
        img, dep = self.data.pairs[i]
        x = image_tensor(img, (self.size, self.size))
        d = Image.fromarray(read_depth_png(dep)).resize((self.size, self.size), Image.NEAREST)
        y = torch.from_numpy(np.asarray(d).copy())[None]
        flipped = self.flip and torch.rand(1, generator=torch.Generator().manual_seed(
            hash((self.seed, epoch, i)) & 0x7FFFFFFF)).item() < 0.5
        if flipped:
            x, y = x.flip(-1), y.flip(-1)
        return 2 * i + int(flipped), x, y


__all__ = ["DepthSet", "DepthTrainSet", "open_depth", "read_depth_png", "write_depth_png", "image_tensor",
           "max_valid_depth", "MM_PER_M"]
