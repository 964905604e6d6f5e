"""The IVF build with GPUs visible takes the on-disk path (issue 40): trained once on a sample (its k-means handed
the GPUs), filled by W add tasks, merged on disk -- no process adds the whole pool. faiss-cpu stands in: the build
is told it sees 2 GPUs and the training runs the same code with the k-means on the CPU, so the code path a GPU
node takes is the one tested, and it gives exactly the index of a CPU build."""

from __future__ import annotations

import numpy as np

import curation.knn.ondisk as ixd
import curation.knn.shards as ks
from curation.knn.index import Rows
from curation.knn.shards import KnnJob


def test_a_gpu_build_is_trained_once_and_added_by_w_tasks(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3000, 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    rows = Rows(x)
    params = {"kind": "ivf", "nlist": 16, "nprobe": 4, "k": 5, "threshold": 0.9, "chunk_size": 256}
    cpu = KnnJob(str(tmp_path / "cpu"), "pool")
    meta_cpu = cpu.build(rows, params, use_gpu=False, tasks={"tasks": 3, "launcher": "inline"})

    seen = []
    real_train = ixd.train_cpu_index

    def train(*a, ngpu=0, **kw):  # the GPU k-means is faiss-gpu's; faiss-cpu trains the same index here
        seen.append(ngpu)
        return real_train(*a, ngpu=0, **kw)

    monkeypatch.setattr(ks, "gpus_for", lambda use_gpu: 2)
    monkeypatch.setattr(ixd, "train_cpu_index", train)
    gpu = KnnJob(str(tmp_path / "gpu"), "pool")
    meta = gpu.build(rows, params, use_gpu="auto", tasks={"tasks": 3, "launcher": "inline"})
    assert seen == [2]  # the sample's k-means was handed the GPUs, once
    assert meta["ondisk"] and meta["add_tasks"] == 3  # three add tasks, merged on disk
    monkeypatch.undo()
    a, _ = cpu.load()
    b, _ = gpu.load()
    q = x[:500]
    for got, want in zip(b.search(q, 5), a.search(q, 5)):
        np.testing.assert_array_equal(got, want)
    assert meta_cpu["kind"] == meta["kind"] == "ivf"
