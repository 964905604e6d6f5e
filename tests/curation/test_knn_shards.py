"""Sharded kNN: N array tasks find exactly the pairs of one task, a killed task is rerun and its
finished chunks are skipped, 1 and 3 worker processes give the same decisions.tsv, and the
faiss-gpu guards (multi-add flat shards, k/nprobe <= 2048) behave."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import faiss
import numpy as np
import pytest
from tests.curation.test_index_dedup import clustered

from curation.cli import main
from curation.knn.index import KnnIndex, Rows, iter_knn, set_nprobe, sharded_flat
from curation.config import GPU_MAX_K
from curation.knn.candidates import exact_cosine
from curation.knn.shards import KnnJob, chunk_path, merge_pairs

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "curation" / "quickstart.yaml")
PARAMS = {"k": 8, "threshold": 0.6, "nprobe": 8, "chunk_size": 500, "batch_size": 128, "rows": "t"}


def _pairs(job: KnnJob, n: int):
    r = job.read(n)
    return merge_pairs(r["a"], r["b"], r["sim"])


@pytest.mark.parametrize("kind", ["ivf", "ivf_pq"])
def test_three_tasks_find_the_pairs_of_one_and_a_killed_task_reruns_its_chunks(tmp_path, kind):
    x, groups = clustered(1500, 2, d=64)
    rows = Rows(x)
    one, three = KnnJob(str(tmp_path / "one")), KnnJob(str(tmp_path / "three"))
    one.build(rows, {**PARAMS, "kind": kind, "pq_m": 16}, use_gpu=False)
    shutil.copytree(one.dir, three.dir)  # the same trained index, as every array task reads it
    assert one.search_pairs(rows, 0, 1) == {"chunks": 6, "computed": 6, "skipped": 0}
    for t in range(3):
        three.search_pairs(rows, t, 3)
    # task 1 "killed": one chunk lost, a torn tmp file left behind; its rerun redoes only that chunk
    os.remove(chunk_path(three.chunks_dir, 3))
    Path(chunk_path(three.chunks_dir, 3) + ".tmp-123.npz").write_bytes(b"torn")
    assert three.search_pairs(rows, 1, 3) == {"chunks": 2, "computed": 1, "skipped": 1}
    a1, b1, s1 = _pairs(one, len(x))
    a3, b3, s3 = _pairs(three, len(x))
    np.testing.assert_array_equal(a1, a3)
    np.testing.assert_array_equal(b1, b3)
    np.testing.assert_array_equal(s1, s3)
    assert (groups[a1] == groups[b1]).mean() > 0.99 and len(a1) >= 1450  # the planted pairs
    # similarities are exact (float64 of the stored fp16 rows), even with lossy PQ codes
    np.testing.assert_array_equal(s1, exact_cosine(rows, a1, rows, b1))
    assert (s1 > 0.6).all()


def test_flat_pairs_are_the_exact_knn_pairs_above_the_threshold(tmp_path):
    x, _ = clustered(60, 3, d=32, noise=0.8)
    rows = Rows(x)
    job = KnnJob(str(tmp_path))
    job.build(rows, {**PARAMS, "kind": "flat", "k": 4, "chunk_size": 37, "batch_size": 10}, use_gpu=False)
    job.search_pairs(rows, 0, 1)
    a, b, _ = _pairs(job, len(x))
    x64 = x.astype(np.float64)
    full = x64 @ x64.T
    np.fill_diagonal(full, -np.inf)
    nn = np.argsort(-full, axis=1, kind="stable")[:, :4]
    want = {(min(i, j), max(i, j)) for i in range(len(x)) for j in nn[i] if full[i, j] > 0.6}
    assert set(zip(a.tolist(), b.tolist())) == want and len(want) > 50


def test_exact_cosine_does_not_depend_on_direction_or_batch_shape():
    """The threshold decision uses this value: 1-ulp noise from batch shapes cannot flip it."""
    x, _ = clustered(200, 2, d=384)
    rows = Rows(x)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, len(x), 5000), rng.integers(0, len(x), 5000)
    s = exact_cosine(rows, a, rows, b)
    np.testing.assert_array_equal(s, exact_cosine(rows, b, rows, a))
    np.testing.assert_array_equal(s, exact_cosine(rows, a, rows, b, piece=7))
    np.testing.assert_array_equal(s[123:124], exact_cosine(rows, a[123:124], rows, b[123:124]))


@pytest.mark.parametrize("quantizer", ["flat", "hnsw"])
def test_ivf_lists_and_results_are_the_same_on_any_thread_count_batch_shape_and_add_tasks(tmp_path, quantizer):
    """The IVF's coarse step (the list a row is stored in, the lists a query probes) is faiss's BLAS product,
    whose rounding moves with the thread count and block shape: with faiss's own coarse step the 14,000 photo
    patches below gave other similarities for ~2,000 (batch shape) to ~115,000 (threads) of 140,000 results and
    other neighbours for ~40, and a 2M-row simulation other ``nn_sim`` at W = 1 than at W = 4. With the exact
    coarse step every result is bit-identical: one thread or two, whole or 1,000-row blocks, rows added in one
    process or by three add tasks merged on disk (the sharded build)."""
    from curation.core.faisslib import faiss
    from curation.knn.index import load_ondisk
    from curation.knn.ondisk import add_part, merge_parts, train_ondisk
    from tests.curation.test_kmeans import photo_patches

    x = photo_patches(14000)
    trained = str(tmp_path / "trained.index")
    train_ondisk(Rows(x), trained, "ivf", nlist=300, quantizer=quantizer)
    old = faiss.omp_get_max_threads()
    got = {}
    try:
        for threads in (1, 2):
            faiss.omp_set_num_threads(threads)
            for bs in (len(x), 1000):
                knn = KnnIndex(faiss.read_index(trained), "ivf", 0, 8, False)
                set_nprobe(knn.index, 8, False)
                for s in range(0, len(x), bs):
                    knn.add(x[s:s + bs])
                got["inline", threads, bs] = tuple(np.concatenate(v) for v in zip(
                    *(knn.search(x[s:s + bs], 10) for s in range(0, len(x), bs))))
        faiss.omp_set_num_threads(2)
        parts = [str(tmp_path / f"part{t}.index") for t in range(3)]
        for t, p in enumerate(parts):
            lo, hi = t * len(x) // 3, (t + 1) * len(x) // 3
            add_part(trained, Rows(x), lo, hi, p, block=999)
        merge_parts(trained, parts, str(tmp_path / "merged.index"))
        knn = load_ondisk(str(tmp_path / "merged.index"), "ivf", 8)
        assert knn.coarse is not None
        got["3 add tasks", 2, 1000] = tuple(np.concatenate(v) for v in zip(
            *(knn.search(x[s:s + 1000], 10) for s in range(0, len(x), 1000))))
    finally:
        faiss.omp_set_num_threads(old)
    ref_sims, ref_idx = got["inline", 1, len(x)]
    # a working index: rows find themselves (the photos repeat some patches)
    assert (ref_idx[:, 0] == np.arange(len(x))).mean() > 0.95
    for key, (sims, idx) in got.items():
        assert np.array_equal(idx, ref_idx), key
        assert np.array_equal(sims.view(np.uint32), ref_sims.view(np.uint32)), key


def test_ivf_nprobe_above_nlist_probes_every_list():
    """nprobe larger than the lists there are (a small pool with DINOv2's nprobe): every list is probed, as with
    nprobe = nlist (the exact coarse step once laid out more columns than faiss reads: recall 0.03 in gpu-check)."""
    from curation.knn.index import build_index

    x, _ = clustered(100, 20, d=64)
    got = {}
    for nprobe in (10_000, None):
        knn = build_index(x, kind="ivf", nprobe=nprobe or 1, batch_size=500)
        if nprobe is None:
            set_nprobe(knn.index, knn.index.nlist, False)
        got[nprobe] = knn.search(np.asarray(x[:300], np.float32), 10)
    assert knn.index.nlist < 10_000
    assert np.array_equal(got[10_000][1], got[None][1]) and np.array_equal(got[10_000][0], got[None][0])
    assert (got[10_000][1][:, 0] == np.arange(300)).mean() > 0.95


def test_sharded_flat_accepts_many_adds():
    """index_cpu_to_all_gpus(IndexFlat, shard=True) builds IndexShards(successive_ids=True), which
    takes a single add(): reproduced on CPU, then the fix (explicit ids over IndexIDMap shards)."""
    d = 16
    x = np.random.default_rng(0).standard_normal((700, d)).astype(np.float32)
    old = faiss.IndexShards(d, True, True)
    for _ in range(3):
        old.add_shard(faiss.IndexFlatIP(d))
    old.add(x[:300])
    with pytest.raises(RuntimeError, match="successive_ids"):
        old.add(x[300:])
    knn = KnnIndex(sharded_flat(d, 3, lambda i: faiss.IndexFlatIP(d)), "flat", 0, 1, on_gpu=False)
    for s in range(0, 700, 256):  # batches as build_index adds them
        knn.add(x[s:s + 256])
    ref = faiss.IndexFlatIP(d)
    ref.add(x)
    assert knn.ntotal == 700
    _, got = knn.search(x[:50], 5)
    _, want = ref.search(x[:50], 5)
    np.testing.assert_array_equal(got, want)


def test_gpu_limits_are_checked_with_a_clear_error(tmp_path, capsys):
    x = np.eye(4, dtype=np.float32)
    ref = faiss.IndexFlatIP(4)
    ref.add(np.repeat(x, 600, axis=0))
    on_gpu = KnnIndex(ref, "flat", ref.ntotal, 1, on_gpu=True)  # a CPU index posing as a GPU one
    with pytest.raises(ValueError, match="k=2049 exceeds faiss-gpu's limit of 2048"):
        on_gpu.search(x, GPU_MAX_K + 1)
    with pytest.raises(ValueError, match="k\\+1 .* exceeds faiss-gpu's limit"):
        next(iter_knn(on_gpu, x, GPU_MAX_K, exclude_self=True))
    assert on_gpu.search(x, GPU_MAX_K)[1].shape == (4, GPU_MAX_K)
    # configs that ask for the GPU are refused up front, naming the key (exit 2, nothing written)
    with pytest.raises(SystemExit) as exc:
        main(["dedup", "--config", QUICKSTART, f"input.paths=[{tmp_path}]", f"output.dir={tmp_path / 'o'}",
              "knn.use_gpu=true", "dedup.k=4096"])
    assert exc.value.code == 2 and "dedup.k" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_embedder_release_keeps_it_usable():
    import torch

    from curation.embed.embedder import build_embedder

    e = build_embedder("vit_test", image_size=56, device="cpu")
    before = e(torch.zeros(1, 3, 56, 56))
    e.release()
    torch.testing.assert_close(e(torch.zeros(1, 3, 56, 56)), before)


# ------------------------------------------------------------------------------- 1 vs 3 workers


def _args(cmd, pool_root, eval_root, out, *extra):
    return [cmd, "--config", QUICKSTART, f"input.paths=[{pool_root}]", f"output.dir={out}", "progress=false",
            f"input.eval_paths=[{eval_root}]", "knn.chunk_size=6", "knn.batch_size=4", "rebalance.mode=none",
            "report.enabled=false", *extra]


def test_one_and_three_search_workers_give_identical_decisions(pool_dir, photos, tmp_path):
    """`curate dedup` searching in its own process vs `curate index` + 3 concurrent `curate search`
    processes (what the Slurm array runs), on the same embeddings: byte-identical decisions.tsv."""
    root, groups = pool_dir
    eval_root = tmp_path / "eval"
    eval_root.mkdir()
    for name in sorted(photos)[3:9:2]:  # three pool photos are also test images
        shutil.copy(root / f"{name}.jpg", eval_root / f"{name}.jpg")
    base = tmp_path / "embedded"
    assert main(_args("embed", root, eval_root, base)) == 0
    one, three = tmp_path / "one", tmp_path / "three"
    shutil.copytree(base, one)
    shutil.copytree(base, three)
    assert main(_args("index", root, eval_root, three)) == 0
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "curation.cli", *_args(
        "search", root, eval_root, three, f"knn.task_index={t}", "knn.num_tasks=3")], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for t in range(3)]
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out
    chunks = sorted(os.listdir(three / "knn" / "pool" / "chunks"))
    assert len(chunks) >= 5 and all(c.endswith(".npz") and ".tmp" not in c for c in chunks)
    assert not list((three / "knn").glob("survivors-*"))  # each process's mapped positions: unlinked once mapped
    for out_dir in (one, three):
        for step in ("dedup", "decontaminate", "rebalance", "write"):
            assert main(_args(step, root, eval_root, out_dir)) == 0, (out_dir, step)
    d1, d3 = (one / "decisions.tsv").read_text(), (three / "decisions.tsv").read_text()
    assert d1 == d3
    statuses = [line.split("\t")[2] for line in d1.splitlines()[1:]]
    assert statuses.count("decontaminated") >= 3 and statuses.count("copy_duplicates") >= 1


def test_a_query_fraction_searches_the_same_rows_for_any_tasks_and_finds_their_pairs_of_a_full_search(tmp_path):
    """`curate simulate --query-fraction` (the growth bench's 10M stand-in): the rows that query are a function of
    the row alone (the same for 1 or 3 tasks and any chunk size), every row stays indexed, and the pairs found
    are exactly the full search's pairs whose query end is such a row."""
    from curation.knn.candidates import queried

    x, _ = clustered(750, 2, d=64)
    n = len(x)
    rows = Rows(np.concatenate([np.zeros((3, 64), np.float16), x]), np.arange(3, 3 + n))  # a view, as survivors are
    full, one, three = (KnnJob(str(tmp_path / s)) for s in ("full", "one", "three"))
    full.build(rows, {**PARAMS, "kind": "ivf"}, use_gpu=False)
    for job, chunk in ((one, 500), (three, 300)):
        shutil.copytree(full.dir, job.dir)  # the same trained index; the fraction is a search parameter
        meta = job.meta()
        meta["params"].update(query_fraction=0.3, chunk_size=chunk)
        (Path(job.meta_path)).write_text(__import__("json").dumps(meta))
    full.search_pairs(rows, 0, 1)
    one.search_pairs(rows, 0, 1)
    for t in range(3):
        three.search_pairs(rows, t, 3)
    asked = queried(rows, 0, len(rows), 0.3)
    np.testing.assert_array_equal(asked, np.concatenate([queried(rows, s, min(s + 300, n), 0.3)
                                                         for s in range(0, n, 300)]))
    assert 350 < len(asked) < 550  # ~30% of 1,500
    a, b, s = _pairs(full, n)
    r = full.read(n)
    is_asked = np.isin(np.arange(n), asked)
    want_a, want_b = r["a"][is_asked[r["a"]]], r["b"][is_asked[r["a"]]]
    want = merge_pairs(want_a, want_b, r["sim"][is_asked[r["a"]]])
    for job in (one, three):
        got = _pairs(job, n)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        nn = job.read(n, keys=("nn_sim",))["nn_sim"]
        np.testing.assert_array_equal(nn[asked], r["nn_sim"][asked])
        assert np.isneginf(nn[~is_asked]).all()
    assert len(want[0]) < len(a)


def test_the_survivors_positions_of_an_array_task_are_mapped_not_held(tmp_path):
    """`curate index` and every `curate search` task read the hash survivors' positions (8 GB as int64 at 10^9
    rows) from a memory-mapped file of their own, written a block at a time and unlinked once mapped: the same
    positions, no file left, and a traced peak of the block's temporaries (measured 0.53 B per survivor at 1.8M
    survivors, constant in the rows; np.flatnonzero held 8)."""
    import tracemalloc

    from curation.knn.jobs import mapped_positions

    keep = np.random.default_rng(0).random(2_000_000) > 0.1
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    try:
        got = mapped_positions(str(tmp_path / "knn"), keep)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(got, np.flatnonzero(keep))
    assert isinstance(got, np.memmap) and os.listdir(tmp_path / "knn") == []
    assert peak < 2 * keep.sum(), f"{peak / keep.sum():.2f} B per survivor"
