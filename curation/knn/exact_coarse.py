"""The coarse step of a CPU inner-product IVF made exact (curation.knn.index adds and searches through it).

faiss's coarse quantizer is a BLAS product (flat) or a graph walk over such distances (HNSW); the flat one's
rounding depends on the OpenMP thread count and the block shape, as curation.kmeans.hierarchical.Nearest measured for k-means,
so W one-thread tasks and one process of all cores put some rows in other lists or probed other lists. Here the
lists are chosen by inner products recomputed in float64 (the same for a row on any thread count or batch shape).
"""

from __future__ import annotations

import numpy as np

from curation.core.faisslib import faiss

COARSE_RERANK = 3
"""Extra lists the coarse quantizer proposes per vector beyond the ones used (1 when adding, nprobe when
searching); the used ones are then chosen by inner products recomputed in float64 (:class:`ExactCoarse`)."""
EXACT_ROWS = 1024
"""Rows per chunk of the float64 recomputation (EXACT_ROWS x D float64 arrays: 3 MB each at D=384)."""


def exact_ip(x: np.ndarray, centroids: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """Inner product of each row of ``x`` (B, D) with its candidates ``centroids[cand]`` (cand (B, k) int64,
    -1: none) -> (B, k) float64 (-inf where none): the products in float64 (exact for float32 inputs), each row
    summed by numpy in its fixed order (as ``knn_candidates.exact_cosine``), so the value is the same for a row
    whatever the batch, thread count or process. Temporaries: EXACT_ROWS x D float64, three of them."""
    out = np.full(cand.shape, -np.inf)
    for s in range(0, len(x), EXACT_ROWS):
        xs = np.asarray(x[s:s + EXACT_ROWS], np.float64)
        cs = cand[s:s + EXACT_ROWS]
        buf = np.empty_like(xs)
        for j in range(cand.shape[1]):
            ok = cs[:, j] >= 0
            if ok.all():
                np.multiply(xs, centroids[cs[:, j]], out=buf)
                out[s:s + EXACT_ROWS, j] = buf.sum(axis=1)
            elif ok.any():
                out[s:s + EXACT_ROWS, j][ok] = (xs[ok] * centroids[cs[ok, j]]).sum(axis=1)
    return out


class ExactCoarse:
    """The coarse step of a CPU inner-product IVF (the lists a stored vector goes to, the lists a query probes),
    independent of the thread count and batch shape.

    faiss's coarse quantizer is a BLAS product (flat) or a graph walk over such distances (HNSW); the flat one's
    rounding depends on the OpenMP thread count and the block shape, as curation.kmeans.hierarchical.Nearest measured for
    k-means. A run of W task processes of one thread and one of a single process of all cores then put some
    rows in other lists or probed other lists, and the copy search's ``nn_sim`` (2M simulated rows) differed
    between W = 1 and W = 4. Here the quantizer proposes ``n + COARSE_RERANK`` lists, their inner products with
    the vector are recomputed in float64 (:func:`exact_ip`), and the best ``n`` are taken (ties: the lower
    list); faiss then adds (``add_core``) or scans (``search_preassigned``) exactly those lists, the scan
    starting from these coarse values. The centroids are read in place from the quantizer (no copy)."""

    def __init__(self, ivf):
        self.ivf = ivf
        q = faiss.downcast_index(ivf.quantizer)
        flat = faiss.downcast_index(q.storage) if isinstance(q, faiss.IndexHNSW) else q
        self.nlist, d = int(flat.ntotal), int(flat.d)
        self.centroids = faiss.rev_swig_ptr(flat.get_xb(), self.nlist * d).reshape(self.nlist, d)

    @staticmethod
    def applies(index, on_gpu: bool) -> bool:
        """A CPU IVF (not wrapped) over inner products whose quantizer stores its centroids as floats."""
        if on_gpu or not isinstance(index, faiss.IndexIVF) or index.metric_type != faiss.METRIC_INNER_PRODUCT:
            return False
        q = faiss.downcast_index(index.quantizer)
        return isinstance(q, faiss.IndexFlat) or (isinstance(q, faiss.IndexHNSW)
                                                  and isinstance(faiss.downcast_index(q.storage), faiss.IndexFlat))

    def __call__(self, x: np.ndarray, n: int, with_dis: bool = True) -> tuple[np.ndarray | None, np.ndarray]:
        """(B, D) fp32 -> (coarse inner products (B, n) fp32 or None, lists (B, n) int64; -1 / -inf where fewer).
        Temporaries are EXACT_ROWS rows long; the results B x n."""
        n = min(n, self.nlist)
        dis = np.empty((len(x), n), np.float32) if with_dis else None
        lists = np.empty((len(x), n), np.int64)
        for s in range(0, len(x), EXACT_ROWS):  # temporaries of EXACT_ROWS rows, whatever the block
            xs = x[s:s + EXACT_ROWS]
            _, cand = self.ivf.quantizer.search(xs, min(n + COARSE_RERANK, self.nlist))
            cand = cand.astype(np.int64, copy=False)
            sim = exact_ip(xs, self.centroids, cand)
            order = np.lexsort((np.where(cand >= 0, cand, np.iinfo(np.int64).max), -sim), axis=1)[:, :n]
            best = np.take_along_axis(sim, order, axis=1)
            lists[s:s + EXACT_ROWS] = np.where(np.isfinite(best), np.take_along_axis(cand, order, axis=1), -1)
            if dis is not None:
                dis[s:s + EXACT_ROWS] = best
        return dis, lists

    def add(self, x: np.ndarray, ids: np.ndarray) -> None:
        """``add_with_ids`` with each vector in its exact nearest list."""
        lists = self(x, 1, with_dis=False)[1].reshape(-1)
        ids = np.ascontiguousarray(ids, np.int64)
        self.ivf.add_core(len(x), faiss.swig_ptr(x), faiss.swig_ptr(ids), faiss.swig_ptr(lists))


__all__ = ["ExactCoarse", "exact_ip", "COARSE_RERANK", "EXACT_ROWS"]
