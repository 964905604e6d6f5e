"""Block-wise patch masking for iBOT (Zhou et al. 2022), the BEiT generator (Bao et al. 2022) as DINOv2 uses it.

Rectangular blocks of at least ``min_num_patches`` patches with a log-uniform aspect ratio in
[0.3, 1/0.3] are added until the requested number of patches is masked. A block never adds more than the
patches still wanted, so the count never exceeds the request; after 10 failed placements in a row the
generator stops, so it can fall slightly short (as the original does).

Randomness comes from a ``numpy.random.Generator`` passed per call (or owned by the generator), so masks are
reproducible from a seed and independent of Python's global ``random`` state.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
from torch import Tensor


class MaskingGenerator:
    def __init__(
        self,
        input_size: int | tuple[int, int],
        num_masking_patches: Optional[int] = None,
        min_num_patches: int = 4,
        max_num_patches: Optional[float] = None,
        min_aspect: float = 0.3,
        max_aspect: Optional[float] = None,
        seed: Optional[int] = None,
    ) -> None:
        """``input_size``: the patch grid (h, w). ``num_masking_patches``: default count for ``__call__``.
        ``max_num_patches``: largest single block (default: the requested count)."""
        self.height, self.width = (input_size, input_size) if isinstance(input_size, int) else tuple(input_size)
        self.num_patches = self.height * self.width
        self.num_masking_patches = num_masking_patches
        self.min_num_patches = min_num_patches
        self.max_num_patches = max_num_patches
        max_aspect = max_aspect or 1.0 / min_aspect
        self.log_aspect_ratio = (math.log(min_aspect), math.log(max_aspect))
        self.rng = np.random.default_rng(seed)

    def __repr__(self) -> str:
        return (f"MaskingGenerator(grid=({self.height}, {self.width}), min_num_patches={self.min_num_patches}, "
                f"max_num_patches={self.max_num_patches}, log_aspect_ratio={self.log_aspect_ratio})")

    def get_shape(self) -> tuple[int, int]:
        return self.height, self.width

    def _add_block(self, mask: np.ndarray, max_mask_patches: float, rng: np.random.Generator) -> int:
        """Try (up to 10 times) to place one rectangle adding 1..max_mask_patches new patches; return how many."""
        for _ in range(10):
            # Like Python's random.uniform, also when fewer than min_num_patches remain (high < low).
            target_area = self.min_num_patches + (max_mask_patches - self.min_num_patches) * rng.random()
            aspect_ratio = math.exp(rng.uniform(*self.log_aspect_ratio))
            h = int(round(math.sqrt(target_area * aspect_ratio)))
            w = int(round(math.sqrt(target_area / aspect_ratio)))
            if 0 < w < self.width and 0 < h < self.height:
                top = int(rng.integers(0, self.height - h + 1))
                left = int(rng.integers(0, self.width - w + 1))
                block = mask[top : top + h, left : left + w]
                new = h * w - int(block.sum())
                if 0 < new <= max_mask_patches:
                    block[...] = True
                    return new
        return 0

    def __call__(
        self, num_masking_patches: Optional[int] = None, rng: Optional[np.random.Generator] = None
    ) -> np.ndarray:
        """(h, w) bool mask with at most ``num_masking_patches`` True entries (usually exactly that many)."""
        num = self.num_masking_patches if num_masking_patches is None else num_masking_patches
        if num is None:
            raise ValueError("MaskingGenerator needs num_masking_patches (at construction or per call)")
        if num > self.num_patches:
            raise ValueError(f"cannot mask {num} patches of a {self.height}x{self.width} grid")
        rng = self.rng if rng is None else rng
        mask = np.zeros(self.get_shape(), dtype=bool)
        count = 0
        while count < num:
            max_block = num - count
            if self.max_num_patches is not None:
                max_block = min(max_block, self.max_num_patches)
            delta = self._add_block(mask, max_block, rng)
            if delta == 0:
                break
            count += delta
        return mask


def sample_masks(
    generator: MaskingGenerator,
    n_images: int,
    mask_ratio_min_max: tuple[float, float] = (0.1, 0.5),
    mask_probability: float = 0.5,
    rng: Optional[np.random.Generator] = None,
) -> Tensor:
    """(n_images, h * w) bool masks as DINOv2's ``collate_data_and_cast`` draws them.

    ``int(n_images * mask_probability)`` images are masked; their ratios are stratified — image i of them gets
    a ratio uniform in the i-th of equal sub-intervals of ``mask_ratio_min_max`` — which keeps the total number
    of masked patches (and so the iBOT buffers) close to constant across steps. The masked images are placed at
    random positions.
    """
    rng = generator.rng if rng is None else rng
    lo, hi = mask_ratio_min_max
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"mask ratio range must satisfy 0 <= min <= max <= 1, got {mask_ratio_min_max}")
    n_patches = generator.num_patches
    n_masked_images = int(n_images * mask_probability)
    edges = np.linspace(lo, hi, n_masked_images + 1)
    masks = [generator(int(n_patches * rng.uniform(edges[i], edges[i + 1])), rng=rng) for i in range(n_masked_images)]
    masks += [np.zeros(generator.get_shape(), dtype=bool)] * (n_images - n_masked_images)
    order = rng.permutation(n_images)
    return torch.from_numpy(np.stack([masks[i] for i in order]).reshape(n_images, -1))


def masks_upperbound(n_images: int, n_patches: int, mask_ratio_min_max=(0.1, 0.5), mask_probability=0.5) -> int:
    """Most patches :func:`sample_masks` can mask in one batch (DINOv2's ``upperbound``), for static buffers."""
    n_masked_images = int(n_images * mask_probability)
    edges = np.linspace(*mask_ratio_min_max, n_masked_images + 1)
    return int(sum(int(n_patches * edges[i + 1]) for i in range(n_masked_images)))


__all__ = ["MaskingGenerator", "masks_upperbound", "sample_masks"]
