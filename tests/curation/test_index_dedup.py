"""kNN index (flat / IVF, fp16 memmaps in batches), copy dedup and decontamination."""

from __future__ import annotations

import numpy as np
import pytest

from curation.decontaminate.remove import decontaminate
from curation.dedup.copies import copy_dedup
from curation.embed.descriptor import PCADescriptor
from curation.knn.index import Rows, build_index, iter_knn


def clustered(n_groups=300, per_group=4, d=128, noise=0.3, seed=0):
    """Near-duplicate groups: a random unit direction per group plus noise (pair cosine ~0.9);
    different groups are ~orthogonal (cosine ~ N(0, 1/d)). fp16, L2-normalised."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((n_groups, d))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    x = np.repeat(centres, per_group, 0)
    x = x + noise * rng.standard_normal(x.shape) / np.sqrt(d)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(np.float16), np.repeat(np.arange(n_groups), per_group)


def test_flat_search_is_exact_and_excludes_self(tmp_path):
    x, _ = clustered(50, 3)
    np.save(tmp_path / "e.npy", x)
    mm = np.load(tmp_path / "e.npy", mmap_mode="r")  # fp16 memmap, converted per batch
    index = build_index(mm, kind="flat", batch_size=17)
    pos, sims, idx = zip(*iter_knn(index, mm, 5, batch_size=13, exclude_self=True))
    idx, sims = np.concatenate(idx), np.concatenate(sims)
    x32 = x.astype(np.float32)
    full = x32 @ x32.T
    np.fill_diagonal(full, -np.inf)
    np.testing.assert_array_equal(np.sort(idx, 1), np.sort(np.argsort(-full, 1)[:, :5], 1))
    assert not (idx == np.arange(len(x))[:, None]).any()
    np.testing.assert_allclose(sims[:, 0], full.max(1), atol=1e-5)


def test_ivf_finds_the_duplicate_pairs_flat_finds():
    x, groups = clustered(1500, 2)
    flat = copy_dedup(x, [f"{i:06d}" for i in range(len(x))], k=8, threshold=0.6,
                      index_kind="flat")
    ivf = copy_dedup(x, [f"{i:06d}" for i in range(len(x))], k=8, threshold=0.6,
                     index_kind="ivf", nprobe=16)
    assert ivf.index_kind == "ivf" and flat.index_kind == "flat"
    assert flat.n_duplicates == 1500  # every planted pair, nothing else
    agree = (flat.component == ivf.component).mean()
    assert agree >= 0.98, agree


def test_k_is_capped_for_tiny_pools():
    x = np.eye(3, dtype=np.float16)
    res = copy_dedup(x, ["a", "b", "c"], k=64)
    assert res.keep.all() and np.all(res.nn_index >= 0)
    one = copy_dedup(x[:1], ["a"], k=64)
    assert one.keep.all()


def test_auto_picks_ivf_above_flat_max():
    x, _ = clustered(200, 2)
    assert build_index(x, flat_max=100).kind == "ivf"
    assert build_index(x).kind == "flat"


@pytest.fixture(scope="module")
def photo_desc(labelled_images):
    imgs, labels, kinds = labelled_images
    return PCADescriptor().embed_images(imgs), labels, kinds


def test_copy_dedup_on_real_photos_keeps_one_per_group(photo_desc):
    e, labels, kinds = photo_desc
    ids = [f"{labels[i]:03d}/{kinds[i] or '0orig'}" for i in range(len(labels))]
    res = copy_dedup(e, ids, k=64, threshold=0.6)
    # every photo is one component holding exactly its 5 versions
    for lab in np.unique(labels):
        members = np.flatnonzero(labels == lab)
        assert len(set(res.component[members])) == 1, lab
        assert res.keep[members].sum() == 1
        assert kinds[members][res.keep[members]][0] == ""  # '0orig' is the smallest id
    assert res.keep.sum() == len(np.unique(labels))


def test_dedup_is_independent_of_input_order(photo_desc):
    e, labels, kinds = photo_desc
    ids = np.array([f"{labels[i]:03d}/{kinds[i] or '0orig'}/{i}" for i in range(len(labels))])
    perm = np.random.default_rng(3).permutation(len(ids))
    a = copy_dedup(e, ids, threshold=0.6)
    b = copy_dedup(e[perm], ids[perm], threshold=0.6)
    assert set(ids[a.keep]) == set(ids[perm][b.keep])


def test_decontamination_removes_whole_components(photo_desc):
    e, labels, kinds = photo_desc
    ids = [f"{labels[i]:03d}/{kinds[i] or '0orig'}" for i in range(len(labels))]
    dd = copy_dedup(e, ids, threshold=0.6)
    # the eval set holds one cropped copy of photos 0 and 5 only
    eval_rows = [np.flatnonzero((labels == lab) & (kinds == "crop"))[0] for lab in (0, 5)]
    pool = np.setdiff1d(np.arange(len(e)), eval_rows)
    res = decontaminate(Rows(e, pool), e[eval_rows], threshold=0.45,
                        components=dd.component[pool])
    removed_labels = set(labels[pool][res.removed])
    assert removed_labels == {0, 5}
    assert res.removed.sum() == 8  # the remaining 4 versions of each
    assert res.max_sim[~res.removed].max() < 0.45


def test_decontamination_refuses_mismatched_embedders():
    with pytest.raises(ValueError, match="same model"):
        decontaminate(np.eye(4, dtype=np.float16), np.eye(3, dtype=np.float16))
