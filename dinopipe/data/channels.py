"""N-channel images (multispectral, fluorescence microscopy, 16-bit and float sensors): reading, the 3-channel
rendering that curation's hash and pixel checks see, and per-channel normalisation statistics.

Readers, by the file's first bytes (not its name): ``.npy`` through ``np.load(allow_pickle=False)`` (an object
array is refused, never unpickled), TIFF through tifffile (any sample count, 8/16/32-bit integer or float,
one page per band or interleaved), everything else through Pillow (:func:`.decode.safe_decode`). An array is
taken as (H, W), (H, W, C) or (C, H, W): the axis of length ``channels`` (the last one first); without a
channel count the shorter of the first and last axes, when it is at most :data:`MAX_CHANNELS`.

A TIFF's orientation tag (274: how a camera's sensor rows map to the upright picture) is applied, as Pillow's
``ImageOps.exif_transpose`` applies a JPEG's EXIF orientation (:func:`upright`).

Value scale (the one the statistics and the augmentations see): unsigned integers divided by their type's
maximum (8-bit /255, 16-bit /65535), so 16-bit data keeps its full precision in [0, 1]; floats as stored.

The 3-channel rendering (:func:`render_rgb`, used for perceptual hashes, copy verification, the copy descriptor
and report thumbnails of an N-channel pool): channels 1-3 as R, G, B when there are at least three, else
the mean of the channels as grey; each on the value scale above, mapped to 8 bits (floats outside [0, 1]:
the image's own min-max over the rendered channels).
"""

from __future__ import annotations

from typing import Iterable, Optional

import numpy as np

# the readers are a leaf module (decode.py uses them too); their public home stays here
from .arrays import (MAX_CHANNELS, NPY_MAGIC, TIFF_MAGICS, WRONG_CHANNELS, ArrayTooLarge, is_npy, is_tiff,
                     read_array, read_npy, read_tiff, render_rgb, to_float, to_hwc, upright)
from . import decode as d


def decode_channels(data: Optional[bytes], channels: int, max_pixels: Optional[int] = None):
    """Bytes -> ``(tensor (C, H, W) float32 on the value scale, None)`` or ``(None, reason)``; never raises.

    npy / TIFF through their readers; other formats through Pillow (:func:`.decode.safe_decode`), as RGB for
    3 channels and as grey for 1 (any other count needs an npy or TIFF file). A file with another channel
    count is ``wrong_channels``."""
    import torch

    max_pixels = max_pixels or d.DEFAULT_MAX_PIXELS
    if data is None:
        return None, d.READ_ERROR
    if len(data) == 0:
        return None, d.EMPTY
    arr = None
    if is_npy(data) or is_tiff(data):
        try:
            arr = read_array(data, max_pixels)
        except (ArrayTooLarge, MemoryError):
            return None, d.TOO_LARGE
        except Exception:  # damaged npy; a TIFF tifffile cannot read goes to Pillow below
            if is_npy(data):
                return None, d.TRUNCATED
    if arr is None:
        img, reason = d.safe_decode(data, max_pixels=max_pixels)
        if img is None:
            return None, reason
        arr = np.asarray(img.convert("L") if channels == 1 else img)
    try:
        hwc = to_hwc(arr, channels)
        x = to_float(hwc)
    except ValueError:
        return None, WRONG_CHANNELS
    return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1))), None


def channel_stats(images: Iterable[Optional[bytes]], channels: int,
                  max_pixels_per_image: int = 1 << 18) -> tuple[list[float], list[float], int, int]:
    """Per-channel (mean, std, images used, images skipped) over the given files' bytes, on the value scale.

    Each image contributes at most ``max_pixels_per_image`` pixels (a regular subsample), so one huge tile
    does not outweigh the rest; sums are accumulated in float64."""
    total = np.zeros(channels, np.float64)
    total_sq = np.zeros(channels, np.float64)
    count, used, skipped = 0, 0, 0
    for data in images:
        x, reason = decode_channels(data, channels)
        if x is None:
            skipped += 1
            continue
        flat = x.reshape(channels, -1).numpy().astype(np.float64)
        step = max(1, flat.shape[1] // max_pixels_per_image)
        flat = flat[:, ::step]
        total += flat.sum(1)
        total_sq += (flat * flat).sum(1)
        count += flat.shape[1]
        used += 1
    if used == 0:
        raise ValueError(f"none of the images could be read as {channels}-channel images")
    mean = total / count
    std = np.sqrt(np.maximum(total_sq / count - mean * mean, 0.0))
    std = np.where(std > 1e-8, std, 1.0)  # a constant channel: leave its scale alone rather than divide by 0
    return [float(v) for v in mean], [float(v) for v in std], used, skipped


__all__ = ["MAX_CHANNELS", "WRONG_CHANNELS", "decode_channels", "render_rgb", "channel_stats", "read_array",
           "to_hwc", "to_float", "is_npy", "is_tiff", "upright", "ArrayTooLarge", "NPY_MAGIC", "TIFF_MAGICS",
           "read_npy", "read_tiff"]
