"""Segmentation and detection sets with exact labels, built offline from photos that ship with scikit-image and
scikit-learn (the tests and ``bench/bench_dense_heads.py`` use them).

Objects are crops of three photos (class 1 chelsea the cat, 2 coffee, 3 astronaut) cut out by a random ellipse
(the shape says nothing about the class: the pixels must), pasted 1-3 per image onto crops of real backgrounds
(sklearn's china and flower, skimage's brick, grass and gravel). Later objects occlude earlier ones; each
instance's mask is what stays visible, its box that mask's bounds, and an instance less than 40 % visible is
dropped. Train and val come from disjoint halves of every source photo (left half for train, right for val),
so no val pixel was ever seen in training.

Writes ``OUT/{train,val}/images/X.png``, ``masks/X.png`` (0 background, 1..3 the classes: a dense set) and
``OUT/{train,val}.json`` (COCO instances, RLE masks; ``file_name`` relative to OUT).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

OBJECTS = ("chelsea", "coffee", "astronaut")
BACKGROUNDS = ("china", "flower", "brick", "grass", "gravel")


def _photo(name: str) -> np.ndarray:
    if name in ("china", "flower"):
        from sklearn.datasets import load_sample_image

        a = load_sample_image(f"{name}.jpg")
    else:
        from skimage import data

        a = getattr(data, name)()
    a = np.asarray(a)
    return np.stack([a] * 3, -1) if a.ndim == 2 else a[..., :3]


def _half(a: np.ndarray, split: str) -> np.ndarray:
    w = a.shape[1] // 2
    return a[:, :w] if split == "train" else a[:, w:]


def _crop(rng, src: np.ndarray, h: int, w: int) -> np.ndarray:
    """A random crop of ``src`` at a random scale (0.5-1 of the largest that fits), resized to (h, w)."""
    s = rng.uniform(0.5, 1.0) * min(src.shape[0] / h, src.shape[1] / w)
    ch, cw = max(2, int(h * s)), max(2, int(w * s))
    y, x = rng.integers(0, src.shape[0] - ch + 1), rng.integers(0, src.shape[1] - cw + 1)
    return np.asarray(Image.fromarray(src[y:y + ch, x:x + cw]).resize((w, h), Image.BILINEAR))


def _ellipse(rng, h: int, w: int) -> np.ndarray:
    yy, xx = np.mgrid[:h, :w]
    cy, cx = (h - 1) / 2, (w - 1) / 2
    ry, rx = cy * rng.uniform(0.75, 1.0) + 0.5, cx * rng.uniform(0.75, 1.0) + 0.5
    return ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1


def compose(rng, split: str, size: int, objs: list, bgs: list) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
    """One image (size, size, 3) uint8 and its visible instances [(class 1..K, bool mask)]."""
    img = _crop(rng, bgs[rng.integers(len(bgs))], size, size).copy()
    placed: list[tuple[int, np.ndarray, int]] = []
    for _ in range(rng.integers(1, 4)):
        c = int(rng.integers(len(objs)))
        h, w = (int(v) for v in rng.integers(size // 5, size // 2 + 1, size=2))
        y, x = rng.integers(0, size - h + 1), rng.integers(0, size - w + 1)
        shape = _ellipse(rng, h, w)
        full = np.zeros((size, size), bool)
        full[y:y + h, x:x + w] = shape
        img[full] = _crop(rng, objs[c], h, w)[shape]
        placed = [(k, m & ~full, a) for k, m, a in placed]  # occluded by the new object
        placed.append((c + 1, full, int(shape.sum())))
    return img, [(k, m) for k, m, a in placed if m.sum() >= 0.4 * a]


def build_paste_sets(out: str | Path, n_train: int, n_val: int, size: int = 128, seed: int = 0) -> dict:
    """Write the dense sets and COCO JSONs (module docstring); returns their paths."""
    import pycocotools.mask as mask_utils

    out = Path(out)
    paths = {}
    for split, n, s in (("train", n_train, seed), ("val", n_val, seed + 1)):
        rng = np.random.default_rng(s)
        objs = [_half(_photo(o), split) for o in OBJECTS]
        bgs = [_half(_photo(b), split) for b in BACKGROUNDS]
        (out / split / "images").mkdir(parents=True, exist_ok=True)
        (out / split / "masks").mkdir(parents=True, exist_ok=True)
        images, anns = [], []
        for i in range(n):
            img, inst = compose(rng, split, size, objs, bgs)
            sem = np.zeros((size, size), np.uint8)
            for k, m in inst:
                sem[m] = k
            name = f"{split}/images/{i:04d}.png"
            Image.fromarray(img).save(out / name)
            Image.fromarray(sem).save(out / split / "masks" / f"{i:04d}.png")
            images.append({"id": i + 1, "file_name": name, "height": size, "width": size})
            for k, m in inst:
                rle = mask_utils.encode(np.asfortranarray(m.astype(np.uint8)))
                x0, y0, bw, bh = (float(v) for v in mask_utils.toBbox(rle))
                rle["counts"] = rle["counts"].decode("ascii")
                anns.append({"id": len(anns) + 1, "image_id": i + 1, "category_id": k, "bbox": [x0, y0, bw, bh],
                             "area": float(m.sum()), "iscrowd": 0, "segmentation": rle})
        cats = [{"id": k + 1, "name": o} for k, o in enumerate(OBJECTS)]
        (out / f"{split}.json").write_text(json.dumps({"images": images, "annotations": anns, "categories": cats}))
        paths[split] = out / split
        paths[f"{split}_json"] = out / f"{split}.json"
    return paths


__all__ = ["OBJECTS", "BACKGROUNDS", "compose", "build_paste_sets"]
