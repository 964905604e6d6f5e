"""Cheap pre-dedup: exact and near-exact copies by perceptual-hash Hamming distance.

Two 64-bit hashes within Hamming distance t agree exactly on at least one of t+1 disjoint bit
bands (pigeonhole), so candidate pairs come from grouping equal band values; only those pairs
are compared bit by bit (multi-index hashing, Norouzi et al. 2012). Identical hashes are merged
first, so a flood of identical files (e.g. 100k blank images) costs one group, not 10^10 pairs.
Groups are closed transitively with union-find; the kept image is the smallest id.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .unionfind import UnionFind, id_ranks

# pHash copies measured on real photos: resized / recompressed copies differ by <= 4 bits,
# 5%-cropped ones by up to ~20, and distinct photos by >= 18. 4 keeps this pass "near-exact";
# crops are left to the embedding-based copy dedup.
DEFAULT_MAX_DISTANCE = 4


@dataclass
class HashDedupResult:
    group: np.ndarray  # (N,) position of the group's kept image (smallest id)
    keep: np.ndarray  # (N,) bool: True for the one kept image of each group
    n_pairs: int  # candidate pairs within the distance (after merging identical hashes)

    @property
    def n_duplicates(self) -> int:
        return int((~self.keep).sum())


def hash_dedup(hashes: np.ndarray, ids, max_distance: int = DEFAULT_MAX_DISTANCE,
               bits: int = 64, max_bucket: int = 4096) -> HashDedupResult:
    """Group images whose hashes differ in at most ``max_distance`` bits; keep the smallest id.

    ``max_bucket`` bounds the pairwise work inside one band bucket (values beyond it are compared
    in chunks, so very common band values cost time, not memory).
    """
    hashes = np.asarray(hashes, dtype=np.uint64)
    n = len(hashes)
    order, rank = id_ranks(ids)
    uf = UnionFind(n)  # in rank space: roots are smallest ids
    if n == 0:
        return HashDedupResult(np.zeros(0, np.int64), np.zeros(0, bool), 0)
    # 1. identical hashes: link each to the first of its run.
    uniq, inverse = np.unique(hashes, return_inverse=True)
    first = np.full(len(uniq), n, np.int64)  # smallest rank holding each hash value
    np.minimum.at(first, inverse.ravel(), rank)
    uf.union(rank, first[inverse.ravel()])
    n_pairs = 0
    # 2. near-identical unique hashes via band buckets.
    if max_distance > 0 and len(uniq) > 1:
        a, b = _near_pairs(uniq, max_distance, bits, max_bucket)
        n_pairs = len(a)
        if n_pairs:
            uf.union(first[a], first[b])
    roots_rank = uf.roots()[rank]
    group = order[roots_rank]
    keep = group == np.arange(n)
    return HashDedupResult(group, keep, n_pairs)


def _near_pairs(uniq: np.ndarray, t: int, bits: int, max_bucket: int):
    """Pairs (i, j), i < j, of distinct hash values within Hamming distance t."""
    n_bands = t + 1
    edges = np.linspace(0, bits, n_bands + 1).astype(int)
    found_a, found_b = [], []
    for lo, hi in zip(edges[:-1], edges[1:]):
        width = hi - lo
        mask = np.uint64((1 << width) - 1)
        key = (uniq >> np.uint64(lo)) & mask
        srt = np.argsort(key, kind="stable")
        ks = key[srt]
        starts = np.flatnonzero(np.r_[True, ks[1:] != ks[:-1]])
        ends = np.r_[starts[1:], len(ks)]
        for s, e in zip(starts, ends):
            if e - s < 2:
                continue
            members = srt[s:e]
            for c0 in range(0, len(members), max_bucket):
                chunk = members[c0:c0 + max_bucket]
                dist = np.bitwise_count(uniq[chunk][:, None] ^ uniq[members][None, :])
                ii, jj = np.nonzero(dist <= t)
                ia, jb = chunk[ii], members[jj]
                sel = ia < jb
                found_a.append(ia[sel])
                found_b.append(jb[sel])
    if not found_a:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    pairs = np.unique(np.stack([np.concatenate(found_a), np.concatenate(found_b)], 1), axis=0)
    return pairs[:, 0], pairs[:, 1]


def hamming(a: int, b: int) -> int:
    return int(a ^ b).bit_count()
