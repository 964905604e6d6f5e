"""Labelled dense (segmentation) sets: folders of images with PNG masks of class indices.

Layout (what ADE20k / VOC-style tools write): ``ROOT/images/NAME.{jpg,jpeg,png}`` and
``ROOT/masks/NAME.png``, a single-channel PNG whose pixel values are class indices (255 = ignore).

``build_texture_set`` makes a small set offline from the textures that ship with scikit-image (brick,
grass, gravel, and a photo as a fourth class): each image is a grid of random rectangular regions, each
filled with a random crop of one class's texture, so the ground-truth mask is known exactly. Regions are
aligned to ``cell`` pixels so that a patch model sees one class per patch where ``cell`` is a multiple of
its patch size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
from PIL import Image

from .data import LabelError

IMAGE_EXTS = (".jpg", ".jpeg", ".png")
IGNORE_INDEX = 255
TEXTURE_CLASSES = ("brick", "grass", "gravel", "coffee")


@dataclass
class DenseSet:
    source: str
    pairs: list[tuple[Path, Path]]  # (image, mask)
    num_classes: int

    def __len__(self) -> int:
        return len(self.pairs)


def open_dense(root: str | Path, num_classes: Optional[int] = None) -> DenseSet:
    """Pair ``images/X.*`` with ``masks/X.png``; the class count is the largest index seen + 1."""
    root = Path(root)
    img_dir, mask_dir = root / "images", root / "masks"
    if not img_dir.is_dir() or not mask_dir.is_dir():
        raise LabelError(f"{root}: a dense set needs images/ and masks/ sub-folders (images/X.jpg + masks/X.png)")
    pairs, missing = [], []
    for img in sorted(p for p in img_dir.iterdir() if p.suffix.lower() in IMAGE_EXTS):
        mask = mask_dir / (img.stem + ".png")
        (pairs.append((img, mask)) if mask.exists() else missing.append(img.name))
    if missing:
        raise LabelError(f"{root}: {len(missing)} image(s) without a mask in masks/, e.g. {missing[:3]}")
    if not pairs:
        raise LabelError(f"{root}/images holds no {'/'.join(IMAGE_EXTS)} images")
    if num_classes is None:
        seen = 0
        for _, m in pairs:
            v = np.asarray(Image.open(m))
            if v.ndim != 2:
                raise LabelError(f"{m}: masks must be single-channel PNGs of class indices, got shape {v.shape}")
            valid = v[v != IGNORE_INDEX]
            seen = max(seen, int(valid.max()) + 1 if valid.size else 0)
        num_classes = seen
    if num_classes < 2:
        raise LabelError(f"{root}: masks hold {num_classes} class(es); segmentation needs at least 2")
    return DenseSet(str(root), pairs, num_classes)


def _textures(size: int) -> list[np.ndarray]:
    from skimage import data

    out = []
    for name in TEXTURE_CLASSES:
        t = np.asarray(getattr(data, name)())
        if t.ndim == 2:
            t = np.stack([t] * 3, axis=-1)
        out.append(t[: max(size, t.shape[0]), : max(size, t.shape[1]), :3].astype(np.uint8))
    return out


def build_texture_set(out: str | Path, n: int, size: int = 112, cell: int = 28, seed: int = 0) -> DenseSet:
    """Write ``n`` composites of ``size`` px (regions on a ``cell`` grid) with their masks under ``out``."""
    if size % cell:
        raise ValueError(f"size {size} must be a multiple of cell {cell}")
    rng = np.random.default_rng(seed)
    tex = _textures(size)
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "masks").mkdir(parents=True, exist_ok=True)
    g = size // cell
    for i in range(n):
        # A few random rectangles of random classes painted over a random background class.
        labels = np.full((g, g), rng.integers(len(tex)), dtype=np.uint8)
        for _ in range(3):
            r0, c0 = rng.integers(0, g, size=2)
            r1, c1 = r0 + rng.integers(1, g - r0 + 1), c0 + rng.integers(1, g - c0 + 1)
            labels[r0:r1, c0:c1] = rng.integers(len(tex))
        mask = labels.repeat(cell, 0).repeat(cell, 1)
        img = np.zeros((size, size, 3), np.uint8)
        for c, t in enumerate(tex):
            y, x = rng.integers(0, t.shape[0] - size + 1), rng.integers(0, t.shape[1] - size + 1)
            img[mask == c] = t[y:y + size, x:x + size][mask == c]
        Image.fromarray(img).save(out / "images" / f"{i:04d}.png")
        Image.fromarray(mask).save(out / "masks" / f"{i:04d}.png")
    return open_dense(out, num_classes=len(tex))


__all__ = ["DenseSet", "open_dense", "build_texture_set", "IGNORE_INDEX", "TEXTURE_CLASSES"]
