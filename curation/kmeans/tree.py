"""The hierarchical k-means tree of `curate run` (rebalance.mode=hierarchical) as W tasks of the step runner.

The tree is the sharded one of ``curate kmeans`` (curation/kmeans/dist.py: every level's rows and centroids
split over the tasks, bit-identical for any W), whatever W is, so the decisions do not depend on it:

* ``tasks.count`` W > 1, ``tasks.launcher=local``: W fresh processes (:func:`curation.core.runner.run_step`)
  that form a gloo group through a file store in the tree's folder and run :func:`curation.kmeans.dist.run`
  as its ranks -- each holds its blocks of rows, its pieces of each level's centroids and one received piece;
* ``tasks.launcher=srun``: the W ranks are the W tasks of one ``srun`` job step in the Slurm allocation
  (possibly on several nodes), the same file store in the tree's folder (on the file system all nodes see);
* W = 1 or ``launcher=inline``: the same code as one rank in this process (the same tree).

A finished tree for the same rows and settings (kmeans.json, checked by :func:`curation.kmeans.dist.load_tree`)
is reused by a rerun; an unfinished or different one is clustered again.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import torch
import torch.distributed as dist

from curation.kmeans.dist import load_tree, run
from curation.core.runner import launch, run_step

# (imported at the top, not in the task: a task process has torch loaded before its memory is measured)


def tree_task(t: int, w: int, emb_dir: str, out: str, levels, sample_sizes, steps: int, seed: int, block: int,
              piece_bytes: int, record: dict, kmeans: dict) -> dict:
    """Rank ``t`` of ``w``: the rows ``out/rows.npy`` of the embeddings (memory-mapped: a task reads the
    positions of its own blocks), clustered into ``out``."""
    rows_idx = np.load(os.path.join(out, "rows.npy"), mmap_mode="r")
    device = f"cuda:{t % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    kw = dict(levels=list(levels), sample_sizes=list(sample_sizes), steps=steps, sampling="closest", seed=seed,
              block=block, rows_idx=rows_idx, piece_bytes=piece_bytes, record=record, **kmeans)
    if w == 1:
        summary = run(emb_dir, out, group=(0, 1, device), **kw)
    else:
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(out, "store"), w), rank=t, world_size=w)
        try:  # collectives on the CPU (gloo), the assignment on this task's device
            summary = run(emb_dir, out, group=(t, w, device), comm_device="cpu", **kw)
        finally:
            dist.destroy_process_group()
    return {"centroid_bytes_per_rank": summary["centroid_bytes_per_rank"]}


def fit_tree(out: str, emb_dir: str, rows_idx: np.ndarray, record: dict, tasks: int = 1, launcher: str = "inline",
             piece_bytes: int | None = None) -> tuple[list, list[dict]]:
    """The k-means tree ``record`` (:func:`curation.kmeans.dist.curate_settings`) describes for ``rows_idx``,
    as ``tasks`` ranks -> (its levels, each task's runner report: wall time, peak memory; empty when a
    finished tree was reused)."""
    try:
        return load_tree(out, record, "rebalance"), []
    except (FileNotFoundError, ValueError):
        pass
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    np.save(os.path.join(out, "rows.npy"), np.asarray(rows_idx, np.int64))
    w = int(tasks) if launcher in ("local", "srun") else 1  # inline: one rank here -- the same tree as W ranks
    km = {k: record[k] for k in ("niter", "tol", "init", "init_sample", "n_init", "max_points_per_centroid")}
    res = run_step(tree_task, w, **launch(launcher, w), emb_dir=emb_dir, out=out,
                   levels=record["levels"], sample_sizes=record["sample_sizes"], steps=record["steps"],
                   seed=record["seed"], block=record["block"], piece_bytes=piece_bytes or _piece_bytes(),
                   record=record, kmeans=km)
    for f in ("store", "rows.npy"):
        if os.path.exists(os.path.join(out, f)):
            os.remove(os.path.join(out, f))
    return load_tree(out, record, "rebalance"), res


def _piece_bytes() -> int:
    from curation.kmeans import dist as dist_kmeans

    return dist_kmeans.PIECE_BYTES  # read at call time (tests set it smaller)
