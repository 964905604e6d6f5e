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


class SparseRoots:
    """The root of every element of [0, n) where only ``ends`` -- the sorted elements that have an edge -- may
    differ from themselves: memory per element with an edge, none per element of the pool (a copy / hash
    grouping of 10^9 rows with 2% copies holds 2 x 10^7 pairs of int64, not 10^9). Read by slices (a block) or
    integer arrays as a numpy array would be; written only at elements with an edge; ``np.asarray`` makes the
    whole array (tests, small pools)."""

    dtype = np.dtype(np.int64)

    def __init__(self, n: int, ends: np.ndarray, roots: np.ndarray | None = None):
        self.n = int(n)
        self.ends = np.asarray(ends, np.int64)
        self.roots = self.ends.copy() if roots is None else np.array(roots, np.int64)

    @classmethod
    def from_pairs(cls, n: int, a: np.ndarray, b: np.ndarray) -> "SparseRoots":
        """Connected components of the pairs, each rooted at its smallest element: a :class:`UnionFind` over
        the elements with an edge only (the smallest member of a component with an edge has one)."""
        ends = np.unique(np.concatenate([np.asarray(a, np.int64).ravel(), np.asarray(b, np.int64).ravel()]))
        uf = UnionFind(len(ends))
        uf.union(np.searchsorted(ends, a), np.searchsorted(ends, b))
        return cls(n, ends, ends[uf.roots(copy=False)])

    def __len__(self) -> int:
        return self.n

    @property
    def shape(self) -> tuple[int]:
        return (self.n,)

    def _find(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        i = np.minimum(np.searchsorted(self.ends, x), max(len(self.ends) - 1, 0))
        return i, (self.ends[i] == x) if len(self.ends) else np.zeros(np.shape(x), bool)

    def __getitem__(self, key):
        if isinstance(key, slice):
            s, t, step = key.indices(self.n)
            if step != 1:
                raise IndexError("SparseRoots: slices with a step are not supported")
            out = np.arange(s, max(s, t), dtype=np.int64)
            i, j = np.searchsorted(self.ends, [s, max(s, t)])
            out[self.ends[i:j] - s] = self.roots[i:j]
            return out
        x = np.asarray(key)
        x = np.flatnonzero(x) if x.dtype == bool else x.astype(np.int64)
        out = x.copy()
        i, hit = self._find(x)
        out[hit] = self.roots[i[hit]]
        return out if out.ndim else int(out)

    def __setitem__(self, key, value) -> None:
        x = np.asarray(key, np.int64).ravel()
        i, hit = self._find(x)
        if not hit.all():
            raise IndexError("SparseRoots: only an element with an edge can change its root")
        self.roots[i] = np.broadcast_to(np.asarray(value, np.int64).ravel(), x.shape)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.arange(self.n, dtype=np.int64)
        out[self.ends] = self.roots
        return out if dtype is None else out.astype(dtype)

    def non_roots(self) -> np.ndarray:
        """The elements whose root is another one (sorted)."""
        return self.ends[self.roots != self.ends]


class RootMask:
    """``is_root`` of a :class:`SparseRoots`, computed per slice (no bool per element held)."""

    dtype = np.dtype(bool)

    def __init__(self, roots: SparseRoots):
        self.of = roots

    def __len__(self) -> int:
        return len(self.of)

    @property
    def shape(self) -> tuple[int]:
        return (len(self.of),)

    @property
    def n_removed(self) -> int:
        return int(np.count_nonzero(self.of.roots != self.of.ends))

    def __getitem__(self, key):
        if isinstance(key, slice):
            s, t, _ = key.indices(len(self.of))
            return self.of[key] == np.arange(s, max(s, t))
        x = np.asarray(key)
        x = np.flatnonzero(x) if x.dtype == bool else x.astype(np.int64)
        return self.of[x] == x

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        keep = np.ones(len(self.of), bool)
        keep[self.of.non_roots()] = False
        return keep if dtype is None else keep.astype(dtype)


def id_ranks(ids) -> tuple[np.ndarray, np.ndarray]:
    """``(order, rank)``: ``order[r]`` is the position of the r-th smallest id, ``rank`` its inverse.
    Integer ids (input ids: ranks of the string ids) sort as numbers, string ids as strings. ``ids`` may be a
    lazy sliceable with a dtype (:class:`curation.kmeans.dist.Gathered`): read a block at a time, and gathered
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


def is_root(group: np.ndarray):
    """``group == arange(len(group))`` (the kept image of each group: its own root), a block at a time: no int64
    per row beside ``group``; of a :class:`SparseRoots`, a :class:`RootMask` (nothing per row)."""
    if isinstance(group, SparseRoots):
        return RootMask(group)
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
