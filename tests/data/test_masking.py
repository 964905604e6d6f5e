"""iBOT block masking: never more than asked, close to it on average, every block a filled rectangle with
a bounded aspect ratio, reproducible from a seed; the batch sampler masks the configured share of images at
ratios within the configured range."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dinopipe.data.masking import MaskingGenerator, masks_upperbound, sample_masks
from dinopipe.utils.masks import mask_token_weights


def test_never_exceeds_and_close_to_requested():
    gen = MaskingGenerator((16, 16), max_num_patches=0.5 * 256)
    rng = np.random.default_rng(0)
    for want in (0, 4, 25, 64, 128):
        counts = np.array([gen(want, rng=rng).sum() for _ in range(40)])
        assert counts.max() <= want
        if want:
            assert counts.mean() >= 0.9 * want, (want, counts.mean())


def test_each_block_is_a_filled_rectangle_with_bounded_aspect():
    gen = MaskingGenerator((14, 14), min_num_patches=4, min_aspect=0.3)
    rng = np.random.default_rng(1)
    for _ in range(100):
        mask = np.zeros((14, 14), dtype=bool)
        added = gen._add_block(mask, max_mask_patches=40, rng=rng)
        rows, cols = np.nonzero(mask)
        if not added:
            continue
        h, w = rows.max() - rows.min() + 1, cols.max() - cols.min() + 1
        assert h * w == added == mask.sum()  # contiguous: the bounding box is fully masked
        assert 1 <= added <= 40
        # Rounding h, w of areas >= 4 keeps the aspect ratio within a loose band of [0.3, 1/0.3].
        assert 0.15 <= h / w <= 1 / 0.15


def test_reproducible_and_validates():
    a = MaskingGenerator(8, seed=3)(20)
    b = MaskingGenerator(8, seed=3)(20)
    assert np.array_equal(a, b) and a.shape == (8, 8)
    with pytest.raises(ValueError, match="cannot mask"):
        MaskingGenerator(4)(17)
    with pytest.raises(ValueError, match="num_masking_patches"):
        MaskingGenerator(4)()


def test_sample_masks_share_and_ratios():
    gen = MaskingGenerator((16, 16), max_num_patches=128)
    rng = np.random.default_rng(2)
    n_images, n = 40, 256
    counts_masked_images, ratios = [], []
    for _ in range(10):
        masks = sample_masks(gen, n_images, (0.1, 0.5), 0.5, rng=rng)
        assert masks.shape == (n_images, n) and masks.dtype == torch.bool
        per_image = masks.sum(1)
        counts_masked_images.append(int((per_image > 0).sum()))
        ratios += (per_image[per_image > 0].float() / n).tolist()
        assert int(per_image.sum()) <= masks_upperbound(n_images, n, (0.1, 0.5), 0.5)
    assert all(c == 20 for c in counts_masked_images)  # exactly int(40 * 0.5) images masked
    assert min(ratios) >= 0.1 * 0.8 and max(ratios) <= 0.5
    assert 0.25 < float(np.mean(ratios)) < 0.33  # stratified over [0.1, 0.5] -> mean ~0.3 (slightly under)
    # Masked images are scattered, not always the first half.
    first = sample_masks(gen, 8, (0.1, 0.5), 0.5, rng=np.random.default_rng(5)).sum(1) > 0
    positions = {tuple(first.tolist())} | {
        tuple((sample_masks(gen, 8, (0.1, 0.5), 0.5, rng=np.random.default_rng(s)).sum(1) > 0).tolist())
        for s in range(6, 10)}
    assert len(positions) > 1


def test_mask_token_weights_sum_to_one_per_masked_image():
    masks = torch.zeros(3, 10, dtype=torch.bool)
    masks[0, :2] = True
    masks[2, 3:8] = True
    w = mask_token_weights(masks)
    assert w.shape == (7,)
    torch.testing.assert_close(w[:2].sum(), torch.tensor(1.0))
    torch.testing.assert_close(w[2:].sum(), torch.tensor(1.0))
