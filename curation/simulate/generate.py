"""The synthetic pool, written by W tasks in blocks (memory per task: one block).

* ``emb.npy`` (N, D) fp16, L2-normalised: C cluster centres (Zipf-like sizes), each row its centre plus
  isotropic noise (two rows of one cluster have cosine ~0.4; the nearest unrelated row ~0.5);
* planted near-copies: in every block a fraction ``copy_rate`` of the rows is a copy (cosine ~0.97) of
  another row of the block (``truth_copies``: the (source, copy) pairs);
* ``hashes.npy`` (N,) uint64 random 64-bit hashes, with planted near-duplicates (1..``max_distance``
  bits flipped) and exact duplicates of another row of the block (``truth_hash``);
* ``eval.npy`` (E, D) fp16: E eval images, ``overlap`` of them near-copies of planted pool rows
  (``truth_overlap``: the pool rows), the rest fresh points of the clusters.

Everything is a function of (seed, block index), so the pool does not depend on W.
"""

from __future__ import annotations

import os

import numpy as np
from numpy.lib.format import open_memmap

from ..steps.runner import part_done, part_path, read_part, task_blocks, write_part

COPY_NOISE = 0.05  # squared norm of a copy's perturbation: cosine ~ 1/sqrt(1.05) ~ 0.976
SPREAD = 1.5  # squared norm of a row's noise around its centre


def centres(n_clusters: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([seed, 0])
    c = rng.standard_normal((n_clusters, dim)).astype(np.float32)
    c /= np.linalg.norm(c, axis=1, keepdims=True)
    w = 1.0 / np.arange(1, n_clusters + 1) ** 0.8  # long-tailed cluster sizes, for rebalancing
    return c, w / w.sum()


def _normalise(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def gen_block(lo: int, hi: int, cent, weights, dim: int, seed: int, copy_rate: float,
              hash_rate: float, max_distance: int):
    rng = np.random.default_rng([seed, 1, lo])  # a function of the block, not of W
    n = hi - lo
    lab = rng.choice(len(cent), size=n, p=weights)
    x = cent[lab] + rng.standard_normal((n, dim)).astype(np.float32) * np.float32(np.sqrt(SPREAD / dim))
    n_copy = int(round(copy_rate * n)) if n > 1 else 0
    pick = rng.permutation(n)[: 2 * n_copy]
    src, dst = pick[:n_copy], pick[n_copy:]
    x[dst] = _normalise(x[src]) + rng.standard_normal((n_copy, dim)).astype(np.float32) * np.float32(
        np.sqrt(COPY_NOISE / dim))
    x = _normalise(x).astype(np.float16)
    h = rng.integers(0, np.iinfo(np.int64).max, size=n, dtype=np.int64).astype(np.uint64)
    h ^= rng.integers(0, 2, size=n, dtype=np.int64).astype(np.uint64) << np.uint64(63)
    n_h = int(round(hash_rate * n)) if n > 1 else 0
    pick = rng.permutation(n)[: 2 * n_h]
    hs, hd = pick[:n_h], pick[n_h:]
    flips = np.zeros(n_h, np.uint64)
    nbits = rng.integers(0, max_distance + 1, size=n_h)  # 0: an exact duplicate
    for i, k in enumerate(nbits):
        for bit in rng.choice(64, size=k, replace=False):
            flips[i] |= np.uint64(1) << np.uint64(bit)
    h[hd] = h[hs] ^ flips
    return x, h, (src + lo, dst + lo), (hs + lo, hd + lo), lab


def generate_task(task_index: int, num_tasks: int, folder: str, n: int, dim: int, n_clusters: int,
                  seed: int, copy_rate: float, hash_rate: float, max_distance: int) -> dict:
    cent, w = centres(n_clusters, dim, seed)
    out = part_path(os.path.join(folder, "parts"), "generate", task_index, num_tasks)
    if part_done(out):
        return {}
    emb = np.load(os.path.join(folder, "emb.npy"), mmap_mode="r+")
    hashes = np.load(os.path.join(folder, "hashes.npy"), mmap_mode="r+")
    cs, cd, hs, hd = [], [], [], []
    for lo, hi in task_blocks(n, task_index, num_tasks):
        x, h, (s, d), (a, c), _ = gen_block(lo, hi, cent, w, dim, seed, copy_rate, hash_rate,
                                            max_distance)
        emb[lo:hi], hashes[lo:hi] = x, h
        cs.append(s), cd.append(d), hs.append(a), hd.append(c)
    emb.flush(), hashes.flush()
    del emb, hashes
    write_part(out, copy_src=cat(cs), copy_dst=cat(cd), hash_src=cat(hs), hash_dst=cat(hd))
    return {}


def cat(v: list) -> np.ndarray:
    return np.concatenate(v).astype(np.int64) if v else np.zeros(0, np.int64)


def create_arrays(folder: str, n: int, dim: int) -> None:
    os.makedirs(os.path.join(folder, "parts"), exist_ok=True)
    for name, dtype, shape in (("emb.npy", np.float16, (n, dim)), ("hashes.npy", np.uint64, (n,))):
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            open_memmap(path + ".tmp.npy", "w+", dtype, shape).flush()
            os.replace(path + ".tmp.npy", path)


def make_eval(folder: str, n: int, dim: int, n_clusters: int, n_eval: int, overlap: int, seed: int) -> None:
    """eval.npy: ``overlap`` near-copies of random pool rows (truth), the rest fresh cluster points."""
    path = os.path.join(folder, "eval.npy")
    if os.path.exists(path):
        return
    rng = np.random.default_rng([seed, 2])
    rows = np.sort(rng.choice(n, size=min(overlap, n), replace=False))
    emb = np.load(os.path.join(folder, "emb.npy"), mmap_mode="r")
    x = emb[rows].astype(np.float32) + rng.standard_normal((len(rows), dim)).astype(np.float32) * np.float32(
        np.sqrt(COPY_NOISE / dim))
    cent, w = centres(n_clusters, dim, seed)
    m = n_eval - len(rows)
    fresh = cent[rng.choice(len(cent), size=m, p=w)] + rng.standard_normal((m, dim)).astype(
        np.float32) * np.float32(np.sqrt(SPREAD / dim))
    ev = _normalise(np.concatenate([x, fresh])).astype(np.float16)
    np.save(os.path.join(folder, "truth_overlap.npy"), rows.astype(np.int64))
    np.save(path + ".tmp.npy", ev)
    os.replace(path + ".tmp.npy", path)


def truth(folder: str, num_tasks: int) -> dict:
    """The planted pairs, gathered from the generation parts."""
    from ..steps.runner import parts

    got = [read_part(p) for p in parts(os.path.join(folder, "parts"), "generate", num_tasks)]
    out = {k: np.concatenate([g[k] for g in got]) for k in got[0]}
    out["overlap"] = np.load(os.path.join(folder, "truth_overlap.npy"))
    return out
