"""Cheap pre-dedup: exact and near-exact copies by perceptual-hash Hamming distance, as W tasks.

Guarantee (exact, no false negatives): two 64-bit hashes within Hamming distance ``t`` agree exactly
on at least one of ``t+1`` disjoint bit bands (pigeonhole); the remaining bits then still differ in at
most ``t`` places, so they agree on one of ``t+1`` disjoint sub-bands of those bits too (pigeonhole
again: multi-index hashing, Norouzi et al. 2012, applied twice). Every pair within ``t`` therefore
shares one of the ``(t+1)^2`` keys ``hash & mask(band, sub-band)`` (~23 fixed bits for t=4), and only
pairs sharing a key are compared bit by bit. A bucket of one key holds ~N / 2^23 unrelated hashes, so
the expected comparisons per image are ``(t+1)^2 * N / 2^23`` (~3 at 10^6, ~30 at 10^7, ~3.6k at
1.2*10^9 in total over the tasks) instead of the ~N / 2^13 of one band level (6*10^14 pairs at 10^9).
Identical hashes are linked to their first row before any comparison, so a flood of identical files
(100k blank images) costs one group, not 10^10 pairs; buckets still larger than ``MAX_RUN`` distinct
hashes are compared in chunks (time, not memory).

Sharding: task ``i`` of ``W`` owns the keys whose first-level band value ``% W == i`` (each row falls in
exactly one task per band); it streams the hashes in blocks, keeps its ~N/W rows per band and writes
its pairs. The union of the tasks' pairs does not depend on ``W``: same groups for W=1 and W=4.
Groups are closed transitively with union-find; the kept image is the smallest id.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from curation.config import DEFAULT_MAX_DISTANCE
from curation.core.unionfind import SparseRoots, UnionFind, id_ranks, in_id_order, is_root

MAX_RUN = 256
"""Distinct hashes of one key above which a bucket is compared in chunks rather than by offsets."""
BLOCK = 1 << 18  # rows scanned at a time: ~10 MB of temporaries per task whatever N


@dataclass
class HashDedupResult:
    group: np.ndarray  # (N,) position of the group's kept image (smallest id)
    keep: np.ndarray  # (N,) bool: True for the one kept image of each group
    n_pairs: int  # pairs of distinct hash values within the distance

    @property
    def n_duplicates(self) -> int:
        """Rows not kept, counted a block at a time (``keep`` may be memory-mapped: no whole negated copy)."""
        return len(self.keep) - sum(int(np.count_nonzero(self.keep[s:s + BLOCK])) for s in range(0, len(self.keep), BLOCK))


def _bands(bits: list[int], n: int) -> list[np.uint64]:
    """``n`` disjoint masks splitting the bit positions ``bits`` into runs of near-equal width."""
    edges = np.linspace(0, len(bits), n + 1).astype(int)
    return [np.uint64(sum(1 << b for b in bits[lo:hi])) for lo, hi in zip(edges[:-1], edges[1:])]


def key_masks(max_distance: int, bits: int = 64) -> list[tuple[int, np.uint64, np.uint64]]:
    """``(band, band mask, key mask)`` of every key: t+1 bands, each with t+1 sub-bands of the rest."""
    t = max_distance
    out = []
    for b, band in enumerate(_bands(list(range(bits)), t + 1)):
        rest = [i for i in range(bits) if not (int(band) >> i) & 1]
        for sub in _bands(rest, t + 1):
            out.append((b, band, band | sub))
    return out


def _owned(hashes, band: np.uint64, task_index: int, num_tasks: int, block: int):
    """(rows, hashes) whose band value % num_tasks == task_index, streamed in blocks."""
    rows, vals = [], []
    shift = np.uint64((int(band) & -int(band)).bit_length() - 1)  # bands are contiguous bit runs
    for s in range(0, len(hashes), block):
        h = np.asarray(hashes[s:s + block], dtype=np.uint64)
        mine = np.flatnonzero(((h & band) >> shift) % np.uint64(num_tasks) == task_index)
        rows.append(mine + s)
        vals.append(h[mine])
    if not rows:
        return np.zeros(0, np.int64), np.zeros(0, np.uint64)
    return np.concatenate(rows).astype(np.int64), np.concatenate(vals)


def _run_bounds(keys: np.ndarray):
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    return starts, np.r_[starts[1:], len(keys)]


def _pairs_in_buckets(key: np.ndarray, h: np.ndarray, row: np.ndarray, t: int):
    """Near pairs (distance in 1..t) among distinct hashes ``h`` sorted by ``key`` (then hash)."""
    out_a, out_b = [], []
    starts, ends = _run_bounds(key)
    length = np.repeat(ends - starts, ends - starts)
    short = length <= MAX_RUN
    ks, hs, rs = key[short], h[short], row[short]
    d = 1
    while d < len(ks):
        same = ks[d:] == ks[:-d]
        if not same.any():
            break
        hit = same & (np.bitwise_count(hs[d:] ^ hs[:-d]) <= t)
        i = np.flatnonzero(hit)
        out_a.append(rs[i])
        out_b.append(rs[i + d])
        d += 1
    for s, e in zip(starts, ends):  # the rare huge buckets: all pairs, a chunk at a time
        if e - s <= MAX_RUN:
            continue
        for c in range(s, e, MAX_RUN):
            dist = np.bitwise_count(h[c:c + MAX_RUN, None] ^ h[None, s:e])
            ii, jj = np.nonzero((dist <= t) & (dist > 0))
            out_a.append(row[c + ii])
            out_b.append(row[s + jj])
    return out_a, out_b


def near_pairs_task(hashes, task_index: int = 0, num_tasks: int = 1,
                    max_distance: int = DEFAULT_MAX_DISTANCE, bits: int = 64, block: int = BLOCK):
    """This task's share of the pairs: ``(a, b)`` row arrays, ``a < b``, sorted, unique.

    Identical hashes are linked to their first row (found once, at key 0); distinct hashes within
    ``max_distance`` are linked through the first row of each value. ``hashes`` may be a memmap."""
    t = max_distance
    found_a, found_b = [], []
    cur_band, rows, vals = None, None, None
    for ki, (b, band, mask) in enumerate(key_masks(t, bits)):
        if b != cur_band:
            rows, vals = _owned(hashes, band, task_index, num_tasks, block)
            cur_band = b
        key = vals & mask
        order = np.lexsort((rows, vals, key))
        k, h, r = key[order], vals[order], rows[order]
        first = np.r_[True, (h[1:] != h[:-1]) | (k[1:] != k[:-1])]
        if ki == 0:  # identical hashes: each row to the first row of its value
            head = r[np.maximum.accumulate(np.where(first, np.arange(len(r)), 0))]
            dup = ~first
            found_a.append(head[dup])
            found_b.append(r[dup])
        if t > 0:
            a, bb = _pairs_in_buckets(k[first], h[first], r[first], t)
            found_a += a
            found_b += bb
    if not found_a:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    a, b = np.concatenate(found_a), np.concatenate(found_b)
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    pairs = np.unique(np.stack([lo, hi], 1), axis=0) if len(lo) else np.zeros((0, 2), np.int64)
    return pairs[:, 0].astype(np.int64), pairs[:, 1].astype(np.int64)


def merge_pair_parts(parts) -> tuple[np.ndarray, np.ndarray]:
    """The union of several tasks' ``(a, b)`` pair arrays, sorted and unique."""
    a = np.concatenate([np.asarray(p[0], np.int64) for p in parts] or [np.zeros(0, np.int64)])
    b = np.concatenate([np.asarray(p[1], np.int64) for p in parts] or [np.zeros(0, np.int64)])
    if not len(a):
        return a, b
    pairs = np.unique(np.stack([a, b], 1), axis=0)
    return pairs[:, 0], pairs[:, 1]


def group_pairs(n: int, a: np.ndarray, b: np.ndarray, ids=None, sparse: bool = False):
    """``(group, keep)`` from pair arrays: components, each kept image the smallest id (position when
    ``ids`` is None, i.e. rows already in canonical order). For rows in canonical order the union-find runs over
    the images with a pair only (unionfind.SparseRoots); ``sparse``: return it and its RootMask (nothing per
    row: the hash step writes them a block at a time), else whole arrays."""
    if ids is not None and not hasattr(ids, "dtype"):
        ids = np.asarray(ids)
    if ids is None or in_id_order(ids):  # positions are ranks: no mapping arrays
        group = SparseRoots.from_pairs(n, a, b)
        return (group, is_root(group)) if sparse else (np.asarray(group), np.asarray(is_root(group)))
    else:
        order, rank = id_ranks(ids)
        uf = UnionFind(n)
        uf.union(rank[a], rank[b])
        group = order[uf.roots(copy=False)[rank]]
    del uf
    return group, is_root(group)


def hash_dedup(hashes: np.ndarray, ids, max_distance: int = DEFAULT_MAX_DISTANCE,
               bits: int = 64, num_tasks: int = 1) -> HashDedupResult:
    """Group images whose hashes differ in at most ``max_distance`` bits; keep the smallest id.
    (In one process; ``num_tasks`` runs the task split in turn, for tests and small pools.)"""
    hashes = np.asarray(hashes, dtype=np.uint64)
    n = len(hashes)
    if n == 0:
        return HashDedupResult(np.zeros(0, np.int64), np.zeros(0, bool), 0)
    parts = [near_pairs_task(hashes, i, num_tasks, max_distance, bits) for i in range(num_tasks)]
    a, b = merge_pair_parts(parts)
    group, keep = group_pairs(n, a, b, ids)
    n_pairs = int(np.count_nonzero(hashes[a] != hashes[b]))
    return HashDedupResult(group, keep, n_pairs)


def brute_force_pairs(hashes: np.ndarray, max_distance: int) -> set:
    """All pairs within the distance, the quadratic way (tests; a few thousand hashes)."""
    h = np.asarray(hashes, np.uint64)
    dist = np.bitwise_count(h[:, None] ^ h[None, :])
    a, b = np.nonzero(np.triu(dist <= max_distance, 1))
    return set(zip(a.tolist(), b.tolist()))


def hamming(a: int, b: int) -> int:
    return int(a ^ b).bit_count()


__all__ = ["DEFAULT_MAX_DISTANCE", "HashDedupResult", "hash_dedup", "near_pairs_task", "group_pairs",
           "key_masks", "merge_pair_parts", "hamming", "brute_force_pairs"]
