"""The synthetic pool, block by block (curation.simulate.chain writes it as embedding shards, W tasks).

* embeddings (N, D) fp16, L2-normalised: C cluster centres (Zipf-like sizes), each row its centre plus
  isotropic noise (two rows of one cluster have cosine ~0.29 +- 0.06: below decontamination's 0.45 but for a
  tail, so a planted eval near-copy of a pool row does not take its cluster with it -- at SPREAD 1.5, ~0.4, it
  took ~20% of it);
* planted near-copies: in every block a fraction ``copy_rate`` of the rows is a copy (cosine ~0.97) of
  another row of the block (``truth_copies``: the (source, copy) pairs);
* hashes (N,) uint64 random 64-bit hashes, with planted near-duplicates (1..``max_distance``
  bits flipped) and exact duplicates of another row of the block (``truth_hash``);
* eval rows (E, D) fp16 (chain.write_eval): E eval images, ``overlap`` of them near-copies of planted pool rows
  (``truth_overlap``: the pool rows), the rest :func:`eval_fresh`: points around the eval set's own centres, each
  centre near a pool centre (cosine EVAL_AFFINITY: the same domain, other images) but not on it, so only the
  planted near-copies sit within the decontamination threshold of the pool (an eval row drawn from the pool's own
  clusters, as before, put 64% of the default pool within 0.45 of some eval row).

Everything is a function of (seed, block index), so the pool does not depend on W.
"""

from __future__ import annotations


import numpy as np


COPY_NOISE = 0.05  # squared norm of a copy's perturbation: cosine ~ 1/sqrt(1.05) ~ 0.976
SPREAD = 2.5  # squared norm of a row's noise around its centre (cosine of two rows of a cluster ~1 / (1 + SPREAD))
EVAL_AFFINITY = 0.5  # cosine of an eval centre to the pool centre it is drawn near (a pool row and a fresh eval
# row around them: cosine ~0.5 / (1 + SPREAD) ~ 0.14, well below decontamination's 0.45 at D = 384)


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


def eval_fresh(m: int, cent: np.ndarray, weights: np.ndarray, dim: int, rng) -> np.ndarray:
    """``m`` eval rows (float32, not normalised) around as many eval centres as there are pool clusters, each
    eval centre at cosine EVAL_AFFINITY to a pool centre picked by the pool's cluster weights."""
    near = cent[rng.choice(len(cent), size=len(cent), p=weights)]
    away = rng.standard_normal((len(cent), dim)).astype(np.float32)
    away -= np.sum(away * near, axis=1, keepdims=True) * near  # orthogonal to its pool centre
    away = _normalise(away)
    own = np.float32(EVAL_AFFINITY) * near + np.float32(np.sqrt(1 - EVAL_AFFINITY ** 2)) * away
    lab = rng.integers(0, len(own), size=m)
    return own[lab] + rng.standard_normal((m, dim)).astype(np.float32) * np.float32(np.sqrt(SPREAD / dim))


def cat(v: list) -> np.ndarray:
    return np.concatenate(v).astype(np.int64) if v else np.zeros(0, np.int64)
