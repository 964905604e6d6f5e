"""N-channel sample images made offline from the real photos of :mod:`.samples` (never noise): per-band
renderings of each photo, written as 16-bit TIFF or float32 ``.npy`` tiles, for tests, benches and the
multi-channel example (docs/multichannel.md).

Bands, in order (a pool of N channels takes the first N; N = 1 takes grey alone): red, green, blue, grey
(Rec. 601 luma), hue, saturation, value, the three pairwise means (R+G, G+B, R+B), grey squared, the square
root of grey, the grey gradient magnitude (Sobel), and the three inverted colours. Channels are as registered
as a multispectral sensor's bands: the same scene, different responses.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

from .samples import _random_view, real_photos

BAND_NAMES = ("red", "green", "blue", "grey", "hue", "saturation", "value", "rg", "gb", "rb", "grey2",
              "sqrt_grey", "edges", "inv_red", "inv_green", "inv_blue")
FORMATS = ("tiff16", "npy")


def bands(rgb: np.ndarray, channels: int) -> np.ndarray:
    """(H, W, 3) uint8 photo -> (H, W, channels) float32 bands in [0, 1] (module docstring)."""
    from scipy import ndimage
    from skimage.color import rgb2hsv

    if not 1 <= channels <= len(BAND_NAMES):
        raise ValueError(f"channels must be 1-{len(BAND_NAMES)}, got {channels}")
    x = rgb.astype(np.float32) / 255.0
    r, g, b = x[..., 0], x[..., 1], x[..., 2]
    grey = 0.299 * r + 0.587 * g + 0.114 * b
    if channels == 1:
        return grey[..., None]
    hsv = rgb2hsv(x).astype(np.float32)
    edges = np.hypot(ndimage.sobel(grey, 0), ndimage.sobel(grey, 1))
    edges = edges / max(float(edges.max()), 1e-6)
    out = [r, g, b, grey, hsv[..., 0], hsv[..., 1], hsv[..., 2], (r + g) / 2, (g + b) / 2, (r + b) / 2,
           grey * grey, np.sqrt(grey), edges, 1 - r, 1 - g, 1 - b]
    return np.stack(out[:channels], axis=-1).astype(np.float32)


def encode_tile(arr: np.ndarray, fmt: str) -> bytes:
    """(H, W, C) float bands in [0, 1] -> bytes of a 16-bit TIFF (channels last, interleaved) or a float32 .npy."""
    buf = io.BytesIO()
    if fmt == "tiff16":
        import tifffile

        data = np.clip(np.rint(arr * 65535.0), 0, 65535).astype(np.uint16)
        if data.shape[-1] == 1:
            tifffile.imwrite(buf, data[..., 0], photometric="minisblack")
        else:
            tifffile.imwrite(buf, data, photometric="minisblack", planarconfig="contig")
    elif fmt == "npy":
        np.save(buf, arr.astype(np.float32), allow_pickle=False)
    else:
        raise ValueError(f"format must be one of {FORMATS}, got '{fmt}'")
    return buf.getvalue()


def extension(fmt: str) -> str:
    return "tif" if fmt == "tiff16" else "npy"


def build_multichannel_pool(out_dir: str | os.PathLike, channels: int = 4, n_images: int = 120, size: int = 96,
                            fmt: str = "tiff16", seed: int = 0) -> str:
    """``n_images`` random views of the photos as ``channels``-band tiles in ``out_dir`` (returns it)."""
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    photos = real_photos()
    names = sorted(photos)
    rng = np.random.default_rng(seed)
    for i in range(n_images):
        name = names[i % len(names)]
        view = _random_view(photos[name], rng, size)
        (root / f"{name}_{i:05d}.{extension(fmt)}").write_bytes(encode_tile(bands(view, channels), fmt))
    return str(root)


def build_multichannel_eval_set(out_dir: str | os.PathLike, channels: int = 4, n_train: int = 8, n_val: int = 4,
                                size: int = 112, fmt: str = "tiff16", seed: int = 1) -> dict:
    """The labelled instance-retrieval set of :func:`.samples.build_eval_set` (class = source photo) as
    ``channels``-band tiles: ``out_dir/{train,val}/<photo>/*.tif|npy``."""
    root = Path(out_dir)
    photos = real_photos()
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("val", n_val)):
        for name in sorted(photos):
            d = root / split / name
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                view = _random_view(photos[name], rng, size)
                (d / f"{i:03d}.{extension(fmt)}").write_bytes(encode_tile(bands(view, channels), fmt))
    return {"train": str(root / "train"), "val": str(root / "val"), "classes": len(photos)}


__all__ = ["BAND_NAMES", "FORMATS", "bands", "encode_tile", "build_multichannel_pool", "build_multichannel_eval_set"]
