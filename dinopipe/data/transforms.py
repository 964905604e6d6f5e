"""Multi-crop augmentation (Caron et al. 2020, SwAV; DINO; DINOv2 ``DataAugmentationDINO``) with
torchvision.transforms.v2, and the collate function that batches crops and draws iBOT masks.

Per image: 2 global crops (224 px, scale 0.32-1) and ``n_local`` local crops (98 px, scale 0.05-0.32), each
flipped, colour-jittered (p=0.8), greyscaled (p=0.2) and blurred, plus solarisation (p=0.2) on global crop 2,
then ImageNet normalisation.

Blur, ``blur="released"`` (the default): what the released DINOv2 / DINOv3 code does. Its ``GaussianBlur(p)``
passes ``1 - p`` to ``RandomApply`` (which takes the probability of *applying*), so global crop 1 is never
blurred, global crop 2 is blurred with p=0.9 and local crops with p=0.5 (dinov2 ``data/transforms.py:12-21``,
``data/augmentations.py:73-82``; dinov3 ``data/transforms.py:25-28``). ``blur="paper"``: the papers' (and DINO /
BYOL's) wording, global crop 1 always, global crop 2 with p=0.1. ``horizontal_flip=False`` drops the flips
(DINOv3's ViT-7B config, ``dinov3_vit7b16_pretrain.yaml``).
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch import Tensor
from torchvision.transforms import v2

from ..utils.norm import IMAGENET_MEAN, IMAGENET_STD
from ..utils.masks import mask_token_weights
from . import crop_params
from .fast_crops import full_size, normalize_uint8, render
from .masking import MaskingGenerator, masks_upperbound, sample_masks



BLUR_PROBABILITIES = {"released": (0.0, 0.9), "paper": (1.0, 0.1)}
"""Probability of blurring (global crop 1, global crop 2); local crops: 0.5 in both."""


class ChannelBrightnessContrast(torch.nn.Module):
    """Per-channel brightness and contrast for N-channel float images (C, H, W): each channel is scaled by its
    own factor in [1 - brightness, 1 + brightness], then its deviation from its mean by one in
    [1 - contrast, 1 + contrast]. No clipping: float channels carry physical units, not a [0, 1] range."""

    def __init__(self, brightness: float = 0.4, contrast: float = 0.4) -> None:
        super().__init__()
        self.brightness, self.contrast = brightness, contrast

    def forward(self, x: Tensor) -> Tensor:
        c = x.shape[-3]
        b = 1.0 + (torch.rand(c, 1, 1) * 2 - 1) * self.brightness  # (C, 1, 1)
        k = 1.0 + (torch.rand(c, 1, 1) * 2 - 1) * self.contrast
        y = x * b
        mean = y.mean(dim=(-2, -1), keepdim=True)
        return (y - mean) * k + mean

    def extra_repr(self) -> str:
        return f"brightness={self.brightness}, contrast={self.contrast}"


def _blur(p: float) -> v2.Transform:
    # DINOv2 / DINO: 9-px kernel, sigma uniform in [0.1, 2]. RandomApply's p is the probability of blurring.
    return v2.RandomApply([v2.GaussianBlur(kernel_size=9, sigma=(0.1, 2.0))], p=p)


class MultiCropAugmentation:
    """PIL image (or uint8 CHW tensor / HWC array) -> {"global_crops": [t, t], "local_crops": [t] * n_local},
    float32 tensors (3, S, S), normalised.

    N-channel images (``channels``, ``float_input=True``): a float (C, H, W) tensor from
    :func:`.channels.decode_channels`; the same crops, flips and blur (per channel), per-channel brightness /
    contrast in place of colour jitter and greyscale and no solarisation unless C == 3, and normalisation by
    the given per-channel ``mean`` / ``std``.

    ``__call__(image, seed=...)`` is reproducible: the torch RNG is forked and seeded for that call only
    (torchvision's v2 transforms draw from torch's global generator). Without a seed the global stream is used.

    RGB images take the fast path (``fast=True``, :mod:`.fast_crops`): the same draws from the same seed
    (:mod:`.crop_params`), rendered from one (possibly reduced-scale, ``draft_request``) decode with uint8
    kernels; ``uint8_output=True`` returns uint8 crops for :func:`.fast_crops.normalize_batch` to normalise on
    the device (the training loader's path). ``fast=False`` keeps the torchvision v2 pipelines (the reference).
    """

    def __init__(
        self,
        global_size: int = 224,
        local_size: int = 98,
        n_local: int = 8,
        global_scale: Sequence[float] = (0.32, 1.0),
        local_scale: Sequence[float] = (0.05, 0.32),
        blur: str = "released",
        global1_blur_p: Optional[float] = None,
        global2_blur_p: Optional[float] = None,
        local_blur_p: float = 0.5,
        solarize_p: float = 0.2,
        color_jitter_p: float = 0.8,
        grayscale_p: float = 0.2,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        horizontal_flip: bool = True,
        channels: int = 3,
        float_input: bool = False,
        fast: bool = True,
        uint8_output: bool = False,
    ) -> None:
        if float_input is False and channels != 3:
            raise ValueError(f"{channels}-channel images come as float (C, H, W) tensors: pass float_input=True")
        if len(mean) != channels or len(std) != channels:
            raise ValueError(f"need {channels} per-channel mean and std values, got {len(mean)} and {len(std)}")
        self.channels, self.float_input = channels, float_input
        self.global_size, self.local_size, self.n_local = global_size, local_size, n_local
        if blur not in BLUR_PROBABILITIES:
            raise ValueError(f"blur must be one of {sorted(BLUR_PROBABILITIES)}, got '{blur}'")
        # Explicit probabilities (of blurring) override the named recipe's.
        g1, g2 = BLUR_PROBABILITIES[blur]
        global1_blur_p = g1 if global1_blur_p is None else global1_blur_p
        global2_blur_p = g2 if global2_blur_p is None else global2_blur_p
        flip = [v2.RandomHorizontalFlip(p=0.5)] if horizontal_flip else []
        self.horizontal_flip = horizontal_flip
        self.n_geometric = 2 + len(flip)  # crop, [flip], ToImage: where the photometric steps start

        def geometric(size: int, scale: Sequence[float]) -> list[v2.Transform]:
            return [
                v2.RandomResizedCrop(size, scale=tuple(scale), interpolation=v2.InterpolationMode.BICUBIC,
                                     antialias=True),
                *flip,
                v2.ToImage(),  # uint8 tensor from here on: photometric ops run on the small crop
            ]

        if channels == 3:  # colour jitter, greyscale and solarisation mean something only for RGB
            colour = [
                v2.RandomApply([v2.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.2, hue=0.1)],
                               p=color_jitter_p),
                v2.RandomGrayscale(p=grayscale_p),
            ]
        else:
            colour = [v2.RandomApply([ChannelBrightnessContrast(0.4, 0.4)], p=color_jitter_p)]
        # Float input (npy / TIFF, channels.py) is on a [0, 1] scale for integer files: solarise at its middle.
        solarize = [v2.RandomSolarize(threshold=0.5 if float_input else 128, p=solarize_p)] if channels == 3 else []
        normalize = [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean=list(mean), std=list(std))]
        self.global1 = v2.Compose(geometric(global_size, global_scale) + colour + [_blur(global1_blur_p)] + normalize)
        self.global2 = v2.Compose(
            geometric(global_size, global_scale) + colour
            + [_blur(global2_blur_p)] + solarize  # threshold on uint8 (or the float scale's middle)
            + normalize
        )
        self.local = v2.Compose(geometric(local_size, local_scale) + colour + [_blur(local_blur_p)] + normalize)
        self.recipe = crop_params.dinov2_recipe(
            global_size, local_size, n_local, global_scale, local_scale, (global1_blur_p, global2_blur_p, local_blur_p),
            solarize_p, horizontal_flip, color_jitter_p, grayscale_p)
        # Subclasses with their own crops (GramCropAugmentation) keep the v2 pipelines.
        self.fast = fast and channels == 3 and not float_input and type(self)._crops is MultiCropAugmentation._crops
        self.uint8_output = uint8_output and self.fast
        self.draft = True  # reduced-scale JPEG decoding when every crop allows it (bench/bench_input.py toggles it)
        self.mean, self.std = tuple(mean), tuple(std)
        self._rows_cache: Optional[tuple[tuple[int, int, int], np.ndarray]] = None

    def __repr__(self) -> str:
        return (f"MultiCropAugmentation(global_size={self.global_size}, local_size={self.local_size}, "
                f"n_local={self.n_local})\n  global1={self.global1}\n  global2={self.global2}\n  local={self.local}")

    def _crops(self, image: Any) -> dict[str, list[Tensor]]:
        if self.float_input:
            if not torch.is_tensor(image) or image.ndim != 3 or image.shape[0] != self.channels:
                raise ValueError(f"expected a float ({self.channels}, H, W) tensor (channels.decode_channels), got "
                                 f"{getattr(image, 'shape', type(image).__name__)}")
        elif hasattr(image, "mode") and image.mode != "RGB":  # PIL: palette, greyscale, RGBA, CMYK...
            image = image.convert("RGB")
        elif isinstance(image, np.ndarray):  # HWC uint8
            image = v2.functional.to_image(image)
        return {
            "global_crops": [self._plain(self.global1(image)), self._plain(self.global2(image))],
            "local_crops": [self._plain(self.local(image)) for _ in range(self.n_local)],
        }

    @staticmethod
    def _plain(t: Tensor) -> Tensor:
        return t.as_subclass(Tensor)  # tv_tensors.Image -> plain tensor (cheaper to collate and pin)

    def params(self, seed: int, height: int, width: int) -> np.ndarray:
        """The sample's draws (crop_params rows) on a full-size ``height`` x ``width`` image."""
        key = (int(seed), int(height), int(width))
        if self._rows_cache is None or self._rows_cache[0] != key:
            self._rows_cache = (key, crop_params.draw(self.recipe, seed, height, width))
        return self._rows_cache[1]

    def draft_request(self, size: tuple[int, int], seed: int) -> Optional[tuple[int, int]]:
        """The size (w, h) to ask Pillow's JPEG ``draft`` for, for a full-size (w, h) image; None: full size."""
        if not (self.fast and self.draft):
            return None
        w, h = size
        s = crop_params.draft_scale(self.recipe, self.params(seed, h, w))
        return (w // s, h // s) if s > 1 else None

    def _fast_crops(self, image: Any, seed: int) -> dict[str, list[Tensor]]:
        if hasattr(image, "mode") and image.mode != "RGB":
            image = image.convert("RGB")
        full = full_size(image)
        crops = render(image, self.params(seed, *full), self.recipe.sizes, full)
        if not self.uint8_output:
            crops = [normalize_uint8(c, self.mean, self.std) for c in crops]
        return {"global_crops": crops[:2], "local_crops": crops[2:]}

    def __call__(self, image: Any, seed: Optional[int] = None) -> dict[str, list[Tensor]]:
        if self.fast:
            return self._fast_crops(image, int(torch.randint(2**62, (1,))) if seed is None else seed)
        if seed is None:
            return self._crops(image)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self._crops(image)


class MultiCropCollator:
    """Batch multi-crop samples and draw the iBOT masks (DINOv2's ``collate_data_and_cast``).

    Samples are the augmentation's dicts, or tuples whose first element is one (``(crops, label)``); extra
    keys of a dict sample (``id``...) are gathered into lists. Crops are stacked crop-major: all samples'
    crop 0, then all samples' crop 1, ... Returns

    * ``global_crops`` (n_g * B, 3, G, G), ``local_crops`` (n_l * B, 3, L, L) (None without local crops),
    * ``masks`` (n_g * B, N) bool over the global crops' patch grid (N = (G / patch_size)**2),
    * ``mask_indices`` (M,) positions of the masked patches in ``masks.flatten()``,
    * ``masks_weight`` (M,) 1 / (masked patches in that image), ``n_masked_patches`` (1,) long,
    * ``upperbound`` the most patches this batch shape could mask (for fixed-size buffers).

    The mask grid follows the crops' actual size, so a resolution change needs no new collator. Mask
    randomness: ``rng`` per call, else the collator's own generator, seeded from ``seed`` and the data-loader
    worker id (or from torch's per-worker seed when ``seed`` is None), so workers never repeat each other.
    """

    def __init__(
        self,
        patch_size: int,
        mask_ratio_min_max: tuple[float, float] = (0.1, 0.5),
        mask_probability: float = 0.5,
        min_num_patches: int = 4,
        max_block_fraction: float = 0.5,
        dtype: Optional[torch.dtype] = None,
        seed: Optional[int] = None,
    ) -> None:
        self.patch_size = patch_size
        self.mask_ratio_min_max = tuple(mask_ratio_min_max)
        self.mask_probability = mask_probability
        self.min_num_patches = min_num_patches
        self.max_block_fraction = max_block_fraction  # DINOv2: a single block covers at most half the grid
        self.dtype = dtype
        self.seed = seed
        self._generators: dict[tuple[int, int], MaskingGenerator] = {}
        self._rng: Optional[tuple[int, np.random.Generator]] = None

    def _default_rng(self) -> np.random.Generator:
        # Created lazily in the process that collates (a worker gets a pickled copy of the collator; keying
        # on the pid stops a generator made in the parent from being replayed identically by every worker).
        if self._rng is None or self._rng[0] != os.getpid():
            info = torch.utils.data.get_worker_info()
            worker = info.id if info is not None else 0
            base = self.seed if self.seed is not None else torch.initial_seed()
            self._rng = (os.getpid(), np.random.default_rng([int(base) % 2**63, worker]))
        return self._rng[1]

    def mask_generator(self, grid: tuple[int, int]) -> MaskingGenerator:
        if grid not in self._generators:
            self._generators[grid] = MaskingGenerator(
                grid, min_num_patches=self.min_num_patches, max_num_patches=self.max_block_fraction * grid[0] * grid[1]
            )
        return self._generators[grid]

    def masks(self, n_images: int, h: int, w: int, rng: Optional[np.random.Generator] = None) -> dict[str, Any]:
        """The iBOT masks of ``n_images`` global crops of h x w pixels (and their indices, weights, counts)."""
        if h % self.patch_size or w % self.patch_size:
            raise ValueError(f"global crops {h}x{w} are not a multiple of the patch size {self.patch_size}")
        gen = self.mask_generator((h // self.patch_size, w // self.patch_size))
        masks = sample_masks(gen, n_images, self.mask_ratio_min_max, self.mask_probability,
                             rng=self._default_rng() if rng is None else rng)
        mask_indices = masks.flatten().nonzero().flatten()
        return {
            "masks": masks,
            "mask_indices": mask_indices,
            "masks_weight": mask_token_weights(masks),
            "n_masked_patches": torch.tensor([mask_indices.numel()], dtype=torch.long),
            "upperbound": masks_upperbound(n_images, gen.num_patches, self.mask_ratio_min_max, self.mask_probability),
        }

    def __call__(self, samples: Sequence[Any], rng: Optional[np.random.Generator] = None) -> dict[str, Any]:
        if not samples:
            raise ValueError("cannot collate an empty batch")
        dicts = [s[0] if isinstance(s, (tuple, list)) else s for s in samples]
        n_g, n_l = len(dicts[0]["global_crops"]), len(dicts[0]["local_crops"])
        # uint8 crops stay uint8 (normalised on the device: fast_crops.normalize_batch)
        cast = (lambda t: t.to(self.dtype) if t.is_floating_point() else t) if self.dtype is not None else (lambda t: t)
        global_crops = cast(torch.stack([d["global_crops"][i] for i in range(n_g) for d in dicts]))
        local_crops = cast(torch.stack([d["local_crops"][i] for i in range(n_l) for d in dicts])) if n_l else None

        h, w = global_crops.shape[-2:]
        out: dict[str, Any] = {"global_crops": global_crops, "local_crops": local_crops}
        out.update(self.masks(global_crops.shape[0], h, w, rng))
        for key in dicts[0]:
            if key not in ("global_crops", "local_crops") and key not in out:
                out[key] = [d.get(key) for d in dicts]
        if isinstance(samples[0], (tuple, list)) and len(samples[0]) > 1:
            out["targets"] = [s[1] for s in samples]
        return out


def eval_crop_size(img_size: int, patch_size: int) -> int:
    """The largest multiple of the patch size not above ``img_size`` (at least one patch)."""
    return max(patch_size, img_size // patch_size * patch_size)


def eval_transform(crop: int = 224, resize_ratio: float = 256 / 224, mean: Sequence[float] = IMAGENET_MEAN,
                   std: Sequence[float] = IMAGENET_STD) -> v2.Compose:
    """DINOv2's eval preprocessing: resize the shorter side to ``crop * resize_ratio`` (bicubic), centre crop,
    ImageNet normalisation -> float32 (3, crop, crop). Used by the kNN / linear evals and by curation's
    embedder. A PIL image is resized and cropped by PIL (what DINOv2's torchvision-v1 evals did, so
    embeddings match theirs); ``ToImage`` comes after, so a uint8 tensor input works too, and so does an
    N-channel float (C, H, W) tensor (channels.decode_channels) with that many ``mean`` / ``std`` values."""
    return v2.Compose([
        v2.Resize(int(round(crop * resize_ratio)), interpolation=v2.InterpolationMode.BICUBIC, antialias=True),
        v2.CenterCrop(crop),
        v2.ToImage(),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(list(mean), list(std)),
    ])


__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "MultiCropAugmentation", "MultiCropCollator", "eval_transform",
           "eval_crop_size", "BLUR_PROBABILITIES", "ChannelBrightnessContrast"]
