"""Union-find and the perceptual-hash pre-dedup."""

from __future__ import annotations

import numpy as np

from curation.dedup.hashdedup import hash_dedup
from curation.core.unionfind import UnionFind, components_by_smallest_id


def _bfs_components(n, a, b):
    adj = [[] for _ in range(n)]
    for x, y in zip(a, b):
        adj[x].append(y)
        adj[y].append(x)
    label = [-1] * n
    for s in range(n):
        if label[s] >= 0:
            continue
        stack, members = [s], []
        label[s] = s
        while stack:
            u = stack.pop()
            members.append(u)
            for v in adj[u]:
                if label[v] < 0:
                    label[v] = s
                    stack.append(v)
        for m in members:
            label[m] = min(members)
    return np.array(label)


def test_union_find_matches_graph_search_and_roots_are_minimum():
    rng = np.random.default_rng(0)
    for n, m in [(50, 30), (500, 400), (2000, 2500)]:
        a, b = rng.integers(0, n, m), rng.integers(0, n, m)
        uf = UnionFind(n)
        for chunk in np.array_split(np.arange(m), 7):  # edges arrive in batches
            uf.union(a[chunk], b[chunk])
        np.testing.assert_array_equal(uf.roots(), _bfs_components(n, a, b))


def test_long_chain_collapses():
    n = 10_000
    uf = UnionFind(n)
    uf.union(np.arange(1, n), np.arange(n - 1))  # a path: worst case for naive hooking
    assert (uf.roots() == 0).all()


def test_components_are_labelled_by_smallest_id_not_position():
    ids = ["z", "b", "a", "c"]
    comp = components_by_smallest_id(4, ids, np.array([0, 1]), np.array([1, 2]))
    assert list(comp) == [2, 2, 2, 3]  # {z, b, a} -> position of 'a'


def _flip(h, bits):
    for b in bits:
        h ^= 1 << int(b)
    return h


def test_hash_dedup_groups_within_distance_and_keeps_smallest_id():
    rng = np.random.default_rng(1)
    hashes, ids, truth = [], [], []
    for g in range(200):
        base = int(rng.integers(0, 2**63)) * 2 + 1
        for c in range(3):
            flips = rng.choice(64, size=2 if c else 0, replace=False)  # <= 4 bits between copies
            hashes.append(_flip(base, flips))
            ids.append(f"img{g:04d}_{2 - c}")  # the last copy has the smallest id
            truth.append(g)
    res = hash_dedup(np.array(hashes, np.uint64), ids, max_distance=4)
    truth = np.array(truth)
    assert res.keep.sum() == 200
    for g in range(200):
        members = np.flatnonzero(truth == g)
        assert len(set(res.group[members])) == 1
        assert ids[res.group[members][0]].endswith("_0")
    # random 64-bit hashes of different groups are ~32 bits apart: never merged
    assert len(np.unique(res.group)) == 200


def test_hash_dedup_distance_zero_is_exact_only():
    h = np.array([5, 5, 4, 7, 5], np.uint64)
    res = hash_dedup(h, ["e", "d", "c", "b", "a"], max_distance=0)
    assert list(res.keep) == [False, False, True, True, True]
    res1 = hash_dedup(h, ["e", "d", "c", "b", "a"], max_distance=1)
    assert res1.keep.sum() == 1  # 4-5 and 5-7 differ by one bit: all one group (transitive)


def test_flood_of_identical_hashes_collapses_to_one_group():
    # 199,800 identical hashes (a flood of blank images) plus 200 far apart: the flood is one group kept once.
    # How fast this runs is bench/bench_curation.py's business, not a test's (no wall-clock asserts here).
    h = np.zeros(200_000, np.uint64)
    h[::1000] = np.arange(200, dtype=np.uint64) * 0x0101010101010101
    res = hash_dedup(h, [f"{i:07d}" for i in range(len(h))], max_distance=3)
    assert res.keep[0] and res.n_duplicates >= 199_000 - 200


def test_sparse_roots_are_the_union_find_of_the_pool_stored_for_the_images_with_a_pair():
    """The hash step's and the star grouping's roots (unionfind.SparseRoots): the same components as a union-find
    over every row, read by blocks, integer or boolean indices as an array is, written only where a row has a
    pair; its RootMask is ``group == arange``; the arrays it holds are per image with a pair, not per row."""
    from curation.core.unionfind import RootMask, SparseRoots, is_root

    rng = np.random.default_rng(3)
    n = 50_000
    a, b = rng.integers(0, n, 600), rng.integers(0, n, 600)
    uf = UnionFind(n)
    uf.union(a, b)
    want = uf.roots()
    got = SparseRoots.from_pairs(n, a, b)
    assert len(got.ends) <= 1200 and len(got) == n
    np.testing.assert_array_equal(np.asarray(got), want)
    for s, t in ((0, 4096), (4096, 50_000), (49_990, 60_000), (7, 7)):
        np.testing.assert_array_equal(got[s:t], want[s:t])
    idx = rng.integers(0, n, 5000)
    np.testing.assert_array_equal(got[idx], want[idx])
    mask = rng.random(n) < 0.1
    np.testing.assert_array_equal(got[mask], want[mask])
    assert got[int(a[0])] == want[a[0]]
    keep = is_root(got)
    assert isinstance(keep, RootMask) and keep.n_removed == int((want != np.arange(n)).sum())
    np.testing.assert_array_equal(np.asarray(keep), want == np.arange(n))
    np.testing.assert_array_equal(keep[100:9000], (want == np.arange(n))[100:9000])
    np.testing.assert_array_equal(got.non_roots(), np.flatnonzero(want != np.arange(n)))
    moved = got.non_roots()[:3]
    got[moved] = moved  # e.g. a hash duplicate whose pixels did not verify: kept again
    want[moved] = moved
    np.testing.assert_array_equal(np.asarray(got), want)
    lone = np.setdiff1d(np.arange(n), got.ends)[0]
    try:
        got[[lone]] = 0
    except IndexError:
        pass
    else:
        raise AssertionError("a row without a pair changed its root")
