"""The CPU multi-crop path: the recipe's draws (:mod:`.crop_params`) rendered from one decode of the image.

Per image: the parameters are drawn on the full-size coordinates first; the JPEG is decoded once at the
largest DCT reduction (1/2, 1/4, 1/8) at which every crop's source region still covers its output size
(``MultiCropAugmentation.draft_request``, used by :func:`.decode.safe_decode`); each crop is resized from a
uint8 view of the decoded pixels (torchvision's uint8 antialiased bicubic kernel, channels-last), flipped,
then its photometric draws run on that small crop (:mod:`.photometric`). Crops leave as uint8 (3, S, S)
tensors: the collate stacks uint8 and the batch is normalised where it reaches the device
(:func:`normalize_batch`), a quarter of the bytes to pin and copy.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as TF

from . import crop_params as P
from .photometric import apply_row

CROP_KEYS = ("global_crops", "local_crops", "gram_crops")
"""Batch entries that hold images (uint8 ones are normalised by :func:`normalize_batch`)."""


def image_tensor(image: Any) -> Tensor:
    """A PIL image / HWC uint8 array -> (3, H, W) uint8 view in channels-last memory (no copy of the pixels
    beyond Pillow's own buffer); a CHW uint8 tensor is kept."""
    if torch.is_tensor(image):
        return image.as_subclass(Tensor)
    arr = np.asarray(image)
    if not arr.flags.writeable:  # Pillow's buffer is read-only; torch wants a writable one (one copy, 0.1 ms)
        arr = arr.copy()
    return torch.from_numpy(arr).permute(2, 0, 1)


def full_size(image: Any) -> tuple[int, int]:
    """(height, width) of the image as stored in the file: the draws' coordinates (a draft-decoded image
    carries its full size in ``info['full_size']`` = (w, h))."""
    info = getattr(image, "info", None)
    if info and "full_size" in info:
        w, h = info["full_size"]
        return int(h), int(w)
    if torch.is_tensor(image):
        return int(image.shape[-2]), int(image.shape[-1])
    if hasattr(image, "size") and not isinstance(image, np.ndarray):
        w, h = image.size
        return int(h), int(w)
    return int(image.shape[0]), int(image.shape[1])


def _box(row, sy: float, sx: float, h: int, w: int) -> tuple[int, int, int, int]:
    """The crop box in the decoded image's pixels (full-size box when the image was decoded at full size)."""
    t, l, ch, cw = (int(v) for v in row[P.TOP:P.WIDTH + 1])
    if sy == 1.0 and sx == 1.0:
        return t, l, ch, cw
    t2, l2 = int(round(t * sy)), int(round(l * sx))
    ch2, cw2 = max(1, int(round(ch * sy))), max(1, int(round(cw * sx)))
    return min(t2, h - ch2), min(l2, w - cw2), min(ch2, h), min(cw2, w)


def render(image: Any, rows: np.ndarray, sizes: Sequence[int], full: tuple[int, int]) -> list[Tensor]:
    """Each row's crop of ``image`` as a uint8 (3, S, S) tensor. ``full``: (H, W) the rows were drawn on."""
    x = image_tensor(image)
    h, w = x.shape[-2:]
    sy, sx = h / full[0], w / full[1]
    subpixel = (sy != 1.0 or sx != 1.0) and isinstance(image, Image.Image)
    out = []
    for row, size in zip(rows, sizes):
        if subpixel:  # a reduced decode: the full-size box falls between pixels; Pillow resamples a float box
            t, l, ch, cw = (float(v) for v in row[P.TOP:P.WIDTH + 1])
            box = (l * sx, t * sy, (l + cw) * sx, (t + ch) * sy)
            c = image_tensor(image.resize((size, size), Image.BICUBIC, box=box))
        else:
            t, l, ch, cw = _box(row, sy, sx, h, w)
            c = TF.resized_crop(x, t, l, ch, cw, [size, size], interpolation=InterpolationMode.BICUBIC,
                                antialias=True)
        if row[P.FLIP]:
            c = c.flip(-1)
        if row[P.JITTER] or row[P.GREY] or row[P.BLUR] or row[P.SOLARIZE]:
            c = apply_row(c.unsqueeze(0).float(), row)[0].to(torch.uint8)
        out.append(c.contiguous())
    return out


@functools.lru_cache(maxsize=16)
def _affine(mean: tuple, std: tuple, device: torch.device) -> tuple[Tensor, Tensor]:
    """(-mean / std, 1 / (255 std)) as (C, 1, 1) tensors on ``device``, made once (no copy per batch)."""
    m = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
    return (-m / s).to(device), (1.0 / (255.0 * s)).to(device)


def normalize_uint8(x: Tensor, mean: Sequence[float], std: Sequence[float],
                    dtype: torch.dtype = torch.float32) -> Tensor:
    """uint8 (..., C, H, W) -> (x / 255 - mean) / std in ``dtype`` (one fused multiply-add per pixel)."""
    shift, scale = _affine(tuple(mean), tuple(std), x.device)
    return torch.addcmul(shift, x.float(), scale).to(dtype)


def normalize_batch(batch: dict, device: Optional[torch.device] = None, mean: Sequence[float] = (),
                    std: Sequence[float] = ()) -> dict:
    """The batch's uint8 crops moved to ``device`` and normalised there (float32); other crops (already
    float: N-channel input, the Gram path) and other entries are moved only. The one place a uint8 batch
    becomes the model's input (the training loader's device stage calls it)."""
    out = dict(batch)
    for key in CROP_KEYS:
        t = out.get(key)
        if torch.is_tensor(t):
            t = t.to(device, non_blocking=True) if device is not None else t
            out[key] = normalize_uint8(t, mean, std) if t.dtype == torch.uint8 else t
    return out


__all__ = ["render", "image_tensor", "full_size", "normalize_uint8", "normalize_batch", "CROP_KEYS"]
