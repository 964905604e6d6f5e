"""The IVF sizing policy and the HNSW coarse quantizer: recall against exact search on real data (sklearn's
digits, with planted near-copies) no worse than the flat quantizer's; the trained index the same in every
run (the graph built by one thread); W = 1 and 3 add tasks merged on disk search exactly like one process."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import load_digits

from curation.knn import index as ix
from curation.knn import ondisk as ixd
from curation.knn.index import Rows, build_index, ivf_nlist, resolve_quantizer, train_cpu_index
from curation.knn.shards import KnnJob, run_search


@pytest.fixture(scope="module")
def digits():
    """1,797 digit images (64 pixels) centred and L2-normalised, plus a near-copy (cosine ~0.99) of every
    third one: fp16 rows and the (original, copy) pairs."""
    x = load_digits().data.astype(np.float64)
    x -= x.mean(0)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    rng = np.random.default_rng(0)
    src = np.arange(0, len(x), 3)
    cp = x[src] + 0.1 * rng.standard_normal((len(src), x.shape[1])) / np.sqrt(x.shape[1])
    cp /= np.linalg.norm(cp, axis=1, keepdims=True)
    rows = np.concatenate([x, cp]).astype(np.float16)
    return rows, src, len(x) + np.arange(len(src))


def _recall(knn, x, k=5):
    exact = x @ x.T
    truth = np.argsort(-exact, 1)[:, :k]
    _, got = knn.search(x, k)
    return np.mean([len(set(a) & set(b)) / k for a, b in zip(got, truth)]), got


def test_policy():
    assert ivf_nlist(1_000_000) == 4000 and ivf_nlist(100_000_000) == 40_000  # 4 sqrt(N) up to 256M rows,
    assert ivf_nlist(1_000_000_000) == 250_000  # then N / 4000
    assert ivf_nlist(10_000_000, 1000, sqrt_factor=1.0) == 10_000  # the simulation's policy
    assert ivf_nlist(1000) == 1000 // 39  # >= 39 training points per list
    assert resolve_quantizer("auto", ix.HNSW_MIN_NLIST - 1) == "flat"
    assert resolve_quantizer("auto", ix.HNSW_MIN_NLIST) == "hnsw"
    assert ix.factory_string("ivf_sq8", 64, 50_000, quantizer="auto") == "IVF50000_HNSW32,SQ8"
    assert ix.factory_string("ivf_sq8", 64, 9000, quantizer="auto") == "IVF9000,SQ8"  # flat is cheaper there
    assert ix.factory_string("ivf", 64, 100, quantizer="auto") == "IVF100,SQfp16"
    with pytest.raises(ValueError, match="quantizer"):
        resolve_quantizer("ivf", 10)


def test_hnsw_quantizer_recall_against_flat(digits):
    rows, src, dst = digits
    x = rows.astype(np.float32)
    got = {}
    for q in ("flat", "hnsw"):
        knn = build_index(rows, kind="ivf_sq8", nlist=32, nprobe=4, use_gpu=False, quantizer=q)
        assert ("HNSW" in type(ix.faiss.downcast_index(ix.faiss.extract_index_ivf(knn.index).quantizer)).__name__) \
            == (q == "hnsw")
        got[q] = _recall(knn, x)
    assert got["hnsw"][0] >= got["flat"][0] - 0.01, (got["hnsw"][0], got["flat"][0])
    assert got["flat"][0] >= 0.9
    for q in got:  # every planted copy is among its original's neighbours
        nb = got[q][1]
        found = np.mean([(nb[s] == d).any() or (nb[d] == s).any() for s, d in zip(src, dst)])
        assert found >= 0.98, (q, found)


def test_hnsw_trained_index_is_the_same_in_every_run(digits):
    rows, _, _ = digits
    a, b = (ix.faiss.serialize_index(train_cpu_index(Rows(rows), "ivf_sq8", 48, None, 0, quantizer="hnsw"))
            for _ in range(2))
    np.testing.assert_array_equal(a, b)


def test_ondisk_hnsw_index_w1_w3_equals_one_process(digits, tmp_path):
    rows = Rows(digits[0])
    params = {"kind": "ivf_sq8", "nlist": 24, "quantizer": "hnsw", "nprobe": 4, "k": 6, "threshold": 0.8,
              "chunk_size": 256}
    got = {}
    for w in (1, 3):
        job = KnnJob(str(tmp_path / f"w{w}"), "pool")
        meta = job.build(rows, params, use_gpu=False, tasks={"tasks": w, "launcher": "inline"})
        assert meta["ondisk"] and meta["add_tasks"] == w
        run_search(str(tmp_path / f"w{w}"), "pool", "pairs", rows, tasks={"tasks": w, "launcher": "inline"})
        got[w] = job.read(len(rows))
        index, _ = job.load()
        sims, idx = index.search(rows.take(np.arange(len(rows))), 6)
        got[w]["raw"] = np.concatenate([sims, idx.astype(np.float32)], 1)
    ref = build_index(rows, kind="ivf_sq8", nlist=24, nprobe=4, use_gpu=False, quantizer="hnsw")
    sims, idx = ref.search(rows.take(np.arange(len(rows))), 6)
    np.testing.assert_array_equal(got[1]["raw"], np.concatenate([sims, idx.astype(np.float32)], 1))
    for key in got[1]:
        np.testing.assert_array_equal(got[1][key], got[3][key])
    assert len(got[1]["a"]) >= len(digits[1])  # the planted copies at least


@pytest.mark.parametrize("quantizer", ["flat", "hnsw"])
def test_add_in_two_timed_halves_equals_faiss_add(digits, tmp_path, quantizer):
    """add_part assigns the lists (quantizer.assign) and adds with them (add_core) as two timed calls:
    every list holds the same ids and codes as faiss's own add_with_ids of the same rows."""
    rows = Rows(digits[0])
    trained = str(tmp_path / "trained.index")
    ixd.train_ondisk(rows, trained, "ivf_sq8", 24, None, 0, quantizer=quantizer)
    times: dict = {}
    assert ixd.add_part(trained, rows, 100, len(rows), str(tmp_path / "part.index"), block=500, timings=times) \
        == len(rows) - 100
    assert set(times) == {"assign_s", "encode_s"} and times["assign_s"] > 0 and times["encode_s"] > 0
    ref = ix.faiss.read_index(trained)
    ref.add_with_ids(np.ascontiguousarray(rows.take(np.arange(100, len(rows)))), np.arange(100, len(rows)))
    got = ix.faiss.read_index(str(tmp_path / "part.index"))
    a, b = ix.faiss.extract_index_ivf(got).invlists, ix.faiss.extract_index_ivf(ref).invlists
    rev = ix.faiss.rev_swig_ptr
    for li in range(24):
        n = a.list_size(li)
        assert n == b.list_size(li)
        np.testing.assert_array_equal(rev(a.get_ids(li), n), rev(b.get_ids(li), n))
        np.testing.assert_array_equal(rev(a.get_codes(li), n * a.code_size), rev(b.get_codes(li), n * b.code_size))
