"""The IVF training and the merge of the add tasks' lists are one task each of the step runner (issue 40): with the
local launcher each runs in a fresh process, so the training sample and its k-means, and the quantizer copies the
merge reads, are that task's memory, not the orchestrator's; the trained index, the merged lists and the search
results are those of the inline build; a rerun keeps the trained index."""

from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pytest

from curation.core.embstore import mark_task_done, save_shard, shard_stem
from curation.knn.index import Rows
from curation.knn.shards import KnnJob, RowSource
from curation.core import runner

N, D = 8000, 64
PARAMS = {"kind": "ivf", "nlist": 32, "nprobe": 4, "k": 5, "threshold": 0.9, "chunk_size": 2048,
          "train_size": N}
SAMPLE_BYTES = N * D * 4  # the training sample in fp32: 2 MB


@pytest.fixture(scope="module")
def emb_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("train_task") / "emb")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, D)).astype(np.float32)
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16)
    for i, s in enumerate(range(0, N, 3000)):
        ids = [f"img{j:07d}" for j in range(s, min(s + 3000, N))]
        save_shard(path, shard_stem(0, i), x[s:s + 3000], {"ids": ids, "sources": ["synthetic"] * len(ids),
                                                            "hashes": ["0"] * len(ids), "unreadable": []})
    mark_task_done(path, 0, 1, {"n": N})
    return path


def _build(out, emb_dir, launcher, monkeypatch):
    """The build under ``launcher`` (2 add tasks): its meta, the runner's records and the orchestrator's
    tracemalloc peak while the training ran (around the runner call, so the import of torch for the GPU
    count of a later call is not in it)."""
    import curation.knn.shards as ks
    from curation.core.embstore import open_embeddings

    peaks, real = [], ks.run_step

    def run_step(fn, *a, **kw):
        tracemalloc.reset_peak()
        out = real(fn, *a, **kw)
        if fn.__name__ == "index_train":
            peaks.append(tracemalloc.get_traced_memory()[1])
        return out

    monkeypatch.setattr(ks, "run_step", run_step)
    rows = Rows(open_embeddings(emb_dir))
    tracemalloc.start()
    try:
        with runner.recording() as rec:
            meta = KnnJob(out, "pool").build(rows, PARAMS, use_gpu=False, source=RowSource(emb_dir),
                                             tasks={"tasks": 2, "launcher": launcher})
    finally:
        tracemalloc.stop()
    return meta, rec, (peaks or [None])[0]


def test_training_runs_as_one_task_off_the_orchestrator_with_the_inline_index(emb_dir, tmp_path, monkeypatch):
    import faiss

    # one thread in the task processes and in this one: faiss's k-means sums in a thread-count-dependent order, so
    # trained indexes are compared bit for bit only at the same count (the product gives a lone local task all
    # the cores, as the orchestrator has)
    monkeypatch.setenv("CURATE_TASK_THREADS", "1")
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        inline_meta, inline_rec, inline_peak = _build(str(tmp_path / "inline"), emb_dir, "inline", monkeypatch)
    finally:
        faiss.omp_set_num_threads(threads)
    monkeypatch.setenv(runner.TRACE_ENV, "1")  # the task process reports tracemalloc's peak too
    local_meta, local_rec, local_peak = _build(str(tmp_path / "local"), emb_dir, "local", monkeypatch)

    train = [r for r in local_rec if r["fn"] == "index_train"]
    assert len(train) == 1 and train[0]["tasks"] == 1 and not train[0]["inline"]
    assert train[0]["reports"][0]["result"]["trained"].endswith("trained.index")
    # the sample was allocated in the task; the orchestrator never held it (inline, it did)
    assert train[0]["reports"][0]["traced_peak"] >= SAMPLE_BYTES
    assert inline_peak >= SAMPLE_BYTES > local_peak, (inline_peak, local_peak)
    assert [r["inline"] for r in inline_rec if r["fn"] == "index_train"] == [True]
    # the merge too: one task in a fresh process (the quantizer copies it reads and the parts' lists faiss leaves
    # mapped end with it)
    merge = [r for r in local_rec if r["fn"] == "index_merge"]
    assert len(merge) == 1 and merge[0]["tasks"] == 1 and not merge[0]["inline"]
    assert merge[0]["reports"][0]["result"]["ntotal"] == N
    assert [r["inline"] for r in inline_rec if r["fn"] == "index_merge"] == [True]

    # the same trained index and lists, so the same searches
    a, b = (tmp_path / "inline" / "knn" / "pool", tmp_path / "local" / "knn" / "pool")
    assert (a / "trained.index").read_bytes() == (b / "trained.index").read_bytes()
    assert (a / "index.faiss.ivfdata").read_bytes() == (b / "index.faiss.ivfdata").read_bytes()
    # (index.faiss itself names its .ivfdata file by path: "inline" is one letter longer than "local")
    assert inline_meta["index_bytes"] - len("inline") == local_meta["index_bytes"] - len("local")
    q = Rows(np.load(os.path.join(emb_dir, "part-00000-00000.npy")).astype(np.float32)).take(np.arange(500))
    (ia, _), (ib, _) = KnnJob(str(tmp_path / "inline"), "pool").load(), KnnJob(str(tmp_path / "local"), "pool").load()
    for got, want in zip(ib.search(q, 5), ia.search(q, 5)):
        np.testing.assert_array_equal(got, want)

    # resumable: a rerun with the same parameters keeps the trained index and does not train again
    stamp = (b / "trained.index").stat().st_mtime_ns
    _, again, _ = _build(str(tmp_path / "local"), emb_dir, "local", monkeypatch)
    assert [r for r in again if r["fn"] == "index_train"] == []
    assert (b / "trained.index").stat().st_mtime_ns == stamp
