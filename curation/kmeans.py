"""k-means (faiss) and hierarchical k-means with resampling + balanced sampling.

Hierarchical k-means follows Vo et al. 2024, "Automatic data curation for self-supervised
learning: a clustering-based approach" (the method DINOv3 used for LVD-1689M): level 1 clusters
the embeddings, level l clusters level l-1's centroids. After each level's k-means, r resampling
steps move centroids away from dense regions: take s points per cluster (closest to the centroid
or random), re-run k-means on that union, reassign everything. Balanced sampling then walks the
tree top-down, splitting the target size as evenly as cluster sizes allow, so a long tail of
concepts is represented next to the dominant ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ._faiss import faiss
import numpy as np
from tqdm.auto import tqdm

from .index import Rows, num_gpus


def kmeans(data, k: int, niter: int = 20, seed: int = 0, max_points_per_centroid: int = 256,
           init_centroids: np.ndarray | None = None, use_gpu: bool | str = "auto") -> np.ndarray:
    """L2 k-means on (a random sample of at most k * max_points_per_centroid) rows -> (k, D)."""
    rows = data if isinstance(data, Rows) else Rows(data)
    n = len(rows)
    if n == 0:
        raise ValueError("k-means on an empty set of embeddings")
    k = int(min(k, n))
    rng = np.random.default_rng(seed)
    # Sampling ourselves keeps only the sample in fp32 memory (faiss would need all rows).
    take = n if n <= k * max_points_per_centroid else k * max_points_per_centroid
    sample = np.sort(rng.choice(n, size=take, replace=False)) if take < n else np.arange(n)
    x = np.ascontiguousarray(rows.take(sample), dtype=np.float32)
    km = faiss.Kmeans(x.shape[1], k, niter=niter, seed=seed, verbose=False,
                      min_points_per_centroid=1, max_points_per_centroid=max(take // k + 1, 1),
                      gpu=bool(num_gpus()) if use_gpu in ("auto", True) else False)
    km.train(x, init_centroids=None if init_centroids is None
             else np.ascontiguousarray(init_centroids[:k], dtype=np.float32))
    return km.centroids.copy()


def assign(data, centroids: np.ndarray, batch_size: int = 65536) -> tuple[np.ndarray, np.ndarray]:
    """Nearest centroid of every row: (labels int64, squared L2 distances float32)."""
    rows = data if isinstance(data, Rows) else Rows(data)
    index = faiss.IndexFlatL2(centroids.shape[1])
    index.add(np.ascontiguousarray(centroids, dtype=np.float32))
    labels = np.empty(len(rows), np.int64)
    dist = np.empty(len(rows), np.float32)
    for start, x in rows.batches(batch_size):
        d, i = index.search(x, 1)
        labels[start:start + len(x)], dist[start:start + len(x)] = i[:, 0], d[:, 0]
    return labels, dist


@dataclass
class Level:
    """One level: ``labels[j]`` is the cluster of item j of the level below (points at level 1)."""

    centroids: np.ndarray  # (k, D)
    labels: np.ndarray  # (n_items,)
    dist: np.ndarray  # (n_items,) squared L2 distance of each item to its centroid
    sizes: np.ndarray  # (k,) number of *points* (level-1 items) under each cluster


def hierarchical_kmeans(data, n_clusters: Sequence[int], n_resampling_steps: int = 10,
                        sample_size: int | Sequence[int] = 10, sampling: str = "closest",
                        niter: int = 20, seed: int = 0, progress: bool = False) -> list[Level]:
    """Hierarchical k-means with resampling (Vo et al. 2024, Alg. 1); levels bottom-up."""
    if sampling not in ("closest", "random"):
        raise ValueError(f"sampling={sampling!r}: choose 'closest' or 'random'")
    rows = data if isinstance(data, Rows) else Rows(data)
    sizes_in = np.ones(len(rows), np.int64)
    sample_sizes = ([sample_size] * len(n_clusters) if isinstance(sample_size, int)
                    else list(sample_size))
    levels: list[Level] = []
    items = rows
    bar = tqdm(total=len(n_clusters) * (1 + n_resampling_steps), desc="hierarchical k-means",
               unit="k-means", disable=not progress)
    for li, k in enumerate(n_clusters):
        rng = np.random.default_rng(seed + li)
        cent = kmeans(items, k, niter=niter, seed=seed + li)
        labels, dist = assign(items, cent)
        s = sample_sizes[li]
        for step in range(n_resampling_steps if s > 1 else 0):
            pick = _resample(labels, dist, len(cent), s, sampling, rng)
            # A fresh initialisation, as in the reference implementation: starting from the
            # current centroids, k-means on their own closest points is a fixed point.
            cent = kmeans(Rows(items, pick), len(cent), niter=niter,
                          seed=seed + 1000 * (li + 1) + step)
            labels, dist = assign(items, cent)
            bar.update(1)
        bar.update(1 + n_resampling_steps - (n_resampling_steps if s > 1 else 0))
        sizes = np.bincount(labels, weights=sizes_in, minlength=len(cent)).astype(np.int64)
        levels.append(Level(cent, labels, dist, sizes))
        items, sizes_in = cent, sizes
    bar.close()
    return levels


def _resample(labels, dist, k, s, sampling, rng) -> np.ndarray:
    """Up to s items per cluster: the closest to its centroid, or uniformly random."""
    if sampling == "closest":
        order = np.lexsort((dist, labels))
    else:
        order = np.lexsort((rng.random(len(labels)), labels))
    lab = labels[order]
    starts = np.searchsorted(lab, np.arange(k))
    rank_in_cluster = np.arange(len(order)) - starts[lab]
    return np.sort(order[rank_in_cluster < s])


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


def balanced_sample(levels: list[Level], target_size: int, strategy: str = "r",
                    seed: int = 0) -> np.ndarray:
    """Positions of ``target_size`` points chosen top-down as evenly as the tree allows.

    ``strategy``: 'r' random points within each bottom cluster, 'c' the closest to its centroid.
    """
    if strategy not in ("r", "c"):
        raise ValueError(f"strategy={strategy!r}: choose 'r' (random) or 'c' (closest)")
    rng = np.random.default_rng(seed)
    top = levels[-1]
    alloc = split_target(top.sizes, target_size, rng)  # per cluster of the top level
    for li in range(len(levels) - 1, 0, -1):
        lvl, below = levels[li], levels[li - 1]
        child_alloc = np.zeros(len(below.sizes), np.int64)
        members = _members(lvl.labels, len(lvl.sizes))
        for c in np.flatnonzero(alloc):
            kids = members[c]
            child_alloc[kids] = split_target(below.sizes[kids], int(alloc[c]), rng)
        alloc = child_alloc
    bottom = levels[0]
    members = _members(bottom.labels, len(bottom.sizes))
    picked = []
    for c in np.flatnonzero(alloc):
        pts = members[c]
        if strategy == "c":
            picked.append(pts[np.argsort(bottom.dist[pts], kind="stable")[: alloc[c]]])
        else:
            picked.append(rng.choice(pts, size=int(alloc[c]), replace=False))
    return np.sort(np.concatenate(picked)) if picked else np.zeros(0, np.int64)


def _members(labels: np.ndarray, k: int) -> list[np.ndarray]:
    order = np.argsort(labels, kind="stable")
    bounds = np.searchsorted(labels[order], np.arange(k + 1))
    return [order[bounds[c]:bounds[c + 1]] for c in range(k)]


def cluster_balance(labels: np.ndarray, k: int) -> dict:
    """How even the cluster sizes are: entropy (nats), entropy / log(k) (1 = uniform), ..."""
    counts = np.bincount(np.asarray(labels, np.int64), minlength=k).astype(np.float64)
    total = counts.sum()
    if total == 0:
        return {"n": 0, "entropy": 0.0, "normalised_entropy": 0.0, "nonempty_clusters": 0,
                "largest_share": 0.0}
    p = counts[counts > 0] / total
    h = float(-(p * np.log(p)).sum())
    return {"n": int(total), "entropy": h,
            "normalised_entropy": h / math.log(k) if k > 1 else 1.0,
            "nonempty_clusters": int((counts > 0).sum()), "largest_share": float(p.max())}
