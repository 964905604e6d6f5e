"""The steps after embedding, each a task function ``fn(task_index, num_tasks, folder, ...)`` of the one
step shape (curation.steps.runner): memory-mapped inputs, this task's rows, an atomic part file,
skipped when the part exists. Single-task steps (index train / merge, grouping, the upper k-means
levels) are the ones whose work does not grow with N per process, or (grouping) holds one int64 per row.
"""

from __future__ import annotations

import os

import numpy as np

from .._faiss import faiss
from ..hashdedup import group_pairs, merge_pair_parts, near_pairs_task
from ..index import Rows, add_part, load_ondisk, merge_parts, train_ondisk
from ..knn_shards import candidate_pairs, exact_cosine
from ..steps import sampling
from ..steps.runner import BLOCK, part_done, part_path, parts, read_part, task_blocks, task_rows, write_part

KEPT, HASH_DUP, COPY_DUP, DECONTAM, NOT_SELECTED = 0, 1, 2, 3, 4
STATUS = ("kept", "hash_duplicates", "copy_duplicates", "decontaminated", "not_selected")
EVAL_BLOCK = 1024


def _p(folder, *a):
    return os.path.join(folder, *a)


def _part(folder, name, t, w):
    return part_path(_p(folder, "parts"), name, t, w)


def _save_npy(path: str, arr: np.ndarray) -> None:
    np.save(path + ".tmp.npy", arr)
    os.replace(path + ".tmp.npy", path)


def _rows(folder) -> Rows:
    return Rows(np.load(_p(folder, "emb.npy"), mmap_mode="r"))


# ------------------------------------------------------------------------------------------- hash
def hash_pairs(t, w, folder, max_distance):
    out = _part(folder, "hash", t, w)
    if not part_done(out):
        a, b = near_pairs_task(np.load(_p(folder, "hashes.npy"), mmap_mode="r"), t, w, max_distance)
        write_part(out, a=a, b=b)
    return {}


def hash_group(t, w, folder, parts_of):
    path = _p(folder, "hash_group.npy")
    if not os.path.exists(path):
        n = len(np.load(_p(folder, "hashes.npy"), mmap_mode="r"))
        got = [read_part(p) for p in parts(_p(folder, "parts"), "hash", parts_of)]
        a, b = merge_pair_parts([(g["a"], g["b"]) for g in got])
        del got
        _save_npy(path, group_pairs(n, a, b)[0])
    return {}


# ------------------------------------------------------------------------------------------ index
def index_train(t, w, folder, nlist, train_size, seed=0, quantizer="auto"):
    train_ondisk(_rows(folder), _p(folder, "trained.index"), "ivf_sq8", nlist, train_size, seed,
                 quantizer=quantizer)
    return {}


def index_add(t, w, folder):
    rows = _rows(folder)
    lo, hi = task_rows(len(rows), t, w)
    times = {"assign_s": 0.0, "encode_s": 0.0}  # stays 0 when the part existed (a rerun)
    add_part(_p(folder, "trained.index"), rows, lo, hi, _part(folder, "index", t, w).replace(".npz", ".index"),
             timings=times)
    return times


def index_merge(t, w, folder, parts_of):
    names = [_part(folder, "index", i, parts_of).replace(".npz", ".index") for i in range(parts_of)]
    merge_parts(_p(folder, "trained.index"), names, _p(folder, "merged.index"))
    return {}


# ----------------------------------------------------------------------------------------- search
QUERY_SALT = 0x51
"""Seed of the per-row key that picks the queried rows (:func:`queried`): not the sampling's seed."""


def queried(lo: int, hi: int, fraction: float) -> np.ndarray:
    """The rows of [lo, hi) that query the index: all of them at fraction 1, else every row whose
    splitmix64 key (of the row alone) falls under ``fraction`` of 2^64 -- the same rows whatever W."""
    pos = np.arange(lo, hi, dtype=np.int64)
    return pos if fraction >= 1.0 else pos[is_queried(pos, fraction)]


def is_queried(rows: np.ndarray, fraction: float) -> np.ndarray:
    """Whether each row queries the index at this query fraction (a function of the row only)."""
    if fraction >= 1.0:
        return np.ones(len(rows), bool)
    return sampling.row_keys(np.asarray(rows, np.int64), QUERY_SALT) < np.uint64(min(int(fraction * 2.0**64), 2**64 - 1))


def search(t, w, folder, k, threshold, nprobe, query_fraction=1.0):
    """Copy candidates of this task's query rows (all, or the ``query_fraction`` picked by :func:`queried`;
    the whole pool is indexed): kNN on the merged index, rescored exactly (float64)."""
    out = _part(folder, "search", t, w)
    if part_done(out):
        return {"queries": int(read_part(out)["queries"])}
    index, rows = load_ondisk(_p(folder, "merged.index"), "ivf_sq8", nprobe), _rows(folder)
    got = {"a": [], "b": [], "sim": []}
    if query_fraction >= 1.0:
        batches = [(lo, hi, None) for lo, hi in task_blocks(len(rows), t, w)]
    else:  # the picked rows of all this task's blocks, searched in full batches
        lo, hi = task_rows(len(rows), t, w)
        pos = np.concatenate([queried(a, b, query_fraction) for a, b in task_blocks(len(rows), t, w)] or
                             [np.zeros(0, np.int64)])
        batches = [(lo, hi, pos)]
    queries = 0
    for lo, hi, pos in batches:
        queries += hi - lo if pos is None else len(pos)
        for r in candidate_pairs(index, rows, lo, hi, k, threshold, batch_size=8192, positions=pos):
            for key in got:
                got[key].append(r[key])
    empty = {"a": np.zeros(0, np.int64), "b": np.zeros(0, np.int64), "sim": np.zeros(0)}
    write_part(out, queries=np.int64(queries), **{key: np.concatenate(v) if v else empty[key] for key, v in got.items()})
    return {"queries": queries}


def group(t, w, folder, parts_of):
    """Copy components from the sorted pair arrays (kept image: the smallest row)."""
    path = _p(folder, "component.npy")
    if not os.path.exists(path):
        n = len(np.load(_p(folder, "hashes.npy"), mmap_mode="r"))
        got = [read_part(p) for p in parts(_p(folder, "parts"), "search", parts_of)]
        a = np.concatenate([g["a"] for g in got])
        b = np.concatenate([g["b"] for g in got])
        del got
        a, b = merge_pair_parts([(np.minimum(a, b), np.maximum(a, b))])
        _save_npy(path, group_pairs(n, a, b)[0])
    return {}


# ---------------------------------------------------------------------------------- decontaminate
def decontaminate(t, w, folder, threshold, nprobe, margin=0.02):
    """Pool rows with cosine > threshold to one of this task's eval rows: a range search of the eval
    rows on the merged pool index (no k cap), rescored exactly."""
    out = _part(folder, "decontam", t, w)
    if part_done(out):
        return {}
    ev = Rows(np.load(_p(folder, "eval.npy"), mmap_mode="r"))
    index, rows = load_ondisk(_p(folder, "merged.index"), "ivf_sq8", nprobe), _rows(folder)
    hit = []
    lo, hi = task_rows(len(ev), t, w, EVAL_BLOCK)
    for s in range(lo, hi, EVAL_BLOCK):
        pos = np.arange(s, min(s + EVAL_BLOCK, hi))
        lims, _, ids = index.index.range_search(np.ascontiguousarray(ev.take(pos)), threshold - margin)
        q = np.repeat(pos, np.diff(lims).astype(np.int64))
        sim = exact_cosine(ev, q, rows, ids)
        hit.append(ids[sim > threshold])
    write_part(out, rows=np.unique(np.concatenate(hit)) if hit else np.zeros(0, np.int64))
    return {}


def flagged_roots(folder, parts_of) -> np.ndarray:
    rows = np.concatenate([read_part(p)["rows"] for p in parts(_p(folder, "parts"), "decontam", parts_of)])
    comp = np.load(_p(folder, "component.npy"), mmap_mode="r")
    return np.unique(comp[np.sort(rows)]) if len(rows) else np.zeros(0, np.int64)


def status_of(folder, lo, hi, roots) -> np.ndarray:
    """Status of rows [lo, hi) after hash dedup, copy dedup and decontamination (before sampling)."""
    own = np.arange(lo, hi)
    hg = np.load(_p(folder, "hash_group.npy"), mmap_mode="r")[lo:hi]
    comp = np.load(_p(folder, "component.npy"), mmap_mode="r")[lo:hi]
    st = np.zeros(hi - lo, np.int8)
    st[hg != own] = HASH_DUP
    st[(st == KEPT) & (comp != own)] = COPY_DUP
    st[(st == KEPT) & np.isin(comp, roots)] = DECONTAM
    return st


# ---------------------------------------------------------------------------------------- k-means
def kmeans_train(t, w, folder, k, points_per_centroid, niter, seed):
    """Level 1 fitted once on a fixed sample of k * points_per_centroid rows (Lloyd's cost does not
    grow with N); every row is then assigned by the W tasks (:func:`kmeans_assign`)."""
    path = _p(folder, "centroids_level1.npy")
    if not os.path.exists(path):
        rows = _rows(folder)
        rng = np.random.default_rng([seed, 3])
        pick = np.sort(rng.choice(len(rows), size=min(len(rows), k * points_per_centroid), replace=False))
        x = np.ascontiguousarray(rows.take(pick))
        km = faiss.Kmeans(x.shape[1], k, niter=niter, seed=seed, max_points_per_centroid=points_per_centroid)
        km.train(x)
        _save_npy(path, km.centroids)
    return {}


def kmeans_assign(t, w, folder):
    out = _part(folder, "assign", t, w)
    if part_done(out):
        return {}
    cent = np.load(_p(folder, "centroids_level1.npy"))
    index = faiss.IndexFlatL2(cent.shape[1])
    index.add(cent)
    rows = _rows(folder)
    labs = []
    for lo, hi in task_blocks(len(rows), t, w):
        labs.append(index.search(np.ascontiguousarray(rows.take(np.arange(lo, hi))), 1)[1][:, 0])
    lab = np.concatenate(labs).astype(np.int32) if labs else np.zeros(0, np.int32)
    write_part(out, labels=lab)
    return {}


def kmeans_upper(t, w, folder, levels, niter, seed):
    """Levels 2.. cluster the level below's centroids (k-by-D arrays: one task)."""
    cent = np.load(_p(folder, "centroids_level1.npy"))
    for li, k in enumerate(levels[1:], start=2):
        path = _p(folder, f"labels_level{li}.npy")
        if not os.path.exists(path):
            km = faiss.Kmeans(cent.shape[1], int(min(k, len(cent))), niter=niter, seed=seed + li)
            km.train(np.ascontiguousarray(cent, np.float32))
            _save_npy(path, km.index.search(cent, 1)[1][:, 0].astype(np.int64))
            _save_npy(_p(folder, f"centroids_level{li}.npy"), km.centroids)
        cent = np.load(_p(folder, f"centroids_level{li}.npy"))
    return {}


# --------------------------------------------------------------------------------------- sampling
def _own_alive(folder, t, w, parts_of, roots, seed):
    n = len(np.load(_p(folder, "hashes.npy"), mmap_mode="r"))
    lo, hi = task_rows(n, t, w)
    lab = _labels(folder, lo, hi, parts_of)
    st = status_of(folder, lo, hi, roots)
    alive = st == KEPT
    return lo, hi, st, alive, lab[alive], sampling.row_keys(np.arange(lo, hi)[alive], seed)


def _labels(folder, lo, hi, parts_of):
    """Level-1 labels of rows [lo, hi) from the assign parts (whatever W wrote them)."""
    n = len(np.load(_p(folder, "hashes.npy"), mmap_mode="r"))
    out = []
    for i in range(parts_of):
        a, b = task_rows(n, i, parts_of)
        if b > lo and a < hi:
            lab = read_part(_part(folder, "assign", i, parts_of))["labels"]
            out.append(lab[max(lo, a) - a:min(hi, b) - a])
    return np.concatenate(out) if out else np.zeros(0, np.int32)


def sample_hist(t, w, folder, k, parts_of, seed):
    out = _part(folder, "hist", t, w)
    if not part_done(out):
        roots = np.load(_p(folder, "roots.npy"))
        *_, lab, keys = _own_alive(folder, t, w, parts_of, roots, seed)
        write_part(out, hist=sampling.histogram(lab, keys, k))
    return {}


def sample_boundary(t, w, folder, parts_of, seed):
    out = _part(folder, "boundary", t, w)
    if not part_done(out):
        roots, b = np.load(_p(folder, "roots.npy")), np.load(_p(folder, "sample_byte.npy"))
        *_, lab, keys = _own_alive(folder, t, w, parts_of, roots, seed)
        lab, keys = sampling.in_boundary(lab.astype(np.int64), keys, b)
        write_part(out, labels=lab, keys=keys)
    return {}


def decide(t, w, folder, parts_of, seed):
    """The final status of this task's rows (int8 part: kept / duplicate / decontaminated / not selected)."""
    out = _part(folder, "decisions", t, w)
    if not part_done(out):
        roots, b = np.load(_p(folder, "roots.npy")), np.load(_p(folder, "sample_byte.npy"))
        thr = np.load(_p(folder, "sample_thr.npy"))
        lo, hi, st, alive, lab, keys = _own_alive(folder, t, w, parts_of, roots, seed)
        pick = sampling.selected(lab.astype(np.int64), keys, b, thr)
        idx = np.flatnonzero(alive)
        st[idx[~pick]] = NOT_SELECTED
        write_part(out, status=st, lo=np.int64(lo))
    return {}


__all__ = ["BLOCK", "STATUS", "hash_pairs", "hash_group", "index_train", "index_add", "index_merge", "search",
           "group", "decontaminate", "flagged_roots", "kmeans_train", "kmeans_assign", "kmeans_upper",
           "sample_hist", "sample_boundary", "decide"]
