"""The IVF built by W tasks, on disk.

faiss's own pattern (faiss/contrib/ondisk.py, benchs/distributed_ondisk): train once on a sample, let every task
add its rows to a copy of the empty trained index and write its inverted lists to its own file, then merge the
lists into one OnDiskInvertedLists file. No process holds all vectors: a task holds the codes of its N/W rows; the
merge and the searches memory-map the lists (:func:`curation.knn.index.load_ondisk`)."""

from __future__ import annotations

import os
import time

import numpy as np

from dinopipe.utils.io import atomic_path

from curation.core.faisslib import faiss
from curation.knn.exact_coarse import ExactCoarse
from curation.knn.index import Rows, default_nlist, train_cpu_index


def train_ondisk(rows: Rows, path: str, kind: str = "ivf_sq8", nlist: int | None = None,
                 train_size: int | None = None, seed: int = 0, pq_m: int = 0, quantizer: str = "auto",
                 ngpu: int = 0) -> None:
    """Train an empty IVF on a fixed random sample of ``rows`` and write it to ``path`` (once). Every add
    task reads this file, so all of them hold the same coarse quantizer (an HNSW graph included). ``ngpu``:
    the sample's k-means on a GPU (the trained index is a CPU one either way)."""
    if os.path.exists(path):
        return
    index = train_cpu_index(rows, kind, nlist or default_nlist(len(rows)), train_size, seed, pq_m, ngpu=ngpu,
                            quantizer=quantizer)
    with atomic_path(path) as tmp:
        faiss.write_index(index, tmp)


ADD_ROWS = 16384
"""Rows an add reads, assigns and encodes at a time (a task owns whole blocks of ``block`` rows; inside one it walks
pieces of this many): the temporaries -- the fp16 gather, its fp32 copy, the coarse step's -- are ~1.3 KB per row of
a piece at 128-d; measured (tracemalloc) 84 MB for 65,536-row pieces, 22 MB for 16,384. The lists and codes are
the same for any piece size (the coarse step is exact: curation.knn.exact_coarse)."""


def add_part(trained_path: str, rows: Rows, lo: int, hi: int, path: str, block: int = 65536,
             timings: dict | None = None) -> int:
    """Add rows [lo, hi) (ids = row positions) to a copy of the trained index; write it to ``path``.
    Rerun-safe: an existing part is kept. The two halves of an IVF add run as separate calls (the exact
    coarse assignment, :class:`ExactCoarse`, then faiss's ``add_core`` with the precomputed lists, the pattern
    of its distributed benchmarks): a row lands in the same list whichever task adds it; and ``timings`` (if
    given) gets ``assign_s`` -- the coarse quantizer, whose cost per
    vector grows with nlist (IVF cost model, docs/curation-scale.md) -- and ``encode_s`` (encoding and
    appending: constant per vector)."""
    if os.path.exists(path):
        return 0
    block = min(block, ADD_ROWS)
    index = faiss.read_index(trained_path)
    ivf = index if ExactCoarse.applies(index, False) else None  # a wrapped IVF (pre-transform): faiss's add
    t_assign = t_encode = 0.0
    if ivf is None:
        for s in range(lo, hi, block):
            e = min(s + block, hi)
            t0 = time.perf_counter()
            index.add_with_ids(np.ascontiguousarray(rows.take(np.arange(s, e)), np.float32),
                               np.arange(s, e, dtype=np.int64))
            t_encode += time.perf_counter() - t0
    else:
        t0 = time.perf_counter()
        lists = _assign(ExactCoarse(ivf), rows, lo, hi, block)
        t_assign = time.perf_counter() - t0
        _reserve(ivf, lists)
        t0 = time.perf_counter()
        for s in range(lo, hi, block):
            e = min(s + block, hi)
            x = np.ascontiguousarray(rows.take(np.arange(s, e)), np.float32)
            ids = np.arange(s, e, dtype=np.int64)
            li = np.ascontiguousarray(lists[s - lo:e - lo], np.int64)
            ivf.add_core(len(x), faiss.swig_ptr(x), faiss.swig_ptr(ids), faiss.swig_ptr(li))
        t_encode = time.perf_counter() - t0
        del lists
    with atomic_path(path) as tmp:
        faiss.write_index(index, tmp)
    if timings is not None:
        timings.update(assign_s=t_assign, encode_s=t_encode)
    return hi - lo


def _assign(coarse: ExactCoarse, rows: Rows, lo: int, hi: int, block: int) -> np.ndarray:
    """The list of each row of [lo, hi) (int32: 4 bytes a row), a block at a time."""
    lists = np.empty(hi - lo, np.int32 if coarse.nlist < 2**31 else np.int64)
    for s in range(lo, hi, block):
        e = min(s + block, hi)
        x = np.ascontiguousarray(rows.take(np.arange(s, e)), np.float32)
        lists[s - lo:e - lo] = coarse(x, 1, with_dis=False)[1].reshape(-1)
    return lists


def _reserve(ivf, lists: np.ndarray) -> None:
    """Give each inverted list its final capacity before the add (faiss's ``ArrayInvertedLists`` grows a list
    one entry at a time, a std::vector doubling: up to 2x the codes, and freed halves the allocator keeps;
    measured 3.1 GB for 2.6 GB of codes at 10M x 128 fp16). A resize to the final size and back to 0 leaves the
    vectors' capacity (std::vector never shrinks on resize), so the add appends without reallocating."""
    inv = faiss.downcast_InvertedLists(ivf.invlists)
    if not isinstance(inv, faiss.ArrayInvertedLists):
        return
    counts = np.bincount(lists[lists >= 0], minlength=ivf.nlist)
    for li in np.flatnonzero(counts):
        n = int(counts[li]) + int(inv.list_size(int(li)))
        inv.resize(int(li), n)
        inv.resize(int(li), n - int(counts[li]))


def merge_parts(trained_path: str, part_paths: list[str], path: str) -> int:
    """Merge the parts' inverted lists (in part order: ascending row ranges, so every list holds its
    rows in row order, as one process adding everything would) into ``path`` + ``path.ivfdata``.

    faiss's merge (faiss.contrib.ondisk) reads each part whole but its lists (a full copy of the coarse quantizer,
    nlist x D floats: 10 MB at 3M rows, 384-d, one part at a time); the trained index's own quantizer is memory-mapped
    here where faiss can (``IO_FLAG_MMAP_IFC``). faiss leaves the parts' lists mapped until the process ends, so
    the merge runs as a task of its own (curation.knn.shards.index_merge)."""
    from faiss.contrib.ondisk import merge_ondisk

    if os.path.exists(path):
        return -1
    index = faiss.read_index(trained_path, getattr(faiss, "IO_FLAG_MMAP_IFC", 0))
    data = path + ".ivfdata"
    if os.path.exists(data):
        os.remove(data)  # a merge killed half-way: start the lists again
    merge_ondisk(index, part_paths, data)
    with atomic_path(path) as tmp:
        faiss.write_index(index, tmp)
    return int(index.ntotal)


__all__ = ["train_ondisk", "add_part", "merge_parts"]
