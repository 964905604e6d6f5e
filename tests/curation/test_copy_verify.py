"""Copy detection with precision: pixel verification, star groups (no chaining), pair-order
independence, and a pluggable TorchScript copy model."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from curation.dedup.copies import copy_dedup, copy_dedup_from_pairs
from curation.embed.descriptor import PCADescriptor
from curation.verify.pixels import PixelVerifier

TILE = 96


def _jpeg(arr: np.ndarray, quality: int) -> Image.Image:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=quality)
    return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")


@pytest.fixture(scope="module")
def retina_tiles():
    """Distinct textured 96 px tiles of scikit-image's retina (224 px, as a pool would hold them),
    a planted copy of every third one (3 px shift, ~4% crop, brightness x1.12, resized to 150 px,
    JPEG q60), and two blank background tiles."""
    import skimage.data as skd

    arr = skd.retina()
    tiles, copies, blank = [], [], []
    for y in range(0, arr.shape[0] - TILE + 1, TILE):
        for x in range(0, arr.shape[1] - TILE + 1, TILE):
            t = arr[y:y + TILE, x:x + TILE]
            luma = t.astype(np.float32).mean(-1)
            if luma.max() < 5 and len(blank) < 2:
                blank.append(_jpeg(np.asarray(Image.fromarray(t).resize((224, 224))), 92))
            if luma.std() < 8 or (luma < 10).any() or len(tiles) >= 30:
                continue
            tiles.append(_jpeg(np.asarray(Image.fromarray(t).resize((224, 224), Image.BICUBIC)), 92))
            if len(tiles) % 3 == 1:
                c = arr[y + 3:y + 3 + TILE, x + 2:x + 2 + TILE][2:-2, 1:-3].astype(np.float32)
                c = np.clip(c * 1.12, 0, 255).astype(np.uint8)
                copies.append((len(tiles) - 1, _jpeg(np.asarray(
                    Image.fromarray(c).resize((150, 150), Image.BICUBIC)), 60)))
    assert len(tiles) == 30 and len(copies) == 10 and len(blank) == 2
    return tiles, copies, blank


def test_verifier_accepts_copies_and_rejects_distinct_tiles_of_one_scene(retina_tiles):
    tiles, copies, blank = retina_tiles
    imgs = tiles + [c for _, c in copies] + blank
    v = PixelVerifier(lambda p: imgs[p])
    n = len(tiles)
    copy_scores = v.scores(np.array([i for i, _ in copies]), np.arange(n, n + len(copies)))
    a, b = np.triu_indices(n, 1)
    distinct = v.scores(a, b)
    assert copy_scores.min() > v.threshold + 0.15, copy_scores
    assert distinct.max() < v.threshold, np.sort(distinct)[-5:]
    # blank images: copies of each other, never of a textured one; unreadable: never a copy
    nb = n + len(copies)
    assert v(np.array([nb, nb, 0]), np.array([nb + 1, 0, 1])).tolist() == [True, False, False]
    v2 = PixelVerifier(lambda p: None if p == 0 else imgs[p])
    assert not v2(np.array([0]), np.array([n])).any()


def test_verified_dedup_keeps_distinct_tiles_the_descriptor_merges(retina_tiles):
    """The issue's failure: on retina tiles the descriptor's kNN merges distinct tiles. With
    verification every distinct tile stays and every planted copy joins its original."""
    tiles, copies, _ = retina_tiles
    imgs = tiles + [c for _, c in copies]
    ids = [f"t{i:02d}" for i in range(len(tiles))] + [f"u{i:02d}_copy" for i, _ in copies]
    e = PCADescriptor().embed_images(imgs)
    plain = copy_dedup(e, ids, k=64, threshold=0.6, grouping="components")
    assert plain.keep[:len(tiles)].sum() < len(tiles) - 5  # the bug: distinct tiles removed
    res = copy_dedup(e, ids, k=64, threshold=0.6, verifier=PixelVerifier(lambda p: imgs[p]))
    assert res.keep[:len(tiles)].all()
    assert not res.keep[len(tiles):].any()
    for j, (i, _) in enumerate(copies):
        assert res.component[len(tiles) + j] == i
    assert res.n_candidates > res.n_edges == len(copies)


def _accepting(pairs):
    ok = {frozenset(p) for p in pairs}
    return lambda a, b: np.array([frozenset((int(x), int(y))) in ok for x, y in zip(a, b)])


def test_no_chaining_an_image_goes_only_as_a_verified_copy_of_its_kept_image():
    # a~b, b~c, c~d verified, nothing else (a chain of gradual edits): components would drop
    # three images for one; stars keep b (most copies, smaller id than c) with a, and c with d
    # (c first went to b, then left to keep d, which is no copy of b).
    ids = ["a", "b", "c", "d", "e"]
    a, b, sim = np.array([0, 2, 2, 0]), np.array([1, 1, 3, 2]), np.full(4, 0.9, np.float32)
    verifier = _accepting([(0, 1), (1, 2), (2, 3)])  # the candidate a~c fails verification
    star = copy_dedup_from_pairs(5, ids, a, b, sim, threshold=0.6, verifier=verifier)
    assert star.keep.tolist() == [False, True, True, False, True]
    assert star.component.tolist() == [1, 1, 2, 2, 4]
    assert star.n_candidates == 4 and star.n_edges == 3
    chained = copy_dedup_from_pairs(5, ids, a, b, sim, threshold=0.6, verifier=verifier,
                                    grouping="components")
    assert chained.keep.tolist() == [True, False, False, False, True]  # DINOv2's components chain
    # every removed image was verified against the image its group keeps
    for pos in np.flatnonzero(~star.keep):
        assert verifier(np.array([star.component[pos]]), np.array([pos]))[0]


def test_a_lone_copy_of_a_removed_image_ends_in_one_group_with_it():
    # b and c are copies of a (a keeps both); d is a copy of b only as far as the kNN found.
    ids, a, b = ["a", "b", "c", "d"], np.array([0, 0, 1]), np.array([1, 2, 3])
    sim = np.full(3, 0.9, np.float32)
    joins = copy_dedup_from_pairs(4, ids, a, b, sim, threshold=0.6,
                                  verifier=_accepting([(0, 1), (0, 2), (1, 3), (0, 3)]))
    assert joins.component.tolist() == [0, 0, 0, 0]  # d verified against a itself: same group
    verifier = _accepting([(0, 1), (0, 2), (1, 3)])
    alone = copy_dedup_from_pairs(4, ids, a, b, sim, threshold=0.6, verifier=verifier)
    # d is not a copy of a: b leaves a's group and keeps d (still two images removed)
    assert alone.component.tolist() == [0, 1, 0, 1]
    for pos in np.flatnonzero(~alone.keep):
        assert verifier(np.array([alone.component[pos]]), np.array([pos]))[0]


def test_decisions_depend_only_on_the_set_of_pairs():
    """A kNN finds pairs from both sides, a sharded kNN in shard order: same set, same result."""
    rng = np.random.default_rng(0)
    n = 300
    ids = np.array([f"img{int(i):05d}" for i in rng.permutation(10 * n)[:n]])
    a, b = rng.integers(0, n, 900), rng.integers(0, n, 900)
    sim = rng.uniform(0.5, 1.0, 900).astype(np.float32)
    calls = []

    def verifier(x, y):  # accepts a fixed pseudo-random half of the pairs; records its calls
        calls.append((x.copy(), y.copy()))
        return (np.minimum(x, y) * 7 + np.maximum(x, y) * 13) % 2 == 0

    ref = copy_dedup_from_pairs(n, ids, a, b, sim, threshold=0.6, verifier=verifier)
    for shards in (1, 3):
        perm = rng.permutation(len(a))
        parts = np.array_split(perm, shards)
        both = np.concatenate([np.concatenate([p, p]) for p in parts])  # each pair twice
        flip = rng.random(len(both)) < 0.5
        aa, bb = np.where(flip, b[both], a[both]), np.where(flip, a[both], b[both])
        res = copy_dedup_from_pairs(n, ids, aa, bb, sim[both], threshold=0.6, verifier=verifier)
        np.testing.assert_array_equal(res.component, ref.component)
        assert res.n_candidates == ref.n_candidates and res.n_edges == ref.n_edges
    calls = calls[::2]  # each run: candidates, then the second look at lone images
    assert all(np.array_equal(c[0], calls[0][0]) for c in calls)  # same pairs, same order
    assert (ids[calls[0][0]] < ids[calls[0][1]]).all()  # verified smaller id first
    assert ref.n_candidates == len(calls[0][0]) == len({frozenset(p) for p in zip(
        a[(sim > 0.6) & (a != b)], b[(sim > 0.6) & (a != b)])})


class _TinyCopyNet(torch.nn.Module):
    """Stands in for SSCD's TorchScript file: image (B, 3, H, W) -> descriptor (B, 32)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 32, 8, stride=8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.adaptive_avg_pool2d(torch.relu(self.conv(x)), 1).flatten(1)


@pytest.mark.filterwarnings("ignore:`torch.jit:FutureWarning")  # SSCD ships TorchScript only
def test_torchscript_copy_model_replaces_the_descriptor(pool_dir, tmp_path):
    from curation.config import DedupConfig, EmbedConfig
    from curation.core.embstore import open_embeddings
    from curation.decontaminate.step import step_decontaminate
    from curation.dedup.step import step_dedup
    from curation.embed.step import step_embed

    path = tmp_path / "copy.torchscript.pt"
    torch.jit.save(torch.jit.script(_TinyCopyNet().eval()), str(path))
    root, _ = pool_dir
    out = tmp_path / "out"
    step_embed([str(root)], str(out), EmbedConfig(batch_size=16, num_workers=0),
               dedup=DedupConfig(model=str(path), image_size=64, trust_code=True), progress=False)
    emb = open_embeddings(str(out / "embeddings" / "descriptor"))
    assert emb.dim == 32
    rows = emb.rows(np.arange(len(emb)))
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, atol=2e-3)
    net = torch.jit.load(str(path))
    step_dedup(str(out), progress=False, sources=[str(root)])
    # later steps embed eval images with the same model, found through copy_model.json
    step_decontaminate(str(out), [str(root)], embed=EmbedConfig(num_workers=0), progress=False, trust_code=True)
    ev = open_embeddings(str(out / "embeddings" / "eval"))
    assert ev.dim == 32
    ref = net(torch.zeros(1, 3, 64, 64))
    assert ref.shape == (1, 32)
    with pytest.raises(Exception, match="dedup.model"):  # the pool was embedded with the model
        step_embed([str(root)], str(out), EmbedConfig(num_workers=0),
                   dedup=DedupConfig(model=str(tmp_path / "other.pt")), progress=False)


def test_config_checks_name_the_dedup_key(tmp_path):
    from dinopipe.config import ConfigError

    from curation.config import CurationConfig, validate

    for key, val, msg in (("model", str(tmp_path / "nope.pt"), "dedup.model"),
                          ("grouping", "chain", "dedup.grouping"),
                          ("verify_threshold", 1.5, "dedup.verify_threshold")):
        cfg = CurationConfig()
        cfg.input.paths, cfg.output.dir = [str(tmp_path)], str(tmp_path / "o")
        setattr(cfg.dedup, key, val)
        with pytest.raises(ConfigError, match=msg):
            validate(cfg)


def test_parted_verification_equals_one_call_and_a_killed_task_reruns_only_its_part(retina_tiles, tmp_path):
    """Verification as 3 tasks (each owning a range of first images) gives the verdicts of one call; a
    lost part is recomputed alone, the others are read back."""
    from curation.verify.pixels import PartedVerifier

    tiles, copies, _ = retina_tiles
    imgs = tiles + [c for _, c in copies]
    n = len(tiles)
    a = np.r_[np.array([i for i, _ in copies]), np.arange(0, n - 1)]
    b = np.r_[np.arange(n, n + len(copies)), np.arange(1, n)]
    srt = np.lexsort((b, a))
    a, b = a[srt], b[srt]
    one = PixelVerifier(lambda p: imgs[p])(a, b)
    calls = []

    def counted(x, y):
        calls.append(len(x))
        return PixelVerifier(lambda p: imgs[p])(x, y)

    pv = PartedVerifier(counted, str(tmp_path / "verify"), num_tasks=3)
    np.testing.assert_array_equal(pv(a, b), one)
    assert len(calls) == 3 and sum(calls) == len(a) and one.sum() == len(copies)
    import os

    os.remove(tmp_path / "verify" / "call0-part-00001-of-00003.npz")
    calls.clear()
    again = PartedVerifier(counted, str(tmp_path / "verify"), num_tasks=3)
    np.testing.assert_array_equal(again(a, b), one)
    assert len(calls) == 1 and again.computed == 1
