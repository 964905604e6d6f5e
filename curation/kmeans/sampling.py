"""Balanced sampling over a k-means tree, by W tasks (no torch, no per-cluster Python lists of rows).

:func:`quota` walks the tree top-down and splits the target over level-1 clusters as evenly as their
sizes allow (Vo et al. 2024; the split :func:`curation.kmeans.hierarchical.balanced_sample` makes). Picking the
``q_c`` rows of cluster ``c`` is then a rank selection by a per-row hash key, done exactly in three
sharded passes whose merges are O(k * 256): per-task histograms of (cluster, top key byte) -> the byte
where each cluster's quota ends -> per-task keys in that byte -> each cluster's threshold key -> every
task marks its rows. Same rows for any W (the key is a function of the row and the seed).
"""

from __future__ import annotations

import os

import numpy as np

from curation.core.rows import row_keys

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


def pick(labels: np.ndarray, q: np.ndarray, seed: int) -> np.ndarray:
    """In one process: the ``q[c]`` rows of each cluster ``c`` with the smallest keys (sorted positions).
    The keys are distinct (splitmix64 is a bijection of the row), so this is exactly what the three
    sharded passes (:func:`sharded_pick`) select."""
    labels = np.asarray(labels, np.int64)
    n = len(labels)
    if not n:
        return np.zeros(0, np.int64)
    keys = row_keys(np.arange(n), seed)
    order = np.lexsort((keys, labels))
    lab = labels[order]
    rank = np.arange(n) - np.searchsorted(lab, np.arange(len(q)))[lab]
    return np.sort(order[rank < np.asarray(q)[lab]])


def _own(labels_path: str, t: int, w: int, block: int, seed: int):
    """This task's rows a block at a time: ``(first row, labels (int64), keys)`` -- a task holds one block's
    temporaries and its outputs, whatever its share of the rows."""
    from curation.core.runner import task_blocks

    lab = np.load(labels_path, mmap_mode="r")
    for lo, hi in task_blocks(len(lab), t, w, block):
        yield lo, np.asarray(lab[lo:hi], np.int64), row_keys(np.arange(lo, hi), seed)


def hist_task(t, w, labels_path, folder, k, seed, block):
    from curation.core.runner import part_path, write_part

    hist = np.zeros((k, BINS), np.int64)
    for _, lab, keys in _own(labels_path, t, w, block, seed):
        hist += histogram(lab, keys, k)
    write_part(part_path(folder, "hist", t, w), hist=hist)
    return {}


def boundary_task(t, w, labels_path, folder, byte, seed, block):
    from curation.core.runner import part_path, write_part

    got = [in_boundary(lab, keys, byte) for _, lab, keys in _own(labels_path, t, w, block, seed)]
    write_part(part_path(folder, "boundary", t, w), labels=_cat([g[0] for g in got], np.int64),
               keys=_cat([g[1] for g in got], np.uint64))
    return {}


def select_task(t, w, labels_path, folder, byte, thr, seed, block):
    from curation.core.runner import part_path, write_part

    rows = [np.flatnonzero(selected(lab, keys, byte, thr)) + lo for lo, lab, keys in _own(labels_path, t, w, block,
                                                                                            seed)]
    rows = _cat(rows, np.int64)
    write_part(part_path(folder, "picked", t, w), rows=rows)
    return {"picked": int(len(rows))}


def _cat(arrays: list, dtype) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)


def sharded_pick(labels: np.ndarray, q: np.ndarray, seed: int, folder: str, tasks: int = 1,
                 launcher: str = "inline", block: int | None = None) -> np.ndarray:
    """:func:`pick` as W tasks of the runner (curation.core.runner): each task reads its blocks of the
    labels from ``folder/labels.npy``; the merges between the three passes are O(k x 256). The labels are
    written there a block at a time and the picked rows come back memory-mapped (``folder/picked.npy``,
    written a part at a time): this process holds no array per row."""
    import shutil

    from curation.core.runner import BLOCK, launch, part_blocks, parts, read_part, run_step, save_blocks

    block = block or BLOCK
    if os.path.isdir(folder):
        shutil.rmtree(folder)  # the parts of an earlier selection
    os.makedirs(folder)
    labels_path = os.path.join(folder, "labels.npy")
    save_blocks(labels_path, labels if hasattr(labels, "dtype") else np.asarray(labels), block=block)
    k, w = len(q), int(tasks)
    kw = {**launch(launcher, w), "labels_path": labels_path,
          "folder": folder, "seed": seed, "block": block}
    run_step(hist_task, w, k=k, **kw)
    hist = sum(read_part(p)["hist"] for p in parts(folder, "hist", w))
    byte, need = boundary(hist, np.asarray(q, np.int64))
    run_step(boundary_task, w, byte=byte, **kw)
    got = [read_part(p) for p in parts(folder, "boundary", w)]
    thr = thresholds(np.concatenate([g["labels"] for g in got]), np.concatenate([g["keys"] for g in got]), need)
    del got
    ran = {r["task"]: r["result"].get("picked") for r in run_step(select_task, w, byte=byte, thr=thr, **kw)}
    paths = parts(folder, "picked", w)
    sizes = [ran[t] if ran.get(t) is not None else sum(len(g["rows"]) for g in part_blocks(p, block))
             for t, p in enumerate(paths)]
    out_path = os.path.join(folder, "picked.npy")
    out = np.lib.format.open_memmap(out_path, mode="w+", dtype=np.int64, shape=(sum(sizes),))
    at = 0
    for p in paths:
        for got in part_blocks(p, block):  # a block of one task's rows at a time
            out[at:at + len(got["rows"])] = got["rows"]
            at += len(got["rows"])
    out.flush()
    del out
    return np.load(out_path, mmap_mode="r")

