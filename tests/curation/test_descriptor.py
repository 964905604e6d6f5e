"""The offline copy descriptor separates copies from distinct photos at DINOv2's threshold."""

from __future__ import annotations

import numpy as np
import pytest

from curation.embed.descriptor import PCADescriptor, dhash, phash
from curation.config import DescriptorConfig
from curation.dedup.hashdedup import hamming


@pytest.fixture(scope="module")
def sims(labelled_images):
    imgs, labels, kinds = labelled_images
    e = PCADescriptor().embed_images(imgs)
    return e, e @ e.T, labels, kinds


def test_descriptors_are_unit_norm_and_deterministic(sims, labelled_images):
    e = sims[0]
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)
    again = PCADescriptor().embed_images(labelled_images[0][:10])
    # Same batch shape: bit-identical. Batch 10 vs the whole set: OpenBLAS picks kernels by CPU
    # and shape (Haswell / Zen kernels differ in the last bit), so only a tolerance holds.
    np.testing.assert_array_equal(again, PCADescriptor().embed_images(labelled_images[0][:10]))
    np.testing.assert_allclose(e[:10], again, rtol=0, atol=1e-5)


def test_threshold_0p6_separates_copies_from_distinct_photos(sims):
    _, s, labels, kinds = sims
    same = labels[:, None] == labels[None, :]
    orig = np.flatnonzero(kinds == "")
    copy_sims = {k: np.array([s[o, o + 1 + j] for o in orig]) for j, k in
                 enumerate(["resize", "jpeg", "crop", "combo"])}
    distinct = s[~same]
    # measured: resize/jpeg >= 0.99, crop >= 0.68, combo >= 0.75; distinct <= 0.36
    assert copy_sims["resize"].min() > 0.95 and copy_sims["jpeg"].min() > 0.95
    assert copy_sims["crop"].min() > 0.6 and copy_sims["combo"].min() > 0.6
    assert distinct.max() < 0.45  # also below the decontamination threshold
    assert np.median([c.min() for c in copy_sims.values()]) - distinct.max() > 0.3


def test_random_descriptor_would_not_separate(sims):
    """Guards the test above against a degenerate pass: scrambled projections fail it."""
    e, _, labels, kinds = sims
    rng = np.random.default_rng(0)
    shuffled = e[rng.permutation(len(e))]
    s = shuffled @ shuffled.T
    orig = np.flatnonzero(kinds == "")
    assert min(s[o, o + 3] for o in orig) < 0.6


def test_pool_whitening_needs_enough_images(labelled_images):
    thumbs = np.zeros((20, 64, 64, 3), np.float32)
    with pytest.raises(ValueError, match="pool_whiten=0"):
        PCADescriptor(DescriptorConfig(pool_whiten=0.5)).fit(thumbs)


def test_save_load_roundtrip(tmp_path, labelled_images):
    imgs = labelled_images[0]
    rng = np.random.default_rng(0)
    thumbs = rng.random((400, 64, 64, 3)).astype(np.float32)
    d = PCADescriptor(DescriptorConfig(pool_whiten=0.5)).fit(thumbs)
    d.save(tmp_path / "d.npz")
    d2 = PCADescriptor.load(tmp_path / "d.npz")
    np.testing.assert_array_equal(d.embed_images(imgs[:5]), d2.embed_images(imgs[:5]))


def test_perceptual_hashes_near_exact_for_resize_and_recompress(labelled_images):
    imgs, labels, kinds = labelled_images
    h = [phash(im) for im in imgs]
    orig = np.flatnonzero(kinds == "")
    for j, kind in enumerate(["resize", "jpeg"], start=1):
        assert max(hamming(h[o], h[o + j]) for o in orig) <= 4, kind
    dist = [hamming(h[a], h[b]) for a in orig for b in orig if a < b]
    assert min(dist) >= 10  # measured 18
    assert 0 <= dhash(imgs[0]) < 2**64


def test_a_bordered_or_rotated_photo_keeps_its_descriptor():
    """The thumbnail leaves a constant frame out and fills a rotation's corners (curation.core.padding): measured
    0.93-0.99 for a 10 % white border (0.14-0.45 and below with the frame in the thumbnail) and 0.40-0.80 for a 6
    degree rotation on black corners (0.03-0.69 with them)."""
    from PIL import Image, ImageOps

    from dinopipe.data.samples import real_photos

    photos = real_photos()
    originals = [Image.fromarray(photos[n]).convert("RGB")
                 for n in ("astronaut", "camera", "coffee", "chelsea", "brick", "text", "moon", "cell")]
    d = PCADescriptor()
    e = d.embed_images(originals)
    bordered = d.embed_images([ImageOps.expand(im, border=im.width // 10, fill=(255, 255, 255)) for im in originals])
    rotated = d.embed_images([im.rotate(6, Image.BICUBIC, expand=True, fillcolor=(0, 0, 0)) for im in originals])
    assert (e * bordered).sum(1).min() > 0.9, (e * bordered).sum(1)
    rot = (e * rotated).sum(1)
    assert rot.min() > 0.35 and rot.mean() > 0.5, rot
