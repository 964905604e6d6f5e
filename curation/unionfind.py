"""Vectorised union-find (numpy) whose component roots are the smallest member.

Invariant: ``parent[x] <= x``. A union hooks the larger root under the smaller one, so a
component's root is always its smallest element. Callers number elements by rank (e.g. position
in sorted-id order), which makes "keep the root" mean "keep the smallest id" — a deterministic
choice that does not depend on edge order, batch size or how the pool was split.
Edges are processed a batch at a time with whole-array pointer jumping (path compression),
so millions of kNN edges cost a few numpy passes instead of a Python loop per edge.
"""

from __future__ import annotations

import numpy as np


class UnionFind:
    def __init__(self, n: int):
        self.parent = np.arange(n, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.parent)

    def find(self, x: np.ndarray) -> np.ndarray:
        """Roots of ``x``; compresses the paths it walked."""
        x = np.asarray(x, dtype=np.int64)
        r = self.parent[x]
        while True:
            rr = self.parent[r]
            if np.array_equal(rr, r):
                break
            r = rr
        self.parent[x] = r  # path compression for the queried elements
        return r

    def union(self, a: np.ndarray, b: np.ndarray) -> None:
        """Merge the components of every pair (a[i], b[i])."""
        a = np.asarray(a, dtype=np.int64).ravel()
        b = np.asarray(b, dtype=np.int64).ravel()
        while len(a):
            ra, rb = self.find(a), self.find(b)
            diff = ra != rb
            if not diff.any():
                return
            a, b, ra, rb = a[diff], b[diff], ra[diff], rb[diff]
            lo, hi = np.minimum(ra, rb), np.maximum(ra, rb)
            # Several edges may hook the same root: minimum.at keeps the smallest target,
            # preserving parent[x] <= x; the loop re-checks edges whose hook lost the race.
            np.minimum.at(self.parent, hi, lo)

    def compress(self, block: int = 1 << 16) -> None:
        """Every element points at its root: pointer jumping ``p = p[p]`` in place, a block at a time (no
        whole-length copy per pass; reading a value already updated in this pass only jumps further up)."""
        p = self.parent
        changed = True
        while changed:
            changed = False
            for s in range(0, len(p), block):
                new = p[p[s:s + block]]
                if not changed and not np.array_equal(new, p[s:s + block]):
                    changed = True
                p[s:s + block] = new

    def roots(self, copy: bool = True) -> np.ndarray:
        """Root (smallest member) of every element (``copy=False``: the parent array itself, for a caller done
        with the structure)."""
        self.compress()
        return self.parent.copy() if copy else self.parent


def id_ranks(ids) -> tuple[np.ndarray, np.ndarray]:
    """``(order, rank)``: ``order[r]`` is the position of the r-th smallest id, ``rank`` its inverse.
    Integer ids (input ids: ranks of the string ids) sort as numbers, string ids as strings. ``ids`` may be a
    lazy sliceable with a dtype (:class:`curation.dist_kmeans.Gathered`): read a block at a time, and gathered
    whole only when they are not already in order."""
    if not hasattr(ids, "dtype"):
        ids = np.asarray(ids)
    if in_id_order(ids):
        # the usual case (rows in canonical order: input ids increase): the stable argsort is the identity, one
        # array serves as both (callers only index with them), no sort and no second int64 per row
        ident = np.arange(len(ids), dtype=np.intp)
        return ident, ident
    ids = np.asarray(ids)
    order = np.argsort(ids if ids.dtype.kind in "iu" else ids.astype(str), kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return order, rank


def in_id_order(ids) -> bool:
    """Rows in canonical order: integer ids that never decrease (positions are then ranks, and a grouping needs no
    mapping arrays). ``ids``: an array or a lazy sliceable with a dtype, read a block at a time."""
    return ids.dtype.kind in "iu" and _non_decreasing(ids)


IS_ROOT_BLOCK = 1 << 20


def is_root(group: np.ndarray) -> np.ndarray:
    """``group == arange(len(group))`` (the kept image of each group: its own root), a block at a time: no int64
    per row beside ``group``."""
    keep = np.empty(len(group), bool)
    for s in range(0, len(group), IS_ROOT_BLOCK):
        keep[s:s + IS_ROOT_BLOCK] = group[s:s + IS_ROOT_BLOCK] == np.arange(s, min(s + IS_ROOT_BLOCK, len(group)))
    return keep


def _non_decreasing(a: np.ndarray, block: int = 1 << 16) -> bool:
    """Whether ``a[i] <= a[i + 1]`` everywhere, checked a block at a time (no whole-length temporary)."""
    for s in range(0, len(a) - 1, block):
        e = min(s + block, len(a) - 1)
        if not np.all(a[s + 1:e + 1] >= a[s:e]):
            return False
    return True


def components_by_smallest_id(n: int, ids, edges_a: np.ndarray, edges_b: np.ndarray
                              ) -> np.ndarray:
    """Component label of every position = position of the member with the smallest id."""
    order, rank = id_ranks(ids)
    uf = UnionFind(n)
    uf.union(rank[edges_a], rank[edges_b])
    return order[uf.roots()[rank]]
