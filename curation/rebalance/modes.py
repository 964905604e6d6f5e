"""Rebalancing the deduplicated pool (DINOv2 App. A.3; Vo et al. 2024).

* ``sample``: retrieval, sample-based — every seed image (a curated set) brings its k nearest
  pool images.
* ``cluster``: retrieval, cluster-based — k-means the pool into C clusters and take up to M
  images from each cluster holding at least q seeds (for small seed sets).
* ``hierarchical``: hierarchical k-means with resampling, then balanced sampling to a target size
  ('r' random / 'c' closest-to-centroid within bottom clusters); no seeds needed.
* ``none``: keep everything.

Every mode returns the same :class:`RebalanceResult` plus a balance report (entropy of cluster
sizes before/after on a common clustering).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from dinopipe.config import InputError

from curation.config import MODES
from curation.knn.index import Rows, build_index, iter_knn
from curation.kmeans.hierarchical import (assign, assign_counts, balanced_sample, capped_levels, cluster_balance,
                                          hierarchical_kmeans, kmeans)
from curation.core.runner import BLOCK


@dataclass
class RebalanceResult:
    selected: np.ndarray  # (N,) bool over the pool positions given
    cluster: np.ndarray  # (N,) int64 cluster label used by the mode (-1 when none)
    nearest_seed: np.ndarray  # (N,) int64 seed position (-1 when no seeds)
    seed_sim: np.ndarray  # (N,) float32 cosine to that seed (nan when no seeds)
    report: dict = field(default_factory=dict)
    scratch: str | None = None  # a folder: the columns a mode fills are memory-mapped files there, not heap arrays

    @property
    def n_selected(self) -> int:
        return int(self.selected.sum())


def rebalance(mode: str, pool, seeds=None, *, k: int = 4, n_clusters: int = 1000,
              max_per_cluster: int = 10000, min_seeds: int = 1,
              levels: Sequence[int] | str = (1000, 100), target_size: int | None = None,
              strategy: str = "r", n_resampling_steps: int = 10, sample_size: int = 10,
              balance_clusters: int | None = None, seed: int = 0,
              batch_size: int = 8192, progress: bool = False,
              kmeans: dict | None = None, tree=None, candidates=None, picker=None, cluster_level=None,
              balance_labels=None, attach=None, scratch: str | None = None) -> RebalanceResult:
    """Dispatch to one mode. ``pool``/``seeds``: L2-normalised embeddings (array/EmbeddingSet/Rows).

    ``balance_clusters``: size of the common k-means used to report balance before/after
    (default: the mode's own clustering -- no extra k-means; nothing for modes without one).
    ``kmeans``: options of the hierarchical mode's k-means (init, init_sample, niter, tol,
    n_init; see :func:`curation.kmeans.hierarchical.kmeans_fit`). ``tree``: the hierarchical mode's k-means
    tree computed elsewhere (:func:`curation.kmeans.dist.load_tree`) for exactly these rows.
    ``candidates``: mode 'sample''s (seed, pool position, exact sim) arrays found elsewhere (the
    sharded kNN: curation.rebalance.retrieval.sharded_retrieval) instead of searching here. ``picker``: the
    hierarchical mode's random pick within clusters made elsewhere (curation.kmeans.hierarchical.balanced_sample), also the
    cluster mode's. ``cluster_level``: the cluster mode's k-means (a :class:`curation.kmeans.hierarchical.Level`: centroids,
    labels, sizes) made elsewhere (curation.rebalance.tasks.flat_kmeans: W tasks); ``balance_labels``:
    (labels, k) of the ``balance_clusters`` k-means made elsewhere; ``attach(res)``: the nearest seed of every
    selected row found elsewhere (curation.rebalance.tasks.sharded_nearest_seed) instead of here.
    ``scratch``: a folder where the per-row columns a mode fills (selected, nearest seed, its cosine) are
    memory-mapped files (the step's: this process then holds no array per row of the pool).
    """
    rows = pool if isinstance(pool, Rows) else Rows(pool)
    if mode not in MODES:
        raise ValueError(f"rebalance mode {mode!r}: choose one of {MODES}")
    if mode in ("sample", "cluster") and (seeds is None or len(seeds) == 0):
        raise InputError(f"rebalance mode {mode!r} retrieves around seed images: give seed "
                         f"embeddings (a curated seed set), or use 'hierarchical' / 'none'")
    if mode == "none":
        res = _none(len(rows))
    elif mode == "sample" and candidates is not None:
        res = sample_from_candidates(len(rows), *candidates, k=k, scratch=scratch)
    elif mode == "sample":
        res = retrieval_sample_based(rows, seeds, k=k, batch_size=batch_size, scratch=scratch)
    elif mode == "cluster":
        res = retrieval_cluster_based(rows, seeds, n_clusters=n_clusters,
                                      max_per_cluster=max_per_cluster, min_seeds=min_seeds,
                                      seed=seed, level=cluster_level, picker=picker, scratch=scratch)
    else:
        res = hierarchical_balanced(rows, levels=levels, target_size=target_size,
                                    strategy=strategy, n_resampling_steps=n_resampling_steps,
                                    sample_size=sample_size, seed=seed, progress=progress,
                                    tree=tree, picker=picker, scratch=scratch, **(kmeans or {}))
    res.scratch = scratch
    if seeds is not None and len(seeds) and mode != "sample":
        if attach is not None:
            attach(res)
        else:
            _attach_nearest_seed(rows, seeds, res, batch_size)
    res.report.update(mode=mode, n_pool=len(rows), n_selected=res.n_selected)
    res.report["balance"] = balance_before_after(rows, res, balance_clusters, seed, balance_labels)
    return res


NONE = {"selected": np.bool_(True), "cluster": np.int64(-1), "nearest_seed": np.int64(-1),
        "seed_sim": np.float32(np.nan)}
"""Each column's value for a row no mode touched."""


def _none(n: int, scratch: str | None = None) -> RebalanceResult:
    """Everything selected, no cluster, no seed: the per-row "none" columns are read-only broadcast views
    (no memory per row; a mode that fills one makes it an array first: :func:`make_writable`)."""
    return RebalanceResult(*(np.broadcast_to(v, (n,)) for v in NONE.values()), scratch=scratch)


def make_writable(res: RebalanceResult, *names: str) -> None:
    """Make ``res``'s columns ``names`` writable (filled with their "none" value): memory-mapped files in
    ``res.scratch`` when it is set, else arrays."""
    for name in names:
        if not getattr(res, name).flags.writeable:
            _column(res, name, NONE[name])


def _column(res: RebalanceResult, name: str, value) -> None:
    """A fresh writable column ``name`` of ``res`` holding ``value`` in every row."""
    n = len(getattr(res, name))
    dtype = np.asarray(NONE[name]).dtype
    if res.scratch is None:
        setattr(res, name, np.full(n, value, dtype))
        return
    col = np.lib.format.open_memmap(os.path.join(res.scratch, f"result-{name}.npy"), mode="w+", dtype=dtype,
                                    shape=(n,))
    if value:  # a new file reads as zeros (False, 0)
        for s in range(0, n, BLOCK):
            col[s:s + BLOCK] = value
    setattr(res, name, col)


def _select(res: RebalanceResult, picked) -> None:
    """``res.selected``: a fresh column, True at the positions ``picked`` (int64; memory-mapped from the sharded
    pick), marked a block of them at a time (an index array is not copied whole)."""
    _column(res, "selected", False)
    for s in range(0, len(picked), BLOCK):
        res.selected[np.asarray(picked[s:s + BLOCK], np.int64)] = True


def retrieval_sample_based(pool, seeds, k: int = 4, batch_size: int = 8192,
                           index_kind: str = "auto", nprobe: int = 64, scratch: str | None = None) -> RebalanceResult:
    """Each seed retrieves its k nearest pool images; a pool image retrieved by several seeds
    records the most similar one (exact float64 cosine, as the sharded path scores them)."""
    from curation.knn.candidates import retrieval_candidates

    rows = pool if isinstance(pool, Rows) else Rows(pool)
    seed_rows = seeds if isinstance(seeds, Rows) else Rows(seeds)
    if not len(rows):
        return sample_from_candidates(0, *(np.zeros(0, np.int64),) * 2, np.zeros(0), k=k, scratch=scratch)
    index = build_index(rows, kind=index_kind, nprobe=nprobe)
    parts = list(retrieval_candidates(index, seed_rows, rows, 0, len(seed_rows), k, batch_size))
    cand = [np.concatenate([q[key] for q in parts]) for key in ("seed", "pos", "sim")]
    return sample_from_candidates(len(rows), *cand, k=k, scratch=scratch)


def sample_from_candidates(n: int, seed: np.ndarray, pos: np.ndarray, sim: np.ndarray,
                           k: int, scratch: str | None = None) -> RebalanceResult:
    """The selection from retrieval candidates (seed, pool position, exact sim): every retrieved
    position, with its most similar seed (ties: the smallest seed). Depends only on the candidate
    set, not on its order, so 1 and N search tasks select the same."""
    res = _none(n, scratch)
    _column(res, "selected", False)
    make_writable(res, "nearest_seed", "seed_sim")
    if len(pos):
        o = np.lexsort((seed, -sim, pos))  # per position: highest sim first, then smallest seed
        p_o = pos[o]
        first = np.ones(len(o), bool)
        first[1:] = p_o[1:] != p_o[:-1]
        uniq = p_o[first]
        res.selected[uniq] = True
        res.nearest_seed[uniq] = seed[o][first]
        res.seed_sim[uniq] = sim[o][first].astype(np.float32)
    res.report["k"] = k
    return res


def retrieval_cluster_based(pool, seeds, n_clusters: int = 1000, max_per_cluster: int = 10000,
                            min_seeds: int = 1, seed: int = 0, niter: int = 20, level=None,
                            picker=None, scratch: str | None = None) -> RebalanceResult:
    """k-means the pool; keep up to ``max_per_cluster`` random images of every cluster that
    holds at least ``min_seeds`` seeds (seeds are assigned to their nearest centroid).

    ``level``: the k-means made elsewhere (centroids, labels, sizes: the sharded k-means of the step, W tasks);
    ``picker(labels, quota, seed)``: the random pick made elsewhere (curation.kmeans.sampling.sharded_pick). The
    pick is the rows with the smallest per-row hash keys of each chosen cluster (curation.kmeans.sampling.pick),
    so it is the same whether one process or W tasks make it."""
    from curation.kmeans.sampling import pick

    rows = pool if isinstance(pool, Rows) else Rows(pool)
    n = len(rows)
    res = _none(n, scratch)
    if level is None:
        cent = kmeans(rows, n_clusters, niter=niter, seed=seed)
        labels, _ = assign(rows, cent)
        sizes = np.bincount(labels, minlength=len(cent))
    else:
        cent, labels, sizes = level.centroids, level.labels, np.asarray(level.sizes)
    # the seeds per cluster, counted a batch at a time (a curated seed set may hold millions: no label per seed)
    seeds_per_cluster = assign_counts(seeds, cent)
    chosen = np.flatnonzero(seeds_per_cluster >= min_seeds)
    # up to max_per_cluster rows of each chosen cluster: a rank selection by per-row keys (no per-cluster scan)
    quota = np.where(seeds_per_cluster >= min_seeds, np.minimum(sizes, max_per_cluster), 0).astype(np.int64)
    picked = (picker or pick)(labels, quota, seed)  # int64 positions (mapped, from the sharded pick)
    _select(res, picked)
    res.cluster = labels
    res.report.update(n_clusters=len(cent), clusters_with_seeds=int(len(chosen)),
                      min_seeds=min_seeds, max_per_cluster=max_per_cluster)
    res.report["_labels_k"] = (labels, len(cent))
    return res


def hierarchical_balanced(pool, levels: Sequence[int] | str = (1000, 100),
                          target_size: int | None = None, strategy: str = "r",
                          n_resampling_steps: int = 10, sample_size: int = 10, seed: int = 0,
                          niter: int = 50, progress: bool = False, tree=None, picker=None,
                          scratch: str | None = None, **kmeans_kw) -> RebalanceResult:
    """Hierarchical k-means with resampling, then balanced sampling of ``target_size`` images
    (default: half the pool). Level sizes larger than the data are capped; ``levels="auto"``: sized to the pool
    (:func:`auto_levels`). ``tree``: the k-means
    levels already computed (by ``curation.kmeans.dist`` over many processes) for these rows."""
    rows = pool if isinstance(pool, Rows) else Rows(pool)
    n = len(rows)
    res = _none(n, scratch)
    if n == 0:
        return res
    target = n // 2 if target_size is None else int(target_size)
    ks = capped_levels(levels, n)
    if tree is None:
        tree = hierarchical_kmeans(rows, ks, n_resampling_steps=n_resampling_steps,
                                   sample_size=sample_size, niter=niter, seed=seed,
                                   progress=progress, **kmeans_kw)
    elif len(tree[0].labels) != n:
        raise InputError(f"the k-means tree covers {len(tree[0].labels)} rows, the pool {n}")
    picked = balanced_sample(tree, min(target, n), strategy=strategy, seed=seed, picker=picker)
    _select(res, picked)
    res.cluster = np.asarray(tree[0].labels)  # read only (a loaded tree's labels are memory-mapped): no copy
    res.report.update(levels=ks, target_size=target, strategy=strategy,
                      n_resampling_steps=n_resampling_steps, sample_size=sample_size,
                      level1_before=cluster_balance(tree[0].labels, ks[0]),
                      level1_after=cluster_balance(tree[0].labels, ks[0], picked))
    # Balance is reported on the top level: the clusters the target was split evenly over.
    res.report["_labels_k"] = (_top_labels(tree), ks[-1])
    return res


def _top_labels(tree, block: int | None = None) -> np.ndarray:
    """Top-level cluster of every point, following labels up the tree a block of points at a time; in the
    smallest integer type that holds the top level's clusters (the one array per row the report keeps: 2 bytes
    per row up to 65,536 clusters; no int64 index array per row is made on the way)."""

    block, lab0 = block or BLOCK, tree[0].labels
    if len(tree) == 1:
        return lab0
    ups = [np.asarray(lvl.labels) for lvl in tree[1:]]  # one label per cluster of the level below: small
    out = np.empty(len(lab0), np.min_scalar_type(int(np.max(ups[-1], initial=0))))
    for s in range(0, len(lab0), block):
        lab = np.asarray(lab0[s:s + block])
        for up in ups:
            lab = up[lab]
        out[s:s + block] = lab
    return out


def _attach_nearest_seed(rows: Rows, seeds, res: RebalanceResult, batch_size: int) -> None:
    sel = np.flatnonzero(res.selected)
    if not len(sel):
        return
    make_writable(res, "nearest_seed", "seed_sim")
    index = build_index(seeds, kind="flat")
    for pos, sims, idx in iter_knn(index, Rows(rows, sel), 1, batch_size):
        res.nearest_seed[sel[pos]] = idx[:, 0]
        res.seed_sim[sel[pos]] = sims[:, 0]


def balance_before_after(rows: Rows, res: RebalanceResult, k: int | None, seed: int, given=None) -> dict:
    """Entropy of cluster sizes over the whole pool vs over the selection, same clustering. ``given``: (labels,
    k) of the common k-means made elsewhere (the step's W tasks)."""
    labels_k = res.report.pop("_labels_k", None)
    n = len(rows)
    if n == 0:
        return {}
    if k is not None and given is not None:
        labels, k = given
    elif k is not None:  # asked for: a common k-means of that size
        k = min(k, n)
        labels, _ = assign(rows, kmeans(rows, k, seed=seed))
    elif labels_k is not None:  # the mode's own clustering (hierarchical: its top level; cluster: its k-means)
        labels, k = labels_k
    else:  # no clustering in this mode: no extra k-means just for the report
        return {"note": f"mode '{res.report.get('mode', '?')}' clusters nothing; set rebalance.balance_clusters "
                        f"to measure balance with a k-means of that size"}
    return {"clusters": int(k), "before": cluster_balance(labels, k),
            "after": cluster_balance(labels, k, res.selected)}
