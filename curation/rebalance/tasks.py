"""The rebalance modes' row work as W tasks of the step runner (issue 40): what ran over every row in the
orchestrating process -- the cluster mode's k-means and its assignment, the ``balance_clusters`` k-means, and the
nearest seed of every selected row -- now runs where the rows are owned.

* :func:`flat_kmeans` -- one level of the sharded k-means tree (curation/kmeans/tree.py, the one
  ``rebalance.mode=hierarchical`` uses): rows and centroids split over the W tasks, the same clustering for any
  W; no resampling (one level, sample size 1). The labels come back memory-mapped.
* :func:`sharded_nearest_seed` -- each task searches the seeds (an exact flat index: a curated set is small) for
  its blocks of selected rows and writes a part; the queries are batched per block, so a row's search never
  depends on how the rows were split.

The pick within clusters is :func:`curation.kmeans.sampling.sharded_pick` (three passes as W tasks).
"""

from __future__ import annotations

import os
import shutil

import numpy as np

from curation.kmeans.dist import settings
from curation.core.rows import Gathered
from curation.core.embstore import open_embeddings
from curation.knn.index import Rows, build_index, iter_knn
from curation.core.runner import BLOCK, launch, part_blocks, part_path, parts, run_step, save_blocks, task_blocks, write_part


def flat_kmeans(folder: str, space_dir: str, rows_idx: np.ndarray, k: int, seed: int, kmeans: dict | None,
                tasks: int = 1, launcher: str = "inline"):
    """A k-means of ``k`` clusters (capped at the rows) of the embeddings ``space_dir``'s rows ``rows_idx``, as
    ``tasks`` ranks -> (its :class:`curation.kmeans.hierarchical.Level`: centroids, labels (mapped), sizes; each task's runner
    report). A finished one for the same rows and settings in ``folder`` is reused."""
    from curation.kmeans import hierarchical as _km
    from curation.kmeans.tree import fit_tree

    space = open_embeddings(space_dir)
    k = max(1, min(int(k), len(rows_idx)))
    record = settings(len(rows_idx), Gathered(space.ids, rows_idx), [k], [1], 0, "closest", seed,
                      block=_km.BLOCK, **(kmeans or {}))
    tree, reports = fit_tree(folder, space_dir, rows_idx, record, tasks, launcher)
    return tree[0], reports


def nearest_seed_task(t: int, w: int, space_dir: str, rows_path: str, selected_path: str, seed_dir: str,
                      folder: str, block: int, batch_size: int) -> dict:
    """Task ``t`` of ``w``: the nearest seed (row of ``seed_dir``) and its cosine for each selected row of its
    blocks (``selected_path``: per pool position; ``rows_path``: the position's embedding row)."""
    path = part_path(folder, "nearest", t, w)
    emb = open_embeddings(space_dir)
    rows_idx = np.load(rows_path, mmap_mode="r")
    sel = np.load(selected_path, mmap_mode="r")
    index = build_index(Rows(open_embeddings(seed_dir)), kind="flat")
    pos, near, sim = [], [], []
    for lo, hi in task_blocks(len(sel), t, w, block):
        s = np.flatnonzero(np.asarray(sel[lo:hi])) + lo
        if not len(s):
            continue
        for p, sims, idx in iter_knn(index, Rows(emb, np.asarray(rows_idx[s], np.int64)), 1, batch_size):
            pos.append(s[p])
            near.append(idx[:, 0].astype(np.int64))
            sim.append(sims[:, 0].astype(np.float32))
    write_part(path, pos=_cat(pos, np.int64), near=_cat(near, np.int64), sim=_cat(sim, np.float32))
    return {"selected": int(sum(len(p) for p in pos))}


def _cat(xs: list, dtype) -> np.ndarray:
    return np.concatenate(xs).astype(dtype) if xs else np.zeros(0, dtype)


def sharded_nearest_seed(res, folder: str, space_dir: str, rows_path: str, seed_dir: str, tasks: int = 1,
                         launcher: str = "inline", block: int | None = None, batch_size: int = 8192) -> None:
    """Fill ``res``'s (a curation.rebalance.modes.RebalanceResult) ``nearest_seed`` / ``seed_sim`` for its selected rows,
    searched by ``tasks`` tasks of the runner; the parts are read back a block at a time."""
    from curation.rebalance.modes import make_writable

    block = block or BLOCK
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    selected_path = os.path.join(folder, "selected.npy")
    save_blocks(selected_path, res.selected, block=block)
    w = int(tasks)
    run_step(nearest_seed_task, w, **launch(launcher, w), space_dir=space_dir, rows_path=rows_path,
             selected_path=selected_path, seed_dir=seed_dir, folder=folder, block=block, batch_size=batch_size)
    make_writable(res, "nearest_seed", "seed_sim")
    for p in parts(folder, "nearest", w):
        for got in part_blocks(p, block):  # a block of a task's part at a time
            res.nearest_seed[got["pos"]] = got["near"]
            res.seed_sim[got["pos"]] = got["sim"]
    shutil.rmtree(folder, ignore_errors=True)
