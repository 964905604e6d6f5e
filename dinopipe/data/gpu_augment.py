"""The GPU augmentation path (``data.augment_on: gpu``): the host reads bytes only, the device decodes and crops.

Host (data workers): :class:`EncodedCrops` reads a JPEG's header (its size and EXIF orientation), draws the
sample's parameter rows from its seed exactly as the CPU path does (:mod:`.crop_params`), and hands over the
file's bytes with them; :class:`EncodedCollator` batches bytes, rows and the iBOT masks. Images that are not
JPEG (PNG, WebP, npy...) are decoded on the host by ``safe_decode`` and travel as pixels.

Device (the training process, :class:`GpuMultiCrop`, run by :class:`.device_stage.DeviceStage`): one batched
``torchvision.io.decode_jpeg(list, device=...)`` (nvJPEG on CUDA), then per crop the same antialiased bicubic
resampling of the drawn box as the CPU path, the flips, and the photometric draws of each crop group in one
batch (:func:`.photometric.apply_rows`). Same (seed, epoch, sample) -> same draws on both paths, so a run may
switch paths and keep its data order; the pixels agree to within decoder and rounding differences (tests run
the tensor code on the CPU device).
"""

from __future__ import annotations

import io
import logging
import warnings
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from . import crop_params as CP
from .decode import DEFAULT_MAX_PIXELS, NOT_AN_IMAGE, TOO_LARGE, TRUNCATED, safe_decode
from .photometric import apply_rows
from .transforms import MultiCropCollator

log = logging.getLogger(__name__)


def jpeg_header(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS
                ) -> tuple[Optional[tuple[int, int, int]], Optional[str]]:
    """((height, width) upright + EXIF orientation, None) of an RGB or greyscale JPEG, (None, None) for any
    other readable image (decode it on the host), or (None, reason) for bytes no image reader accepts."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            if w * h > max_pixels:
                return None, TOO_LARGE
            if img.format != "JPEG" or img.mode not in ("RGB", "L"):
                return None, None
            orient = int(img.getexif().get(0x0112, 1))
    except Image.DecompressionBombError:
        return None, TOO_LARGE
    except Exception:
        return None, NOT_AN_IMAGE if data else TRUNCATED
    orient = orient if 1 <= orient <= 8 else 1
    return ((w, h, orient) if orient in (5, 6, 7, 8) else (h, w, orient)), None


def exif_orient(x: Tensor, orient: int) -> Tensor:
    """A (C, H, W) image as stored -> upright, for EXIF orientation 1-8 (Pillow's exif_transpose; the CUDA
    decoder ignores ``apply_exif_orientation``, so the device path applies it itself on every device)."""
    if orient == 2:
        return x.flip(-1)
    if orient == 3:
        return x.flip((-2, -1))
    if orient == 4:
        return x.flip(-2)
    if orient == 5:
        return x.transpose(-2, -1)
    if orient == 6:
        return torch.rot90(x, -1, dims=(-2, -1))
    if orient == 7:
        return x.transpose(-2, -1).flip((-2, -1))
    if orient == 8:
        return torch.rot90(x, 1, dims=(-2, -1))
    return x


class EncodedCrops:
    """Host side of the GPU path: (bytes, seed) -> {"encoded" | "pixels", "params", "size"} (or a corrupt
    marker). ``recipe``: the augmentation's :class:`.crop_params.Recipe` (``MultiCropAugmentation.recipe``)."""

    takes_bytes = True

    def __init__(self, recipe: CP.Recipe, mean: Sequence[float], std: Sequence[float]) -> None:
        self.recipe, self.mean, self.std = recipe, tuple(mean), tuple(std)

    def from_bytes(self, data: Optional[bytes], seed: int) -> tuple[Optional[dict], Optional[str]]:
        if not data:
            return safe_decode(data)  # (None, reason)
        header, reason = jpeg_header(data)
        if reason is not None:
            return None, reason
        sample: dict[str, Any] = {"orient": 1}
        if header is None:  # not a JPEG the device decodes: pixels from the host's decoder
            img, reason = safe_decode(data)
            if img is None:
                return None, reason
            pixels = torch.from_numpy(np.array(img)).permute(2, 0, 1).contiguous()
            sample["pixels"], size = pixels, (img.height, img.width)
        else:
            size, sample["orient"] = header[:2], header[2]
            sample["encoded"] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        sample["params"] = torch.from_numpy(CP.draw(self.recipe, seed, *size))
        sample["size"] = size
        return sample, None


class EncodedCollator(MultiCropCollator):
    """Batches EncodedCrops samples: ``encoded`` (list of byte tensors or None), ``pixels`` (list), ``params``
    (B, n_crops, N_COLS), ``sizes``, and the iBOT masks of MultiCropCollator over the global crops' grid."""

    def __init__(self, patch_size: int, global_size: int, n_global: int = 2, **kwargs: Any) -> None:
        super().__init__(patch_size, **kwargs)
        self.global_size, self.n_global = global_size, n_global

    def __call__(self, samples: Sequence[Any], rng: Optional[np.random.Generator] = None) -> dict[str, Any]:
        if not samples:
            raise ValueError("cannot collate an empty batch")
        out = self.masks(self.n_global * len(samples), self.global_size, self.global_size, rng)
        out.update(encoded=[s.get("encoded") for s in samples], pixels=[s.get("pixels") for s in samples],
                   params=torch.stack([s["params"] for s in samples]), sizes=[s["size"] for s in samples],
                   orients=[s.get("orient", 1) for s in samples], global_crops=None, local_crops=None)
        for key in samples[0]:
            if key not in out and key not in ("encoded", "pixels", "params", "size", "orient"):
                out[key] = [s.get(key) for s in samples]
        return out


def decode_on(device: torch.device, encoded: list[Optional[Tensor]], pixels: list[Optional[Tensor]],
              orients: Optional[list[int]] = None) -> list[Tensor]:
    """(3, H, W) uint8 images on ``device``: the JPEGs in one batched decode_jpeg call (nvJPEG on CUDA), the
    host-decoded ones moved. A batch the batched call refuses is decoded one by one, then on the host."""
    from torchvision.io import ImageReadMode, decode_jpeg

    out: list[Optional[Tensor]] = [None if p is None else p.to(device, non_blocking=True) for p in pixels]
    todo = [i for i, e in enumerate(encoded) if e is not None]
    if todo:
        kw = dict(mode=ImageReadMode.RGB, device=device)
        try:
            for i, img in zip(todo, decode_jpeg([encoded[i] for i in todo], **kw)):
                out[i] = img
        except RuntimeError:
            for i in todo:
                try:
                    out[i] = decode_jpeg(encoded[i], **kw)
                except RuntimeError:  # decoded on the host (Pillow is more lenient), else a grey image
                    img, _ = safe_decode(encoded[i].numpy().tobytes())
                    out[i] = (torch.from_numpy(np.array(img)).permute(2, 0, 1).to(device) if img is not None
                              else torch.full((3, 16, 16), 128, dtype=torch.uint8, device=device))
                    if img is None:
                        log.warning("an image the host read could not be decoded; a grey image stands in")
                    continue  # Pillow already turned it upright
                out[i] = exif_orient(out[i], (orients or [1] * len(encoded))[i])  # type: ignore[arg-type]
            return out  # type: ignore[return-value]
        for i in todo:
            out[i] = exif_orient(out[i], (orients or [1] * len(encoded))[i])  # type: ignore[arg-type]
    return out  # type: ignore[return-value]


def crop_group(images: list[Tensor], rows: Tensor, size: int, sizes: list[tuple[int, int]]) -> Tensor:
    """(B, 3, size, size) float crops (integer values) of each image's drawn box, flipped as drawn."""
    crops = []
    for img, row, (fh, fw) in zip(images, rows.tolist(), sizes):
        h, w = img.shape[-2:]
        t, l, ch, cw = (int(v) for v in row[CP.TOP:CP.WIDTH + 1])
        if (h, w) != (fh, fw):  # not expected (the decoder applies the EXIF orientation): scale the box
            t, l = int(t * h / fh), int(l * w / fw)
            ch, cw = max(1, min(h - t, int(ch * h / fh))), max(1, min(w - l, int(cw * w / fw)))
        src = img[:, t:t + ch, l:l + cw].unsqueeze(0).float()
        crops.append(F.interpolate(src, size=(size, size), mode="bicubic", antialias=True, align_corners=False))
    x = torch.cat(crops).round_().clamp_(0, 255)
    flip = rows[:, CP.FLIP].to(x.device) > 0
    return torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)


class GpuMultiCrop:
    """Device side: a batch from EncodedCollator -> the same batch with uint8 ``global_crops`` (n_g * B, 3, G, G)
    and ``local_crops`` (n_l * B, 3, L, L), crop-major like MultiCropCollator's."""

    def __init__(self, recipe: CP.Recipe, device: torch.device) -> None:
        self.recipe, self.device = recipe, torch.device(device)

    def __call__(self, batch: dict) -> dict:
        images = decode_on(self.device, batch["encoded"], batch["pixels"], batch.get("orients"))
        params = batch["params"]  # (B, n_crops, N_COLS) on the host: boxes are read there
        groups = []
        for k, spec in enumerate(self.recipe.crops):
            x = crop_group(images, params[:, k], spec.size, batch["sizes"])
            groups.append(apply_rows(x, params[:, k]).to(torch.uint8))  # rows stay on the host
        n_g = self.recipe.n_global
        out = {k: v for k, v in batch.items() if k not in ("encoded", "pixels", "params", "sizes", "orients")}
        out["global_crops"] = torch.cat(groups[:n_g])
        out["local_crops"] = torch.cat(groups[n_g:]) if len(groups) > n_g else None
        return out


def resolve_augment_on(choice: str, device: torch.device) -> str:
    """cpu | gpu for a config's ``data.augment_on`` (auto: gpu when the training device is CUDA)."""
    choice = str(choice)
    if choice == "auto":
        return "gpu" if torch.device(device).type == "cuda" else "cpu"
    return choice


__all__ = ["EncodedCrops", "EncodedCollator", "GpuMultiCrop", "decode_on", "crop_group", "jpeg_header", "exif_orient",
           "resolve_augment_on"]
