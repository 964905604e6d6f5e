"""Real photographs that ship inside pip packages (no download), and a sample pool built from them.

scikit-image's bundled sample images (loaders that need a download are skipped), scikit-learn's two
sample photos (each split into two halves, different pictures) and matplotlib's Grace Hopper portrait.
``build_sample_pool`` turns them into a pool of a few hundred to a few thousand images for smoke runs:
random crops and colour changes (distinct-enough views for SSL), planted near-duplicates (resized,
recompressed, slightly cropped) and a few corrupt files, as a real pool has.
"""

from __future__ import annotations

import io
import os
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image

# Left out on purpose: 'cat' is 'chelsea' again, stereo_motorcycle's right view is a near-copy of
# the left one, lfw_subset is 25x25 faces, and the synthetic patterns are not photos.
_SKIMAGE = [
    "astronaut", "brick", "camera", "cell", "chelsea", "clock", "coffee", "coins", "colorwheel",
    "grass", "gravel", "horse", "immunohistochemistry", "logo", "moon", "page", "rocket", "text",
]
# Big photos used only through their non-overlapping quadrants.
_SKIMAGE_QUADRANTS = ["retina", "hubble_deep_field"]


def _to_rgb_uint8(arr: np.ndarray) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.dtype == bool:
        arr = arr.astype(np.uint8) * 255
    elif arr.dtype != np.uint8:
        arr = np.clip(arr * (255.0 if arr.max() <= 1.0 else 1.0), 0, 255).astype(np.uint8)
    if arr.ndim == 2:
        arr = np.stack([arr] * 3, axis=-1)
    if arr.shape[-1] == 4:  # RGBA logo: composite on white
        a = arr[..., 3:4].astype(np.float32) / 255.0
        arr = (arr[..., :3] * a + 255.0 * (1 - a)).astype(np.uint8)
    return np.ascontiguousarray(arr[..., :3])


def _quadrants(arr: np.ndarray) -> list[np.ndarray]:
    h, w = arr.shape[:2]
    return [arr[:h // 2, :w // 2], arr[:h // 2, w // 2:], arr[h // 2:, :w // 2], arr[h // 2:, w // 2:]]


@lru_cache(maxsize=1)
def real_photos() -> dict[str, np.ndarray]:
    """name -> (H, W, 3) uint8 array; distinct pictures only (no copies among them)."""
    import skimage.data as skd

    out: dict[str, np.ndarray] = {}
    for name in _SKIMAGE + _SKIMAGE_QUADRANTS:
        try:
            arr = _to_rgb_uint8(getattr(skd, name)())
        except Exception:  # loaders that need a download fail offline: skip them
            continue
        if name in _SKIMAGE_QUADRANTS:
            for i, q in enumerate(_quadrants(arr)):
                out[f"{name}_q{i}"] = np.ascontiguousarray(q)
        else:
            out[name] = arr
    try:
        left, _right, _disp = skd.stereo_motorcycle()
        out["motorcycle"] = _to_rgb_uint8(left)
    except Exception:
        pass
    try:
        from sklearn.datasets import load_sample_images

        for fname, img in zip(load_sample_images().filenames, load_sample_images().images):
            stem = os.path.splitext(os.path.basename(fname))[0]
            # china.jpg / flower.jpg are 427x640: left and right halves are different pictures.
            out[f"{stem}_left"] = np.ascontiguousarray(img[:, :320])
            out[f"{stem}_right"] = np.ascontiguousarray(img[:, 320:])
    except Exception:
        pass
    try:
        from matplotlib import cbook

        with cbook.get_sample_data("grace_hopper.jpg") as f:
            out["grace_hopper"] = _to_rgb_uint8(np.asarray(Image.open(f).convert("RGB")))
    except Exception:
        pass
    return out


def _random_view(arr: np.ndarray, rng: np.random.Generator, out_size: int) -> np.ndarray:
    """A random crop (20-70% of the side) with a random colour gain: a different picture of the scene."""
    h, w = arr.shape[:2]
    side = int(min(h, w) * rng.uniform(0.2, 0.7))
    y, x = rng.integers(0, h - side + 1), rng.integers(0, w - side + 1)
    crop = Image.fromarray(arr[y : y + side, x : x + side]).resize((out_size, out_size), Image.BICUBIC)
    gain = rng.uniform(0.8, 1.2, size=3)
    return np.clip(np.asarray(crop, dtype=np.float32) * gain, 0, 255).astype(np.uint8)


def _near_copy(arr: np.ndarray, rng: np.random.Generator) -> bytes:
    """Resized, slightly cropped and recompressed: what the web does to a picture."""
    h, w = arr.shape[:2]
    m = int(min(h, w) * 0.04)
    img = Image.fromarray(arr[m : h - m, m : w - m])
    s = rng.uniform(0.6, 0.9)
    img = img.resize((max(16, int(img.width * s)), max(16, int(img.height * s))), Image.BILINEAR)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=int(rng.integers(60, 85)))
    return buf.getvalue()


def encode(arr: np.ndarray, fmt: str = "JPEG", quality: int = 95) -> bytes:
    buf = io.BytesIO()
    img = Image.fromarray(arr)
    if fmt == "JPEG":
        img.save(buf, format="JPEG", quality=quality)
    else:
        img.save(buf, format=fmt)
    return buf.getvalue()


def make_copy(arr: np.ndarray, kind: str) -> np.ndarray:
    """A near-duplicate of ``arr`` as the web makes them ('resize', 'jpeg', 'crop', 'combo'); tests and
    benches plant them to measure copy detection."""
    img = Image.fromarray(arr)
    w, h = img.size
    if kind == "resize":
        img = img.resize((max(16, w // 2), max(16, h // 2)), Image.BILINEAR)
    elif kind == "jpeg":
        img = Image.open(io.BytesIO(encode(arr, quality=30))).convert("RGB")
    elif kind == "crop":  # about 5% off: 2.5% from each border
        dx, dy = max(1, int(0.025 * w)), max(1, int(0.025 * h))
        img = img.crop((dx, dy, w - dx, h - dy))
    elif kind == "combo":
        dx, dy = max(1, int(0.02 * w)), max(1, int(0.02 * h))
        img = img.crop((dx, 0, w - dx, h - dy)).resize((int(w * 0.7), int(h * 0.7)), Image.BICUBIC)
        img = Image.open(io.BytesIO(encode(np.asarray(img), quality=50))).convert("RGB")
    else:
        raise ValueError(kind)
    return np.asarray(img)


COPY_KINDS = ("resize", "jpeg", "crop", "combo")


CORRUPT_FILES = {
    "corrupt_empty.jpg": b"",
    "corrupt_not_an_image.jpg": b"<html><body>404 Not Found</body></html>",
}


def build_sample_pool(out_dir: str | os.PathLike, n_images: int = 600, copy_fraction: float = 0.1,
                      size: int = 160, seed: int = 0, corrupt: bool = True) -> dict:
    """Write ``n_images`` JPEG views of the real photos into ``out_dir/pool`` (+ planted copies in
    ``out_dir/pool/copies`` and corrupt files), and return counts. Idempotent: an existing complete pool is
    kept (``out_dir/pool/.complete``)."""
    root = Path(out_dir) / "pool"
    done = root / ".complete"
    if done.is_file():
        return {"dir": str(root), "reused": True}
    photos = real_photos()
    if not photos:
        raise RuntimeError("no sample photos could be loaded (is scikit-image installed? pip install 'dinopipe[dev]')")
    rng = np.random.default_rng(seed)
    names = sorted(photos)
    (root / "copies").mkdir(parents=True, exist_ok=True)
    n_copies = 0
    for i in range(n_images):
        name = names[i % len(names)]
        view = _random_view(photos[name], rng, size)
        stem = f"{name}_{i:05d}"
        Image.fromarray(view).save(root / f"{stem}.jpg", quality=92)
        if rng.random() < copy_fraction:
            (root / "copies" / f"{stem}_copy.jpg").write_bytes(_near_copy(view, rng))
            n_copies += 1
    if corrupt:
        for fname, data in CORRUPT_FILES.items():
            (root / fname).write_bytes(data)
        good = (root / f"{names[0]}_00000.jpg").read_bytes()
        (root / "corrupt_truncated.jpg").write_bytes(good[: len(good) // 3])
    done.write_text(f"{n_images} views, {n_copies} copies\n")
    return {"dir": str(root), "views": n_images, "copies": n_copies, "photos": len(names), "reused": False}


def build_eval_set(out_dir: str | os.PathLike, n_train: int = 8, n_val: int = 4, size: int = 112,
                   seed: int = 1) -> dict:
    """A labelled instance-retrieval set: class = source photo, random views as image folders
    ``out_dir/eval/{train,val}/<photo>/*.jpg`` (train = kNN gallery, val = queries). Drawn with another seed
    than the pool, so its views are new pictures of the same scenes."""
    root = Path(out_dir) / "eval"
    done = root / ".complete"
    if done.is_file():
        return {"train": str(root / "train"), "val": str(root / "val"), "reused": True}
    photos = real_photos()
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("val", n_val)):
        for name in sorted(photos):
            d = root / split / name
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Image.fromarray(_random_view(photos[name], rng, size)).save(d / f"{i:03d}.jpg", quality=92)
    done.write_text(f"{len(photos)} classes, {n_train} train / {n_val} val views each\n")
    return {"train": str(root / "train"), "val": str(root / "val"), "classes": len(photos), "reused": False}


def build_seed_set(out_dir: str | os.PathLike, n_images: int = 24, size: int = 160, seed: int = 2) -> str:
    """A small curated 'seed' set (views of a few photos) for retrieval-based rebalancing."""
    root = Path(out_dir) / "seeds"
    if (root / ".complete").is_file():
        return str(root)
    photos = real_photos()
    names = sorted(photos)[: max(1, len(photos) // 4)]
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_images):
        name = names[i % len(names)]
        Image.fromarray(_random_view(photos[name], rng, size)).save(root / f"{name}_{i:03d}.jpg", quality=92)
    (root / ".complete").write_text(f"{n_images} views of {len(names)} photos\n")
    return str(root)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Write a sample image pool built from photos shipped in pip packages.")
    p.add_argument("out_dir")
    p.add_argument("--n-images", type=int, default=600)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    info = build_sample_pool(args.out_dir, args.n_images, seed=args.seed)
    build_eval_set(args.out_dir)
    build_seed_set(args.out_dir)
    print(info["dir"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
