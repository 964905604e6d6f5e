"""What a kNN search task holds that does not follow its share of rows (issue 40): the exact rescoring's
temporaries (a fixed number of pairs at a time, now 2,048: ~22 MB at D = 384, was 16,384: ~176 MB) and, for the
pairs' readers, a chunk file's arrays they never use (read only when asked for). The values do not move."""

from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pytest

from curation.knn.index import Rows
from curation.knn.candidates import EXACT_PIECE, exact_cosine
from curation.knn.shards import KnnJob, chunk_path, iter_chunks, pair_keys, read_chunks


pytestmark = pytest.mark.memory  # measured in a session of its own (`make test`'s second pytest run)


def _unit(rng, n, d):
    x = rng.standard_normal((n, d)).astype(np.float32)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16)


def _traced(fn):
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_nearest_search_chunk_holds_its_batch_not_a_fixed_16k_pairs_of_float64_rows(tmp_path):
    rng = np.random.default_rng(0)
    d, nq = 384, 16384
    ev, q = Rows(_unit(rng, 1000, d)), Rows(_unit(rng, nq, d))
    job = KnnJob(str(tmp_path), "eval")
    job.build(ev, {"kind": "flat", "k": 4, "chunk_size": nq, "batch_size": 8192}, use_gpu=False)
    _, peak = _traced(lambda: job.search_nearest(q, ev))
    # one batch: 8,192 queries x 4 candidates = 32,768 pairs rescored. Rescoring 16,384 at a time took two
    # (16,384, 384) fp32 gathers + two float64 copies + their product: 176 MB at the peak; 2,048 at a time 22 MB
    fixed_16k = 16384 * d * (4 + 4 + 8 + 8 + 8)
    assert peak < fixed_16k / 3, peak
    r = job.read(nq)
    # the same answers as one unpieced exact rescoring of the best candidate
    assert (r["idx"] >= 0).all()
    np.testing.assert_array_equal(r["sim"], exact_cosine(q, np.arange(nq), ev, r["idx"], piece=nq))


def test_exact_cosine_is_the_same_for_any_piece():
    rng = np.random.default_rng(1)
    x = Rows(_unit(rng, 3000, 64))
    a, b = rng.integers(0, 3000, 10000), rng.integers(0, 3000, 10000)
    ref = exact_cosine(x, a, x, b, piece=len(a))
    for piece in (1, 7, EXACT_PIECE, 16384):
        np.testing.assert_array_equal(exact_cosine(x, a, x, b, piece=piece), ref)


def test_the_pairs_readers_never_read_a_chunks_unused_arrays(tmp_path):
    folder = str(tmp_path / "chunks")

    os.makedirs(folder)
    n, rows = 2_000_000, np.arange(2_000_000)
    pairs = {"a": np.array([0, 5, 7], np.int64), "b": np.array([5, 0, 9], np.int64),
             "sim": np.array([0.9, 0.9, 0.2])}
    np.savez(chunk_path(folder, 0), **pairs, nn_sim=np.ones(n, np.float32), nn_idx=rows)  # 24 MB unused
    keys, peak = _traced(lambda: pair_keys(iter_chunks(folder, n, n), n, 0.5))
    assert keys.tolist() == [0 * n + 5]
    assert peak < n * 4, peak  # neither nn_idx (16 MB) nor nn_sim (8 MB) was read
    got, peak = _traced(lambda: read_chunks(folder, n, n, keys=("a", "sim")))
    assert sorted(got) == ["a", "sim"] and peak < n * 4, peak
    (start, chunk), = list(iter_chunks(folder, n, n))
    assert start == 0 and sorted(chunk) == ["a", "b", "nn_idx", "nn_sim", "sim"]
    np.testing.assert_array_equal(chunk["nn_idx"], rows)
    np.testing.assert_array_equal(dict(chunk)["b"], pairs["b"])
