"""Star grouping without a per-image loop (dedup.star_groups) gives exactly the groups of the greedy visit
it replaced (kept here as the reference), on random pair sets of several shapes."""

import numpy as np
import pytest

from curation.dedup import copies as dedup
from curation.dedup.copies import canonical_pairs, copy_dedup_from_pairs, star_groups


def star_groups_reference(n, lo, hi):
    """The previous implementation: one Python step per image with copies, in visiting order."""
    root = np.arange(n, dtype=np.int64)
    if not len(lo):
        return root
    src, dst = np.concatenate([lo, hi]), np.concatenate([hi, lo])
    srt = np.lexsort((dst, src))
    src, dst = src[srt], dst[srt]
    starts = np.searchsorted(src, np.arange(n + 1))
    degree = np.diff(starts)
    nodes = np.flatnonzero(degree)
    nodes = nodes[np.lexsort((nodes, -degree[nodes]))]
    claimed = np.zeros(n, bool)
    for r in nodes:
        if claimed[r]:
            continue
        claimed[r] = True
        nb = dst[starts[r]:starts[r + 1]]
        nb = nb[~claimed[nb]]
        claimed[nb] = True
        root[nb] = r
    return root


def _pairs(rng, n, kind):
    if kind == "sparse":
        m = n // 2
        a, b = rng.integers(0, n, m), rng.integers(0, n, m)
    elif kind == "dense":
        m = n * 4
        a, b = rng.integers(0, n // 10, m), rng.integers(0, n // 10, m)
    elif kind == "cliques":  # groups of copies: every pair of a group
        g = rng.integers(0, n // 5, n)
        o = np.argsort(g, kind="stable")
        a, b = [], []
        for grp in np.split(o, np.flatnonzero(np.diff(g[o])) + 1):
            i, j = np.triu_indices(len(grp), 1)
            a.append(grp[i])
            b.append(grp[j])
        a, b = np.concatenate(a), np.concatenate(b)
        keep = rng.random(len(a)) < 0.7  # some pairs not verified
        a, b = a[keep], b[keep]
    else:  # chains: long paths (many rounds) plus random chords
        perm = rng.permutation(n)
        a, b = perm[:-1], perm[1:]
        cut = rng.random(n - 1) < 0.01
        a, b = a[~cut], b[~cut]
        extra = rng.integers(0, n, (n // 20, 2))
        a, b = np.concatenate([a, extra[:, 0]]), np.concatenate([b, extra[:, 1]])
    return a.astype(np.int64), b.astype(np.int64)


@pytest.mark.parametrize("kind", ["sparse", "dense", "cliques", "chains"])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("rounds", [64, 2])  # 2: most graphs finish in the one-by-one tail
def test_star_groups_match_reference(kind, seed, rounds, monkeypatch):
    monkeypatch.setattr(dedup, "ROUNDS_MAX", rounds)
    rng = np.random.default_rng(seed)
    n = int(rng.integers(50, 3000))
    a, b = _pairs(rng, n, kind)
    rank = np.arange(n)
    lo, hi, _ = canonical_pairs(rank, a, b, np.ones(len(a), np.float32), 0.5)
    np.testing.assert_array_equal(star_groups(n, lo, hi), star_groups_reference(n, lo, hi))


def test_star_groups_chain_fallback(monkeypatch):
    """A path visited end to end decides one image per round: the rounds stop at ROUNDS_MAX and the greedy
    visit finishes the rest, with the same groups."""
    n = 500
    lo, hi = np.arange(n - 1), np.arange(1, n)
    for rounds in (1, 3, 64):
        monkeypatch.setattr(dedup, "ROUNDS_MAX", rounds)
        np.testing.assert_array_equal(star_groups(n, lo, hi), star_groups_reference(n, lo, hi))


def test_copy_dedup_from_pairs_same_groups_as_reference(monkeypatch):
    """The whole grouping (ids decide the order, pairs in any order and direction) is unchanged."""
    rng = np.random.default_rng(7)
    n = 2000
    ids = rng.permutation(10 * n)[:n]
    a, b = _pairs(rng, n, "cliques")
    sim = rng.uniform(0.3, 1.0, len(a)).astype(np.float32)
    new = copy_dedup_from_pairs(n, ids, a, b, sim, threshold=0.45)
    monkeypatch.setattr(dedup, "star_groups", star_groups_reference)
    old = copy_dedup_from_pairs(n, ids, a, b, sim, threshold=0.45)
    np.testing.assert_array_equal(new.component, old.component)
    np.testing.assert_array_equal(new.keep, old.keep)
    assert new.n_duplicates == old.n_duplicates > 0
