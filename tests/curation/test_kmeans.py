"""k-means: seeding determinism, the early stop, k-means++ beating random seeding on long tails,
and the distributed version (1, 2 and 3 gloo processes under torchrun) giving the same clusters at every
level, with no rank holding all of a level's centroids."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from curation.core.embstore import mark_task_done, save_shard, shard_stem
from curation.kmeans.hierarchical import BLOCK, hierarchical_kmeans, kmeans_fit, lloyd

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def zipf_clusters(n=6000, d=32, n_clusters=150, seed=0, cos=0.8):
    """fp16 unit rows from Zipf-weighted Gaussian clusters (the shape of a web pool)."""
    rng = np.random.default_rng(seed)
    c = rng.standard_normal((n_clusters, d))
    c /= np.linalg.norm(c, axis=1, keepdims=True)
    p = 1.0 / np.arange(1, n_clusters + 1)
    lab = rng.choice(n_clusters, size=n, p=p / p.sum())
    x = c[lab] + rng.standard_normal((n, d)) * np.sqrt(1 / cos ** 2 - 1) / np.sqrt(d)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(np.float16), lab


@pytest.fixture(scope="module")
def data():
    return zipf_clusters()


def test_same_seed_same_clusters_other_seed_other(data):
    x, _ = data
    a, b = kmeans_fit(x, 60, seed=3), kmeans_fit(x, 60, seed=3)
    np.testing.assert_array_equal(a.centroids, b.centroids)
    assert a.history == b.history
    c = kmeans_fit(x, 60, seed=4)
    assert not np.array_equal(a.centroids, c.centroids)


def test_early_stop_on_relative_objective_change(data):
    x, _ = data
    xf = x.astype(np.float32)
    blocks = lambda: iter([xf])  # noqa: E731
    c0 = xf[:60].copy()
    full = lloyd(blocks, c0, niter=60, tol=0.0)
    early = lloyd(blocks, c0, niter=60, tol=1e-3)
    h = early.history
    # stops at the first iteration whose improvement is below tol, not before
    assert early.n_iter == len(h) < full.n_iter
    assert h[-2] - h[-1] <= 1e-3 * h[-2]
    assert all(a - b > 1e-3 * a for a, b in zip(h[:-2], h[1:-1]))
    assert all(a >= b for a, b in zip(full.history, full.history[1:]))  # Lloyd never goes up
    assert full.history[: len(h)] == h  # same path until the stop
    capped = lloyd(blocks, c0, niter=3, tol=0.0)
    assert capped.n_iter == 3


def test_kmeanspp_seeding_beats_random_on_a_long_tail(data):
    x, _ = data
    kpp = [kmeans_fit(x, 100, seed=s).objective for s in range(2)]
    rnd = [kmeans_fit(x, 100, seed=s, init="random").objective for s in range(2)]
    assert max(kpp) < min(rnd), (kpp, rnd)  # measured: ~2-3% lower SSE
    with pytest.raises(ValueError, match="kmeans\\+\\+"):
        kmeans_fit(x, 10, init="kmeans||")


def _write_embeddings(path, x, shard=1000):
    for i, s in enumerate(range(0, len(x), shard)):
        ids = [f"img{j:07d}" for j in range(s, min(s + shard, len(x)))]  # rows come back by id: x order
        save_shard(path, shard_stem(0, i), x[s:s + shard],
                   {"ids": ids, "sources": ["synthetic"] * len(ids),
                    "hashes": ["0"] * len(ids), "unreadable": []})
    mark_task_done(path, 0, 1, {"n": len(x)})


def _launch(nproc, emb, out, port, *extra, levels=("40", "8"), sample_sizes=("4", "4"), steps="2"):
    """torchrun with nproc ranks; one rank runs without a launcher (its defaults: world of 1)."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE",
               MASTER_PORT=str(port))
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                                      f"--master-port={port}"]
    cmd = [sys.executable, *launcher, "-m", "curation.cli", "kmeans", "--emb-dir", emb, "--out", out,
           "--levels", *levels, "--sample-sizes", *sample_sizes, "--steps", steps, "--block", "256", *extra]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    with open(os.path.join(out, "kmeans.json")) as f:
        return json.load(f)


def test_distributed_1_and_3_processes_give_identical_clusters(tmp_path, data):
    """Same seed -> same initialisation on any world size; level 1 resampled (closest, s=4)."""
    x, _ = data
    emb = str(tmp_path / "emb")
    _write_embeddings(emb, x)
    outs = {}
    for nproc, port in ((1, 29611), (3, 29612)):
        out = str(tmp_path / f"w{nproc}")
        summary = _launch(nproc, emb, out, port)
        assert summary["world_size"] == nproc and summary["n"] == len(x)
        outs[nproc] = {f: np.load(os.path.join(out, f)) for f in sorted(os.listdir(out))
                       if f.endswith(".npy")}
    assert set(outs[1]) == set(outs[3]) >= {"level1_labels.npy", "labels_level2.npy"}
    for f in outs[1]:  # bit-identical: labels, distances, centroids, sizes of every level
        np.testing.assert_array_equal(outs[1][f], outs[3][f], err_msg=f)
    assert outs[3]["sizes_level1.npy"].sum() == len(x)
    # and the clustering one process makes without torch.distributed (other BLAS blockings:
    # tolerances, not bits)
    tree = hierarchical_kmeans(x, [40, 8], n_resampling_steps=2, sample_size=[4, 4], seed=0)
    assert BLOCK > len(x)  # one process used one block, the ranks 256-row blocks
    np.testing.assert_allclose(outs[3]["centroids_level1.npy"], tree[0].centroids, atol=1e-5)
    assert (outs[3]["level1_labels.npy"] == tree[0].labels).mean() > 0.99


def test_sharded_centroids_1_2_3_ranks_equal_the_one_process_kmeans(tmp_path, data):
    """Level-1 centroids sharded in pieces of 8 (k = 40: 5 pieces, each rank owns 2-3 or 1-2 of them):
    bit-identical for 1, 2 and 3 gloo ranks, and equal to one process with all centroids in one piece
    (the unsharded Lloyd) -- same labels, centroids to fp32 rounding."""
    x, _ = data
    emb = str(tmp_path / "emb")
    _write_embeddings(emb, x)
    piece_mb = str(8 * x.shape[1] * 4 / 2**20)
    outs, summaries = {}, {}
    for nproc, port, extra in ((1, 29621, ()), (1, 29622, ("--piece-mb", piece_mb)),
                               (2, 29623, ("--piece-mb", piece_mb)), (3, 29624, ("--piece-mb", piece_mb))):
        key = (nproc, bool(extra))
        out = str(tmp_path / f"w{nproc}{'p' if extra else ''}")
        summaries[key] = _launch(nproc, emb, out, port, *extra)
        outs[key] = {f: np.load(os.path.join(out, f)) for f in sorted(os.listdir(out)) if f.endswith(".npy")}
    assert summaries[(1, False)]["level1"]["pieces"] == 1
    assert summaries[(3, True)]["level1"]["pieces"] == 5 and summaries[(3, True)]["level1"]["centroid_piece"] == 8
    for key in ((2, True), (3, True)):
        for f in outs[(1, True)]:
            np.testing.assert_array_equal(outs[(1, True)][f], outs[key][f], err_msg=f"{key} {f}")
    one = outs[(1, False)]
    np.testing.assert_array_equal(one["level1_labels.npy"], outs[(3, True)]["level1_labels.npy"])
    np.testing.assert_allclose(one["centroids_level1.npy"], outs[(3, True)]["centroids_level1.npy"], rtol=0,
                               atol=1e-6)
    # per rank: its pieces + one received piece + one float64 sums piece, not k x D
    d = x.shape[1]
    held = {n: summaries[(n, True)]["level1"]["centroid_bytes_per_rank"] for n in (1, 2, 3)}
    assert held[1] == 40 * d * 4 + 8 * d * 12
    assert held[3] == 16 * d * 4 + 8 * d * 12  # the largest share: 2 of 5 pieces


def _npys(out):
    return {f: np.load(os.path.join(out, f)) for f in sorted(os.listdir(out)) if f.endswith(".npy")}


@pytest.mark.parametrize("init", ["auto", "random"])
def test_one_rank_tree_equals_the_in_process_tree(tmp_path, data, init):
    """One rank, default blocks and pieces: every level (labels, centroids, sizes) bit-identical to
    curation.kmeans.hierarchical.hierarchical_kmeans -- the upper levels too, though they now run the sharded Lloyd
    with int64 fixed-point sums; init=random seeds are read by the piece owners, k-means++ on rank 0."""
    from curation.kmeans.dist import run

    x, _ = data
    emb = str(tmp_path / "emb")
    _write_embeddings(emb, x)
    out = str(tmp_path / "out")
    run(emb, out, [40, 16, 4], [4, 4, 2], steps=1, seed=0, init=init)
    tree = hierarchical_kmeans(x, [40, 16, 4], n_resampling_steps=1, sample_size=[4, 4, 2], seed=0, init=init)
    got = _npys(out)
    for li, lvl in enumerate(tree, start=1):
        lab = got["level1_labels.npy" if li == 1 else f"labels_level{li}.npy"]
        np.testing.assert_array_equal(lab, lvl.labels, err_msg=f"level {li}")
        np.testing.assert_array_equal(got[f"centroids_level{li}.npy"], lvl.centroids, err_msg=f"level {li}")
        np.testing.assert_array_equal(got[f"sizes_level{li}.npy"], lvl.sizes, err_msg=f"level {li}")
    assert not os.path.exists(os.path.join(out, ".resample"))  # the resampling parts are removed


@pytest.mark.parametrize("sampling,init", [("closest", "random"),
                                           pytest.param("random", "auto", marks=pytest.mark.slow)])
def test_every_level_sharded_bit_identical_on_1_2_3_ranks(tmp_path, data, sampling, init):
    """Three levels (40 / 16 / 4), each resampled once, pieces of 8 centroids at every level (level 1: 5
    pieces, level 2: 2): labels, distances, centroids and sizes of every level bit-identical for 1, 2 and 3
    gloo ranks; no rank holds more than its pieces + one received piece + one piece of sums."""
    x, _ = data
    emb = str(tmp_path / "emb")
    _write_embeddings(emb, x)
    d = x.shape[1]
    piece_mb = str(8 * d * 4 / 2**20)
    outs, summaries = {}, {}
    for nproc, port in ((1, 29641 if init == "random" else 29645), (2, 29642 if init == "random" else 29646),
                        (3, 29643 if init == "random" else 29647)):
        out = str(tmp_path / f"w{nproc}")
        summaries[nproc] = _launch(nproc, emb, out, port, "--piece-mb", piece_mb, "--init", init,
                                   "--sampling", sampling, levels=("40", "16", "4"), sample_sizes=("4", "4", "2"),
                                   steps="1")
        outs[nproc] = _npys(out)
    assert set(outs[1]) >= {"labels_level2.npy", "dist_level3.npy", "centroids_level3.npy", "sizes_level3.npy"}
    for nproc in (2, 3):
        assert set(outs[nproc]) == set(outs[1])
        for f in outs[1]:
            np.testing.assert_array_equal(outs[1][f], outs[nproc][f], err_msg=f"{nproc} ranks: {f}")
    assert [lv["pieces"] for lv in summaries[3]["per_level"]] == [5, 2, 1]
    assert outs[3]["sizes_level3.npy"].sum() == outs[3]["sizes_level2.npy"].sum() == len(x)
    assert len(np.unique(outs[3]["labels_level2.npy"])) >= 12  # a real clustering of the 40 centroids
    held = [lv["centroid_bytes_per_rank"] for lv in summaries[3]["per_level"]]
    assert held[0] == 16 * d * 4 + 8 * d * 12 < 40 * d * 4 + 8 * d * 12  # 2 of 5 pieces, not all 40
    assert held[1] == 8 * d * 4 + 8 * d * 12  # level 2: one of its two pieces


def test_curate_run_tree_reused_on_rerun_and_redone_when_unfinished(tmp_path, data):
    """`curate run`'s tree (curation.kmeans.tree.fit_tree): a rerun with the same rows and settings reuses
    the finished tree; one killed before kmeans.json was written, or made for other settings, is redone."""
    from curation.kmeans.dist import curate_settings
    from curation.core.embstore import open_embeddings
    from curation.kmeans.tree import fit_tree

    x, _ = data
    emb = str(tmp_path / "emb")
    _write_embeddings(emb, x)
    ids = open_embeddings(emb).ids
    rows = np.arange(0, len(x), 2)
    out = str(tmp_path / "tree")
    record = curate_settings(len(rows), ids[rows], [40, 8], n_resampling_steps=1, sample_size=4)
    first, ran = fit_tree(out, emb, rows, record)
    assert len(ran) == 1 and len(first[0].labels) == len(rows)
    again, ran = fit_tree(out, emb, rows, record)
    assert ran == []  # reused
    os.remove(os.path.join(out, "kmeans.json"))  # as a task killed before the end leaves it
    redone, ran = fit_tree(out, emb, rows, record)
    assert len(ran) == 1
    for a, b, c in zip(first, again, redone):
        np.testing.assert_array_equal(a.labels, b.labels)
        np.testing.assert_array_equal(a.labels, c.labels)
        np.testing.assert_array_equal(a.centroids, c.centroids)
    other, ran = fit_tree(out, emb, rows, curate_settings(len(rows), ids[rows], [40, 8], n_resampling_steps=1,
                                                          sample_size=4, seed=1))
    assert len(ran) == 1 and not np.array_equal(other[0].centroids, first[0].centroids)


def test_seeding_positions_need_memory_of_the_sample_not_of_the_pool():
    """DINOv3's level 1 seeds 10M clusters from a sample of 4 rows per cluster: 40M of 1.2B rows, more
    than numpy's choice can draw without an arange of all rows (9.6 GB). The draw is O(sample)."""
    import tracemalloc

    from curation.kmeans.hierarchical import sample_positions

    rng = np.random.default_rng(0)
    for n, size in ((10, 3), (100, 60), (1000, 999), (50_000, 2_000), (7, 0), (5, 5)):
        p = sample_positions(n, size, rng)
        assert len(p) == size and (np.diff(p) > 0).all() and (size == 0 or (p[0] >= 0 and p[-1] < n))
    counts = np.zeros(20)
    for _ in range(4000):  # every position equally likely (each drawn 1000 times on average)
        counts[sample_positions(20, 5, rng)] += 1
    assert counts.min() > 850 and counts.max() < 1150, counts
    tracemalloc.start()
    p = sample_positions(10**9, 200_000, rng)  # 1/5000 of the rows: an arange would be 8 GB
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(np.unique(p)) == 200_000 and peak < 40 * 2**20, peak


def test_rows_digest_hashes_int64_ids_in_chunks(monkeypatch):
    """The fingerprint of the clustered rows in kmeans.json: no per-id Python at 10^9 rows, the same
    whatever the chunk size, different when the order or one id changes."""
    from curation.kmeans import dist as dist_kmeans

    ids = np.arange(0, 30_000, 3, dtype=np.int64)
    d = dist_kmeans.rows_digest(ids)
    assert dist_kmeans.rows_digest(ids.tolist()) == d
    monkeypatch.setattr(dist_kmeans, "DIGEST_CHUNK", 777)
    assert dist_kmeans.rows_digest(ids) == d
    assert dist_kmeans.rows_digest(ids[::-1]) != d
    other = ids.copy()
    other[5000] += 1
    assert dist_kmeans.rows_digest(other) != d


def photo_patches(n: int = 6000) -> np.ndarray:
    """Unit-norm 8x8 RGB patches (192 values) of scikit-image's photos: real, correlated rows."""
    from skimage import data as skdata

    rows = []
    for name in ("astronaut", "coffee", "chelsea", "rocket"):
        img = getattr(skdata, name)().astype(np.float32) / 255.0
        h, w = (img.shape[0] // 8) * 8, (img.shape[1] // 8) * 8
        p = img[:h, :w].reshape(h // 8, 8, w // 8, 8, 3).transpose(0, 2, 1, 3, 4).reshape(-1, 192)
        rows.append(p - p.mean(1, keepdims=True))
    x = np.concatenate(rows)[np.random.default_rng(0).permutation(sum(len(r) for r in rows))[:n]]
    x /= np.linalg.norm(x, axis=1, keepdims=True) + 1e-6
    return np.ascontiguousarray(x, np.float32)


def test_nearest_centroid_is_the_same_on_any_thread_count_and_block_shape():
    """The assignment's labels and distances depend only on the row and the centroids: faiss's BLAS distances
    change with the thread count and block shape (a run with W one-thread tasks picked other "closest" rows
    than one two-thread process, and at 3M rows another tree); the candidates' distances recomputed in float64
    equal a float64 brute force."""
    from curation.core.faisslib import faiss
    from curation.kmeans.hierarchical import Nearest

    x = photo_patches()
    c = x[np.random.default_rng(1).choice(len(x), 400, replace=False)] + 1e-3
    old = faiss.omp_get_max_threads()
    got, raw = {}, {}
    try:
        for threads in (1, 2):
            faiss.omp_set_num_threads(threads)
            near = Nearest(c, "cpu")
            got[threads, "whole"] = near(x)
            got[threads, "blocks"] = tuple(np.concatenate(v) for v in zip(*(near(x[s:s + 1000])
                                                                            for s in range(0, len(x), 1000))))
            index = faiss.IndexFlatL2(c.shape[1])
            index.add(c)
            raw[threads] = index.search(x, 1)[0][:, 0]
    finally:
        faiss.omp_set_num_threads(old)
    ref_lab, ref_dist = got[1, "whole"]
    for key, (lab, dist) in got.items():
        assert np.array_equal(lab, ref_lab), key
        assert np.array_equal(dist.view(np.uint32), ref_dist.view(np.uint32)), key
    full = np.concatenate([((x[s:s + 250, None, :].astype(np.float64) - c[None].astype(np.float64)) ** 2).sum(-1)
                           for s in range(0, len(x), 250)])  # float64 brute force, 250 rows at a time
    np.testing.assert_array_equal(ref_lab, full.argmin(1))
    np.testing.assert_array_equal(ref_dist, full.min(1).astype(np.float32))
    print(f"faiss's own distances differ on {int((raw[1] != raw[2]).sum())} of {len(x)} rows (1 vs 2 threads)")


def test_assign_counts_are_the_bincount_of_assign_for_any_batch():
    """The cluster mode counts the seeds per cluster a batch at a time (a seed set may hold millions: no label per
    seed kept): the counts equal bincount(assign(...)) for any batch size (the exact recomputation)."""
    from curation.kmeans.hierarchical import assign, assign_counts

    x = photo_patches(3000)
    cent = np.ascontiguousarray(x[::97], np.float32)
    want = np.bincount(assign(x, cent)[0], minlength=len(cent))
    for batch in (1000, 257, 4096):
        np.testing.assert_array_equal(assign_counts(x, cent, batch_size=batch), want)
    assert want.sum() == len(x) and (want > 0).sum() > 1
