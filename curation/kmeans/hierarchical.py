"""k-means (k-means++ seeding, Lloyd with early stop) and hierarchical k-means with resampling.

Hierarchical k-means follows Vo et al. 2024, "Automatic data curation for self-supervised
learning: a clustering-based approach" (the method DINOv3 used for LVD-1689M): level 1 clusters
the embeddings, level l clusters level l-1's centroids. After each level's k-means, r resampling
steps move centroids away from dense regions: take s points per cluster (closest to the centroid
or random), re-run k-means on that union, reassign everything. Balanced sampling then walks the
tree top-down, splitting the target size as evenly as cluster sizes allow, so a long tail of
concepts is represented next to the dominant ones.

k-means itself (measured in bench/bench_kmeans.py; README "Hierarchical k-means: quality, and
distributed over ranks"):
* seeding: greedy k-means++ (Arthur & Vassilvitskii 2007; the greedy variant with 2 + log k
  trials per step, as scikit-learn and the reference implementation use) on a random sample of
  ``init_sample`` points per centroid, so seeding costs a fraction of Lloyd's iterations instead of
  k passes over the whole data. Random seeding (faiss's) leaves several centroids in each large
  cluster and none in many small ones; on Zipf-sized clusters that cost 4% SSE (measured).
* Lloyd iterations until the relative objective change falls below ``tol`` (or ``niter``).
* centroid sums accumulate in float64 (exact for fp16 embeddings: see :func:`lloyd`).
* ``n_init`` restarts keep the lowest objective.
The distributed version (curation/kmeans/dist.py, curation/kmeans/shards.py) makes the same draws and
runs the same Lloyd with every level's rows and centroids sharded over ranks (one rank: this tree, bit for bit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from curation.core.faisslib import faiss
import numpy as np
import torch
from dinopipe.utils.progress import progress as reporter

from dinopipe.utils.device import pick_device

from curation.config import INITS
from curation.knn.index import Rows
from curation.kmeans.sampling import pick, quota

KMEANSPP_MAX_K = 20000
"""init="auto" seeds with k-means++ up to this many clusters, randomly above: k-means++ costs
k * init_sample * k * D (one pass over the seeding sample per seed), ~6e11 multiply-adds at 20k
clusters -- minutes on a CPU; Vo et al.'s 10M-cluster web level would need years."""
BLOCK = 16384
"""Rows per assignment block. Blocks start at multiples of BLOCK in the global row order, in one
process and in every rank of the distributed version, so each block's distances come from the
same matrix shapes (BLAS picks kernels by shape: a different blocking can move a distance by an
ulp and flip a tie)."""


RERANK = 3
"""Candidate centroids per row that faiss (CPU) or the matmul (CUDA) proposes; the nearest of them is chosen on
distances recomputed per row in float64 (:func:`exact_sq_dist`). faiss's flat search is a BLAS product whose
rounding depends on the thread count and the block shape (measured: 608 of 20,000 rows' distances differ
between 1 and 2 OpenMP threads, on one block of real shape), so a run with W task processes of one thread and
one with a single process of two threads picked different "closest" rows and, at 3M rows, different trees.
The recomputed distance depends only on the row and the centroid."""
EXACT_ROWS = 4096
"""Rows per chunk of the float64 recomputation: one EXACT_ROWS x D float64 array at a time (~13 MB at D=384)."""


def exact_sq_dist(x: np.ndarray, centroids: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """Squared L2 distance of each row of ``x`` (B, D) to its candidate centroids ``centroids[cand]`` (cand:
    (B, k) int64) -> (B, k) float64: differences, squares and the row sum in float64, one row at a time in
    numpy's fixed (pairwise) order -- the same value for a row whatever the batch, thread count or device."""
    out = np.empty(cand.shape, np.float64)
    for s in range(0, len(x), EXACT_ROWS):
        xs = np.asarray(x[s:s + EXACT_ROWS], np.float64)
        for j in range(cand.shape[1]):
            diff = xs - centroids[cand[s:s + EXACT_ROWS, j]]
            np.square(diff, out=diff)
            out[s:s + EXACT_ROWS, j] = diff.sum(axis=1)
    return out


def pick_nearest(cand: np.ndarray, dist: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The candidate with the smallest recomputed distance (ties: the lower centroid, whatever order the
    candidates came in) -> (labels int64, squared distances fp32)."""
    best = dist.min(axis=1)
    lab = np.where(dist == best[:, None], cand, np.iinfo(np.int64).max).min(axis=1)
    return lab.astype(np.int64), best.astype(np.float32)


class Nearest:
    """Nearest centroid of row blocks: RERANK candidates from faiss IndexFlatL2 on CPU or a torch matmul on
    CUDA, the nearest of them by :func:`exact_sq_dist` (the same labels and distances on any thread count,
    block shape or device, unless more than RERANK centroids lie within BLAS rounding of the nearest)."""

    def __init__(self, centroids: np.ndarray, device: str = "auto"):
        self.device = str(pick_device(device, key="device"))
        c = np.ascontiguousarray(centroids, dtype=np.float32)
        self.c_host, self.k = c, min(RERANK, len(c))
        if self.device.startswith("cuda"):
            self.c = torch.from_numpy(c).to(self.device)
            self.cn = (self.c * self.c).sum(1)
        else:
            self.index = faiss.IndexFlatL2(c.shape[1])
            self.index.add(c)

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(B, D) -> (labels int64, squared L2 distances fp32)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if not self.device.startswith("cuda"):
            _, cand = self.index.search(x, self.k)
        else:
            xt = torch.from_numpy(x).to(self.device)
            cand = torch.topk(self.cn[None, :] - 2.0 * xt @ self.c.T, self.k, dim=1, largest=False).indices
            cand = cand.cpu().numpy().astype(np.int64)
        return pick_nearest(cand, exact_sq_dist(x, self.c_host, cand))


def assign(data, centroids: np.ndarray, batch_size: int = BLOCK,
           device: str = "auto") -> tuple[np.ndarray, np.ndarray]:
    """Nearest centroid of every row: (labels int64, squared L2 distances float32)."""
    rows = data if isinstance(data, Rows) else Rows(data)
    near = Nearest(centroids, device)
    labels = np.empty(len(rows), np.int64)
    dist = np.empty(len(rows), np.float32)
    for start, x in rows.batches(batch_size):
        labels[start:start + len(x)], dist[start:start + len(x)] = near(x)
    return labels, dist


def assign_counts(data, centroids: np.ndarray, batch_size: int = 1024, device: str = "auto") -> np.ndarray:
    """Rows per nearest centroid (``bincount`` of :func:`assign`'s labels), a batch at a time: no label per row
    held, and a batch's working set only (its float64 recomputation, faiss's distance block: ~12 MB at 1,024
    rows of 384-d). The labels are :func:`assign`'s whatever the batch (the exact recomputation)."""
    rows = data if isinstance(data, Rows) else Rows(data)
    near = Nearest(centroids, device)
    counts = np.zeros(len(centroids), np.int64)
    for _, x in rows.batches(batch_size):
        counts += np.bincount(near(x)[0], minlength=len(centroids))
    return counts


@dataclass
class KMeansResult:
    centroids: np.ndarray  # (k, D) fp32
    objective: float  # sum of squared distances to the centroids of the last assignment
    n_iter: int  # Lloyd iterations run (< niter when the early stop fired)
    history: list = field(default_factory=list)  # objective after each assignment


REDUCE_BYTES = 256 * 2**20
"""Bytes of float64 centroid sums accumulated and reduced at once: k x D sums are built and summed over
ranks a chunk of centroids at a time (82 GB at 10M clusters x 1024-d in one piece; 256 MB per chunk)."""


def lloyd(blocks: Callable[[], Iterable[np.ndarray]], centroids: np.ndarray, niter: int,
          tol: float = 1e-4, device: str = "auto",
          allreduce: Callable | None = None, reduce_bytes: int = REDUCE_BYTES) -> KMeansResult:
    """Lloyd iterations from ``centroids`` over the rows ``blocks()`` yields (fp32 blocks).

    Stops after ``niter`` iterations or once an iteration lowers the objective by less than
    ``tol`` relative. Per-cluster sums accumulate in float64: fp16 embeddings (the curation
    format) are multiples of 2^-24 of magnitude <= 1 (L2-normalised), so every partial sum of up
    to 2^29 of them is exact in float64 and the centroids do not depend on the order the rows
    are added in -- in particular not on how the distributed version splits them over ranks
    (``allreduce(array)`` sums an array over ranks), nor on the chunking. The sums are built and
    reduced ``reduce_bytes`` of centroids at a time: one assignment pass keeps the labels (int64 per
    row of this process), then each chunk of centroids re-reads the rows -- (k / chunk) reads per
    iteration against the k * D multiply-adds per row the assignment costs. An empty cluster keeps its
    centroid (no random re-seeding: that would need a shared RNG draw over all ranks' rows).
    """
    cent = np.ascontiguousarray(centroids, dtype=np.float32).copy()
    k, d = cent.shape
    chunk = max(1, min(k, reduce_bytes // (8 * d)))
    history: list[float] = []
    it = 0
    for it in range(1, niter + 1):
        near = Nearest(cent, device)
        labels, counts, obj = [], np.zeros(k, np.int64), np.zeros(1, np.float64)
        for x in blocks():
            lab, dist = near(x)
            labels.append(lab)
            counts += np.bincount(lab, minlength=k)
            obj += dist.sum(dtype=np.float64)
        if allreduce is not None:
            counts, obj = allreduce(counts), allreduce(obj)
        obj = float(obj[0])
        for c0 in range(0, k, chunk):
            c1 = min(k, c0 + chunk)
            sums = torch.zeros((c1 - c0, d), dtype=torch.float64)
            for lab, x in zip(labels, blocks()):
                sel = np.flatnonzero((lab >= c0) & (lab < c1))
                if len(sel):
                    sums.index_add_(0, torch.from_numpy(lab[sel] - c0), torch.from_numpy(x[sel]).double())
            s = sums.numpy() if allreduce is None else allreduce(sums.numpy())
            cnt = counts[c0:c1]
            full = cnt > 0
            cent[c0:c1][full] = (s[full] / cnt[full, None]).astype(np.float32)
        history.append(obj)
        if len(history) > 1 and history[-2] - obj <= tol * abs(history[-2]):
            break
    return KMeansResult(cent, history[-1] if history else float("nan"), it, history)


def kmeans_plusplus(x: np.ndarray, k: int, rng: np.random.Generator,
                    n_trials: int | None = None, device: str = "auto") -> np.ndarray:
    """Positions of k seeds among the rows of x by greedy k-means++ (fp32, torch matmuls).

    Each step draws ``n_trials`` (default 2 + log k) candidates with probability proportional
    to the squared distance to the nearest seed so far and keeps the one that lowers the total
    the most. Costs one pass over x per seed: run it on a sample.
    """
    m = len(x)
    k = min(k, m)
    trials = n_trials or 2 + int(math.log(k))
    device = str(pick_device(device, key="device"))
    X = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(device)
    xn = (X * X).sum(1)
    chosen = np.empty(k, np.int64)
    chosen[0] = rng.integers(m)
    d2 = (xn + xn[chosen[0]] - 2.0 * (X @ X[chosen[0]])).clamp_min_(0)
    for i in range(1, k):
        cum = np.cumsum(d2.cpu().numpy(), dtype=np.float64)
        if cum[-1] <= 0:  # fewer distinct points than k: take the rest in order
            rest = np.setdiff1d(np.arange(m), chosen[:i])[: k - i]
            chosen[i:i + len(rest)] = rest
            return chosen[:i + len(rest)]
        cand = np.minimum(np.searchsorted(cum, rng.random(trials) * cum[-1], side="right"), m - 1)
        ct = torch.from_numpy(cand).to(device)
        dc = (xn[:, None] + xn[ct][None, :] - 2.0 * (X @ X[ct].T)).clamp_min_(0)
        dc = torch.minimum(dc, d2[:, None])
        best = int(torch.argmin(dc.sum(0, dtype=torch.float64)))
        chosen[i], d2 = cand[best], dc[:, best].contiguous()
    return chosen


def seed_centroids(x: np.ndarray, k: int, init: str, rng: np.random.Generator,
                   device: str = "auto") -> np.ndarray:
    """(k, D) initial centroids from the rows of the (sample) x."""
    if init not in INITS:
        raise ValueError(f"kmeans init={init!r}: choose one of {INITS}")
    if init == "random" or (init == "auto" and k > KMEANSPP_MAX_K):
        pos = sample_positions(len(x), min(k, len(x)), rng)
    else:
        pos = kmeans_plusplus(x, k, rng, device=device)
    return np.ascontiguousarray(x[pos], dtype=np.float32)


def sample_positions(n: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` distinct positions of ``range(n)``, uniformly at random, sorted, in O(size) memory.

    numpy's ``choice(n, size, replace=False)`` permutes an ``arange(n)`` once size > n / 50 (9.6 GB at
    1.2B rows for DINOv3's 10M-cluster seeding sample): instead, draw with replacement until ``size``
    distinct values are there, then keep a uniform ``size`` of them (uniform given the distinct set, by
    symmetry). Above n / 2 the complement is drawn the same way."""
    if size >= n:
        return np.arange(n)
    if size > n // 2:
        drop = sample_positions(n, n - size, rng)
        keep = np.ones(n, bool)
        keep[drop] = False
        return np.flatnonzero(keep)
    got = np.zeros(0, np.int64)
    while len(got) < size:
        extra = int((size - len(got)) * 1.1) + 16
        got = np.unique(np.concatenate([got, rng.integers(0, n, size=extra, dtype=np.int64)]))
    if len(got) > size:
        got = np.sort(got[rng.permutation(len(got))[:size]])
    return got


def kmeans_fit(data, k: int, niter: int = 50, seed: int = 0, max_points_per_centroid: int = 256,
               init_centroids: np.ndarray | None = None, init: str = "auto",
               init_sample: int = 4, n_init: int = 1, tol: float = 1e-4,
               device: str = "auto") -> KMeansResult:
    """k-means of the rows of ``data`` (array, memmap, EmbeddingSet or Rows) -> KMeansResult.

    Lloyd runs on a random sample of at most ``k * max_points_per_centroid`` rows (held in fp32
    memory); k-means++ seeds on a sample of ``init_sample`` rows per centroid (``init``: auto =
    k-means++ up to KMEANSPP_MAX_K clusters, else random rows). ``n_init`` restarts (different
    seeds) keep the lowest objective.
    """
    rows = data if isinstance(data, Rows) else Rows(data)
    n = len(rows)
    if n == 0:
        raise ValueError("k-means on an empty set of embeddings")
    k = int(min(k, n))
    work = work_positions(n, k, seed, max_points_per_centroid)
    x = np.ascontiguousarray(rows.take(work), dtype=np.float32)

    def blocks():
        return (x[s:s + BLOCK] for s in range(0, len(x), BLOCK))

    return fit(len(x), blocks, lambda pos: x[pos], k, niter, seed, init_centroids, init,
               init_sample, n_init, tol, device)


def work_positions(n: int, k: int, seed: int, max_points_per_centroid: int) -> np.ndarray:
    """The rows Lloyd iterates over: all, or a seeded random sample of k * max_points_per_centroid
    (sorted), chosen the same way by one process and by every rank of the distributed version."""
    return sample_positions(n, k * max_points_per_centroid, np.random.default_rng(seed))


def fit(n_work: int, blocks: Callable, take: Callable, k: int, niter: int, seed: int,
        init_centroids=None, init: str = "auto", init_sample: int = 4, n_init: int = 1,
        tol: float = 1e-4, device: str = "auto", allreduce: Callable | None = None,
        broadcast: Callable | None = None) -> KMeansResult:
    """Seeding + Lloyd over ``n_work`` rows: ``blocks()`` yields them (this process's share) in
    BLOCK-row blocks, ``take(positions)`` returns any of them for seeding (called where
    ``broadcast`` -- rank 0's value to all ranks -- takes its value from)."""
    best = None
    for r in range(max(1, n_init) if init_centroids is None else 1):
        if init_centroids is not None:
            c0 = np.ascontiguousarray(init_centroids[:k], dtype=np.float32)
        else:
            def seeds(r=r):
                rr = np.random.default_rng([seed, r])
                return seed_centroids(take(sample_positions(n_work, k * init_sample, rr)), k,
                                      init, rr, device)
            c0 = seeds() if broadcast is None else broadcast(seeds)
        res = lloyd(blocks, c0, niter, tol, device, allreduce)
        if best is None or res.objective < best.objective:
            best = res
    return best


def kmeans(data, k: int, niter: int = 50, seed: int = 0, **kw) -> np.ndarray:
    """L2 k-means -> (k, D) centroids; see :func:`kmeans_fit` for the options."""
    return kmeans_fit(data, k, niter=niter, seed=seed, **kw).centroids


@dataclass
class Level:
    """One level: ``labels[j]`` is the cluster of item j of the level below (points at level 1)."""

    centroids: np.ndarray  # (k, D)
    labels: np.ndarray  # (n_items,)
    dist: np.ndarray  # (n_items,) squared L2 distance of each item to its centroid
    sizes: np.ndarray  # (k,) number of *points* (level-1 items) under each cluster


def hierarchical_kmeans(data, n_clusters: Sequence[int], n_resampling_steps: int = 10,
                        sample_size: int | Sequence[int] = 10, sampling: str = "closest",
                        niter: int = 50, seed: int = 0, progress: bool = False,
                        first_level: Level | None = None, **kmeans_kw) -> list[Level]:
    """Hierarchical k-means with resampling (Vo et al. 2024, Alg. 1); levels bottom-up.

    ``kmeans_kw`` (init, init_sample, n_init, tol, device) go to every :func:`kmeans_fit`.
    ``first_level``: level 1 computed elsewhere (the distributed version); the levels above it
    are clustered here, on its centroids weighted by its sizes."""
    if sampling not in ("closest", "random"):
        raise ValueError(f"sampling={sampling!r}: choose 'closest' or 'random'")
    rows = data if isinstance(data, Rows) or first_level is not None else Rows(data)
    sizes_in = None if first_level is not None else np.ones(len(rows), np.int64)
    sample_sizes = ([sample_size] * len(n_clusters) if isinstance(sample_size, int)
                    else list(sample_size))
    levels: list[Level] = []
    items = rows
    if first_level is not None:
        levels, items, sizes_in = [first_level], first_level.centroids, first_level.sizes
    bar = reporter(total=len(n_clusters) * (1 + n_resampling_steps), desc="hierarchical k-means",
               unit="k-means", disable=not progress, initial=len(levels) * (1 + n_resampling_steps))
    for li, k in enumerate(n_clusters):
        if li < len(levels):
            continue
        rng = np.random.default_rng(seed + li)
        cent = kmeans(items, k, niter=niter, seed=seed + li, **kmeans_kw)
        labels, dist = assign(items, cent, device=kmeans_kw.get("device", "auto"))
        s = sample_sizes[li]
        for step in range(n_resampling_steps if s > 1 else 0):
            pick = resample_positions(labels, dist, len(cent), s, sampling, rng)
            # A fresh initialisation, as in the reference implementation: starting from the
            # current centroids, k-means on their own closest points is a fixed point.
            cent = kmeans(Rows(items, pick), len(cent), niter=niter,
                          seed=seed + 1000 * (li + 1) + step, **kmeans_kw)
            labels, dist = assign(items, cent, device=kmeans_kw.get("device", "auto"))
            bar.update(1)
        bar.update(1 + n_resampling_steps - (n_resampling_steps if s > 1 else 0))
        sizes = np.bincount(labels, weights=sizes_in, minlength=len(cent)).astype(np.int64)
        levels.append(Level(cent, labels, dist, sizes))
        items, sizes_in = cent, sizes
    bar.close()
    return levels


def resample_positions(labels, dist, k, s, sampling, rng) -> np.ndarray:
    """Up to s items per cluster: the closest to its centroid, or uniformly random."""
    if sampling == "closest":
        order = np.lexsort((dist, labels))
    else:
        order = np.lexsort((rng.random(len(labels)), labels))
    lab = labels[order]
    starts = np.searchsorted(lab, np.arange(k))
    rank_in_cluster = np.arange(len(order)) - starts[lab]
    return np.sort(order[rank_in_cluster < s])


def balanced_sample(levels: list[Level], target_size: int, strategy: str = "r",
                    seed: int = 0, picker: Callable | None = None) -> np.ndarray:
    """Positions of ``target_size`` points chosen top-down as evenly as the tree allows.

    ``strategy``: 'r' random points within each bottom cluster -- the quota's smallest per-row hash
    keys (curation.kmeans.sampling.pick; ``picker(labels, quota, seed)``: the same selection made
    elsewhere, e.g. ``sampling.sharded_pick`` as W tasks), 'c' the closest to its centroid.
    """
    if strategy not in ("r", "c"):
        raise ValueError(f"strategy={strategy!r}: choose 'r' (random) or 'c' (closest)")
    rng = np.random.default_rng(seed)
    alloc = quota([lvl.sizes for lvl in levels], [lvl.labels for lvl in levels[1:]], target_size, rng)
    bottom = levels[0]
    if strategy == "r":
        return np.asarray((picker or pick)(bottom.labels, alloc, seed), np.int64)
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


def label_counts(labels, k: int, rows: np.ndarray | None = None, block: int | None = None) -> np.ndarray:
    """``bincount(labels[rows])`` (``rows`` None: every row; positions, or a bool mask over the labels) over ``k``
    labels, a block at a time: no int64 copy of the labels (a memory-mapped level of the k-means tree) or of the
    gathered rows."""
    from curation.core.runner import BLOCK as ROWS_BLOCK  # the step block (its debug hook: tests see the per-row cost)

    block = block or ROWS_BLOCK
    counts = np.zeros(k, np.int64)
    mask = rows is not None and np.asarray(rows[:0]).dtype == bool
    total = len(labels) if rows is None or mask else len(rows)
    for s in range(0, total, block):
        if rows is None:
            lab = labels[s:s + block]
        elif mask:
            lab = np.asarray(labels[s:s + block])[np.asarray(rows[s:s + block])]
        else:
            lab = labels[np.asarray(rows[s:s + block])]
        counts += np.bincount(np.asarray(lab, np.int64), minlength=k)[:k]
    return counts


def cluster_balance(labels: np.ndarray, k: int, rows: np.ndarray | None = None) -> dict:
    """How even the cluster sizes are (of ``labels[rows]``; ``rows`` None: all): entropy (nats), entropy / log(k)
    (1 = uniform), ... -- counted a block at a time (:func:`label_counts`)."""
    counts = label_counts(labels, k, rows).astype(np.float64)
    total = counts.sum()
    if total == 0:
        return {"n": 0, "entropy": 0.0, "normalised_entropy": 0.0, "nonempty_clusters": 0,
                "largest_share": 0.0}
    p = counts[counts > 0] / total
    h = float(-(p * np.log(p)).sum())
    return {"n": int(total), "entropy": h,
            "normalised_entropy": h / math.log(k) if k > 1 else 1.0,
            "nonempty_clusters": int((counts > 0).sum()), "largest_share": float(p.max())}


PUBLISHED_LEVELS = ((1_200_000_000, (10_000_000, 500_000, 50_000, 10_000)),
                    (17_000_000_000, (200_000_000, 8_000_000, 800_000, 100_000, 25_000)))
"""(pool size, clusters per level bottom-up) of the published curations: Vo et al. 2024's web images (4 levels on
1.2B images, facebookresearch/ssl-data-curation configs/4levels_web_based_images.yaml) and DINOv3's LVD-1689M
(5 levels on ~17B images). Their bottom clusters hold 120 and 85 images on average."""


def auto_levels(n: int) -> list[int]:
    """``rebalance.levels: auto``: the published recipe whose pool size is nearest to ``n`` (log scale), every
    level's cluster count scaled by n / its pool size -- each level's clusters hold as many rows on average as in
    the paper -- and the levels that would hold fewer than 2 clusters dropped (a 10k pool: [83, 4]; 1M: [8333,
    417, 42, 8]). A pool under ~180 rows gets one level of one cluster (balanced sampling is then uniform)."""
    n = max(int(n), 1)
    pool, ks = min(PUBLISHED_LEVELS, key=lambda p: abs(np.log(n / p[0])))
    out = []
    for k in ks:
        scaled = int(round(k * n / pool))
        if scaled < 2:
            break
        out.append(scaled)
    return out or [1]


def capped_levels(levels, n: int) -> list[int]:
    """Clusters per level, each capped at the level below (the data at level 1); ``"auto"``: :func:`auto_levels`."""
    if isinstance(levels, str) and levels == "auto":
        levels = auto_levels(n)
    ks, prev = [], n
    for k in levels:
        prev = max(1, min(int(k), prev))
        ks.append(prev)
    return ks
