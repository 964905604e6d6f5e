"""faiss kNN search over L2-normalised embeddings (cosine = inner product).

Index choice by pool size, as in DINOv2's curation: exact ``IndexFlatIP`` for small pools, an
inverted file (IVF, ``nlist ~ 4 sqrt(N)``, ``nprobe`` lists visited per query) for large ones.
With faiss-gpu and visible GPUs the index is sharded over all of them; otherwise faiss-cpu runs.
Embeddings arrive as fp16 (memory-mapped) and are converted to fp32 one batch at a time, both
when adding and when querying. IVF stores vectors as fp16 (they were fp16 anyway: no loss).
"""

from __future__ import annotations

import math
from typing import Iterator

from ._faiss import faiss
import numpy as np

from .embeddings import EmbeddingSet

FLAT_MAX_DEFAULT = 50_000  # exact search up to here (~1 min for 50k x 50k x 384 on 2 cores)


class Rows:
    """Uniform batched access to an in-memory array, a memmap or an :class:`EmbeddingSet`,
    optionally restricted to a subset of row positions."""

    def __init__(self, data, indices: np.ndarray | None = None):
        if isinstance(data, Rows):
            base = data.indices if data.indices is not None else None
            if indices is not None and base is not None:
                indices = base[indices]
            elif indices is None:
                indices = base
            data = data.data
        self.data = data
        self.indices = None if indices is None else np.asarray(indices, np.int64)

    def __len__(self) -> int:
        return len(self.indices) if self.indices is not None else len(self.data)

    @property
    def dim(self) -> int:
        return self.data.dim if isinstance(self.data, EmbeddingSet) else self.data.shape[1]

    def take(self, positions: np.ndarray) -> np.ndarray:
        """fp32 rows at ``positions`` (positions within this view)."""
        rows = positions if self.indices is None else self.indices[positions]
        if isinstance(self.data, EmbeddingSet):
            return self.data.rows(rows)
        return np.asarray(self.data[rows], dtype=np.float32)

    def batches(self, batch_size: int) -> Iterator[tuple[int, np.ndarray]]:
        for start in range(0, len(self), batch_size):
            pos = np.arange(start, min(start + batch_size, len(self)))
            yield start, np.ascontiguousarray(self.take(pos))


def num_gpus() -> int:
    try:
        return faiss.get_num_gpus()
    except AttributeError:  # faiss-cpu builds may lack the symbol
        return 0


class KnnIndex:
    """A built faiss index plus the knobs needed to query it."""

    def __init__(self, index, kind: str, ntotal: int, nprobe: int, on_gpu: bool):
        self.index, self.kind, self.ntotal, self.nprobe, self.on_gpu = index, kind, ntotal, nprobe, on_gpu

    def search(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(B, D) fp32 queries -> (sims (B, k) fp32, positions (B, k) int64; -1 where missing)."""
        k = min(k, self.ntotal)
        if k <= 0:
            return np.zeros((len(x), 0), np.float32), np.zeros((len(x), 0), np.int64)
        sims, idx = self.index.search(np.ascontiguousarray(x, dtype=np.float32), k)
        return sims, idx

    def __repr__(self) -> str:
        return f"KnnIndex(kind={self.kind}, n={self.ntotal}, nprobe={self.nprobe}, gpu={self.on_gpu})"


def build_index(data, kind: str = "auto", nlist: int | None = None, nprobe: int = 16,
                flat_max: int = FLAT_MAX_DEFAULT, use_gpu: bool | str = "auto",
                batch_size: int = 65536, train_size: int | None = None, seed: int = 0) -> KnnIndex:
    """Build an inner-product index over ``data`` (array, memmap, EmbeddingSet or :class:`Rows`).

    ``kind``: 'flat' (exact), 'ivf', or 'auto' (flat up to ``flat_max`` vectors, else ivf).
    """
    rows = data if isinstance(data, Rows) else Rows(data)
    n, d = len(rows), rows.dim
    if kind == "auto":
        kind = "flat" if n <= flat_max else "ivf"
    if kind not in ("flat", "ivf"):
        raise ValueError(f"index kind {kind!r}: choose 'auto', 'flat' or 'ivf'")
    if kind == "ivf" and n < 2 * 39:
        kind = "flat"  # too few points to train even a handful of lists
    ngpu = num_gpus() if use_gpu in (True, "auto") else 0
    if use_gpu is True and ngpu == 0:
        raise RuntimeError("use_gpu=True but faiss sees no GPU (is faiss-gpu installed and CUDA "
                           "visible?); use use_gpu='auto' to fall back to faiss-cpu")
    if kind == "flat":
        cpu_index = faiss.IndexFlatIP(d)
        index = _to_gpus(cpu_index, ngpu) if ngpu else cpu_index
    else:
        nlist = nlist or max(1, min(int(4 * math.sqrt(n)), n // 39))
        index = _train_ivf(rows, d, nlist, ngpu, train_size or nlist * 64, seed)
        _set_nprobe(index, nprobe, ngpu > 0)
    for _, x in rows.batches(batch_size):
        index.add(x)
    return KnnIndex(index, kind, n, nprobe, ngpu > 0)


def _train_ivf(rows: Rows, d: int, nlist: int, ngpu: int, train_size: int, seed: int):
    quantizer = faiss.IndexFlatIP(d)
    ivf = faiss.IndexIVFScalarQuantizer(quantizer, d, nlist, faiss.ScalarQuantizer.QT_fp16,
                                        faiss.METRIC_INNER_PRODUCT)
    ivf.cp.seed = seed
    # Train on a fixed random sample: only that sample is ever fp32 in memory at once.
    rng = np.random.default_rng(seed)
    n = len(rows)
    sample = np.sort(rng.choice(n, size=min(n, train_size), replace=False))
    x = np.ascontiguousarray(rows.take(sample))
    if ngpu:
        res = faiss.StandardGpuResources()
        gpu_ivf = faiss.index_cpu_to_gpu(res, 0, ivf)
        gpu_ivf.train(x)
        ivf = faiss.index_gpu_to_cpu(gpu_ivf)
        return _to_gpus(ivf, ngpu)  # trained once, then sharded: every shard shares the lists
    ivf.train(x)
    return ivf


def _to_gpus(cpu_index, ngpu: int):
    co = faiss.GpuMultipleClonerOptions()
    co.shard = True  # each GPU holds 1/ngpu of the vectors (a replica would hold all)
    co.useFloat16 = True
    return faiss.index_cpu_to_all_gpus(cpu_index, co=co, ngpu=ngpu)


def _set_nprobe(index, nprobe: int, on_gpu: bool) -> None:
    if on_gpu:
        faiss.GpuParameterSpace().set_index_parameter(index, "nprobe", nprobe)
    else:
        faiss.extract_index_ivf(index).nprobe = nprobe


def iter_knn(index: KnnIndex, queries, k: int, batch_size: int = 8192,
             exclude_self: bool = False) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Yield ``(query positions, sims (B, k), neighbour positions (B, k))`` batch by batch.

    With ``exclude_self`` the queries are the indexed rows themselves: each row's own entry is
    removed (one extra neighbour is fetched for it) and missing neighbours are -1 / -inf.
    """
    rows = queries if isinstance(queries, Rows) else Rows(queries)
    kk = min(k + 1 if exclude_self else k, index.ntotal)
    for start, x in rows.batches(batch_size):
        sims, idx = index.search(x, kk)
        pos = np.arange(start, start + len(x))
        if exclude_self:
            sims, idx = _drop_self(sims, idx, pos, k)
        yield pos, sims, idx


def _drop_self(sims, idx, pos, k):
    """Remove each query's own position; keep the first k others (rows with no self: drop last)."""
    is_self = idx == pos[:, None]
    # Rows without a self hit (possible with IVF, or ties among exact duplicates) drop their
    # last entry instead, so every row keeps exactly k' = kk - 1 neighbours.
    no_self = ~is_self.any(axis=1)
    is_self[no_self, -1] = True
    keep = ~is_self
    out_k = idx.shape[1] - 1
    sims = sims[keep].reshape(len(idx), out_k)[:, :k]
    idx = idx[keep].reshape(len(idx), out_k)[:, :k]
    idx = np.where(idx < 0, -1, idx)
    sims = np.where(idx < 0, -np.inf, sims).astype(np.float32)
    return sims, idx
