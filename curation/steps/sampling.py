"""Balanced sampling over a k-means tree, by W tasks (no torch, no per-cluster Python lists of rows).

:func:`quota` walks the tree top-down and splits the target over level-1 clusters as evenly as their
sizes allow (Vo et al. 2024; the split :func:`curation.kmeans.balanced_sample` makes). Picking the
``q_c`` rows of cluster ``c`` is then a rank selection by a per-row hash key, done exactly in three
sharded passes whose merges are O(k * 256): per-task histograms of (cluster, top key byte) -> the byte
where each cluster's quota ends -> per-task keys in that byte -> each cluster's threshold key -> every
task marks its rows. Same rows for any W (the key is a function of the row and the seed).
"""

from __future__ import annotations

import numpy as np

BINS = 256


def split_target(sizes: np.ndarray, target: int, rng: np.random.Generator) -> np.ndarray:
    """Split ``target`` over clusters as evenly as their sizes allow (water filling).

    Returns per-cluster counts ``c <= sizes`` summing to ``min(target, sizes.sum())``: a cap x
    with sum(min(x, sizes)) <= target, plus one more for a random subset of the clusters that
    still have room, to hit the target exactly.
    """
    sizes = np.asarray(sizes, np.int64)
    if target >= sizes.sum():
        return sizes.copy()
    lo, hi = 0, int(sizes.max())
    while hi - lo > 1:  # largest x with sum(min(x, sizes)) <= target
        mid = (lo + hi) // 2
        if np.minimum(mid, sizes).sum() <= target:
            lo = mid
        else:
            hi = mid
    alloc = np.minimum(lo, sizes)
    rest = target - int(alloc.sum())
    room = np.flatnonzero(sizes > lo)
    alloc[rng.choice(room, size=rest, replace=False)] += 1
    return alloc


def quota(sizes: list[np.ndarray], parents: list[np.ndarray], target: int,
          rng: np.random.Generator) -> np.ndarray:
    """Rows to take from each level-1 cluster. ``sizes[l]``: cluster sizes of level l+1 (in rows);
    ``parents[l]``: the level-(l+2) cluster of each level-(l+1) cluster."""
    alloc = split_target(sizes[-1], target, rng)
    for li in range(len(sizes) - 1, 0, -1):
        below, lab = sizes[li - 1], parents[li - 1]
        child = np.zeros(len(below), np.int64)
        order = np.argsort(lab, kind="stable")
        bounds = np.searchsorted(lab[order], np.arange(len(sizes[li]) + 1))
        for c in np.flatnonzero(alloc):
            kids = order[bounds[c]:bounds[c + 1]]
            child[kids] = split_target(below[kids], int(alloc[c]), rng)
        alloc = child
    return alloc


def row_keys(rows: np.ndarray, seed: int) -> np.ndarray:
    """splitmix64 of (row, seed): the random order rows are picked in, independent of W."""
    with np.errstate(over="ignore"):
        z = np.asarray(rows, np.uint64) + np.uint64(seed * 0x9E3779B97F4A7C15 % (1 << 64))
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def histogram(labels: np.ndarray, keys: np.ndarray, k: int) -> np.ndarray:
    """Pass 1 of one task: (k, 256) counts of its rows by cluster and top key byte."""
    b = (keys >> np.uint64(56)).astype(np.int64)
    return np.bincount(labels.astype(np.int64) * BINS + b, minlength=k * BINS).reshape(k, BINS)


def boundary(hist: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge of pass 1: per cluster the byte where its quota ends (-1: none, 256: all) and how many
    rows of that byte are still needed."""
    cum = np.cumsum(hist, axis=1)
    b = (cum < q[:, None]).sum(axis=1)  # first byte where the running count reaches q
    before = np.where(b > 0, cum[np.arange(len(q)), np.maximum(b - 1, 0)], 0)
    need = q - before
    b = np.where(q == 0, -1, np.where(q >= cum[:, -1], BINS, b))
    return b, np.where((b >= 0) & (b < BINS), need, 0)


def in_boundary(labels: np.ndarray, keys: np.ndarray, b: np.ndarray):
    """Pass 2 of one task: (labels, keys) of its rows in their cluster's boundary byte."""
    m = (keys >> np.uint64(56)).astype(np.int64) == b[labels]
    return labels[m], keys[m]


def thresholds(labels: np.ndarray, keys: np.ndarray, need: np.ndarray) -> np.ndarray:
    """Merge of pass 2: per cluster the largest key taken in its boundary byte."""
    thr = np.zeros(len(need), np.uint64)
    order = np.lexsort((keys, labels))
    lab, ks = labels[order], keys[order]
    starts = np.searchsorted(lab, np.arange(len(need)))
    c = np.flatnonzero(need > 0)
    thr[c] = ks[starts[c] + need[c] - 1]
    return thr


def selected(labels: np.ndarray, keys: np.ndarray, b: np.ndarray, thr: np.ndarray) -> np.ndarray:
    """Pass 3 of one task: which of its rows are picked."""
    byte = (keys >> np.uint64(56)).astype(np.int64)
    bl = b[labels]
    return (byte < bl) | ((byte == bl) & (keys <= thr[labels]))
