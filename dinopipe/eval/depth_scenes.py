"""Depth scenes with exact labels, rendered from real pixels with a pinhole camera (numpy).

A camera ``cam_h`` metres above a textured ground plane looks along it; behind everything stands a photo wall at
``far`` metres; 2-4 photo billboards stand on the ground at random depths and lateral positions. Every pixel's
depth (distance along the optical axis) is known analytically, so the label is exact. The pixels are real: the
ground is one of scikit-image's textures (brick, grass, gravel), the wall and billboards are crops of its photos.
``half`` picks the left or right half of every source image, so train and val scenes share no source pixels.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from .depth_data import DepthSet, open_depth, write_depth_png

_GROUND = ("brick", "grass", "gravel")
_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field", "cat",
           "retina", "motorcycle_left")


def _load(name: str, half: str) -> np.ndarray:
    from skimage import data

    if name == "motorcycle_left":
        a = np.asarray(data.stereo_motorcycle()[0])
    else:
        a = np.asarray(getattr(data, name)())
    if a.ndim == 2:
        a = np.stack([a] * 3, -1)
    a = a[..., :3].astype(np.float32)
    w = a.shape[1] // 2
    return a[:, :w] if half == "left" else a[:, w:]


def _sample(img: np.ndarray, fy: np.ndarray, fx: np.ndarray) -> np.ndarray:
    """Nearest sample of ``img`` at fractional coordinates in [0, 1) (wrapped)."""
    h, w = img.shape[:2]
    return img[(np.mod(fy, 1.0) * h).astype(int) % h, (np.mod(fx, 1.0) * w).astype(int) % w]


def render_scene(rng: np.random.Generator, size: int, ground: list, photos: list, far: float = 20.0,
                 cam_h: float = 1.5, fov_deg: float = 60.0) -> tuple[np.ndarray, np.ndarray]:
    """(size, size, 3) uint8 image, (size, size) float32 depth in metres."""
    f = 0.5 * size / np.tan(np.radians(fov_deg) / 2)
    c = (size - 1) / 2
    v, u = np.mgrid[0:size, 0:size].astype(np.float64)
    horizon = c + rng.uniform(-0.25, 0.05) * size  # camera pitch moves the horizon
    dx, dy = (u - c) / f, (v - horizon) / f
    depth = np.full((size, size), far)
    wall = photos[rng.integers(len(photos))]
    img = _sample(wall, 0.5 + far * dy / (far * 1.2) * 0.5 + rng.uniform(), 0.5 + dx * 0.4)
    tex = ground[rng.integers(len(ground))]
    with np.errstate(divide="ignore"):
        t = np.where(dy > 0, cam_h / np.maximum(dy, 1e-9), np.inf)
    on_ground = t < far
    t = np.where(on_ground, t, far)
    scale = rng.uniform(0.3, 0.6)  # texture repeats every 1/scale metres
    g = _sample(tex, t * scale + rng.uniform(), t * dx * scale + rng.uniform())
    img = np.where(on_ground[..., None], g, img)
    depth = np.where(on_ground, t, depth)
    for _ in range(rng.integers(2, 5)):  # billboards standing on the ground
        z = rng.uniform(2.0, far * 0.8)
        bw, bh = rng.uniform(0.8, 2.5), rng.uniform(0.8, 2.5)
        x0 = rng.uniform(-0.6, 0.6) * z * size / (2 * f) - bw / 2
        X, Y = z * dx, z * dy  # where each pixel's ray meets the plane at depth z (Y down from the camera)
        hit = (X >= x0) & (X < x0 + bw) & (Y <= cam_h) & (Y >= cam_h - bh) & (z < depth)
        ph = photos[rng.integers(len(photos))]
        col = _sample(ph, (Y - (cam_h - bh)) / bh, (X - x0) / bw)
        img = np.where(hit[..., None], col, img)
        depth = np.where(hit, z, depth)
    shade = np.clip(1.0 - 0.02 * depth, 0.5, 1.0)[..., None]  # aerial perspective: a weak, honest cue
    return np.clip(img * shade, 0, 255).astype(np.uint8), depth.astype(np.float32)


def build_depth_scenes(out: str | Path, n: int, size: int = 112, seed: int = 0, half: str = "left",
                       far: float = 20.0) -> DepthSet:
    """``n`` scenes as a depth set under ``out`` (images/X.png, depth/X.png in mm)."""
    rng = np.random.default_rng(seed)
    ground = [_load(g, half) for g in _GROUND]
    photos = [_load(p, half) for p in _PHOTOS]
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "depth").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        img, dep = render_scene(rng, size, ground, photos, far=far)
        Image.fromarray(img).save(out / "images" / f"{i:04d}.png")
        write_depth_png(out / "depth" / f"{i:04d}.png", dep)
    return open_depth(out)


__all__ = ["render_scene", "build_depth_scenes"]
