"""Copy deduplication: kNN candidates, pixel verification, groups without chaining.

DINOv2 (Oquab et al. 2023, App. A.2; Pizzi et al. 2022) links every image to its k nearest
neighbours with cosine above a threshold and keeps one image per connected component. On
homogeneous data (retina scans, micrograph tiles) the descriptor scores distinct images of one
scene above the threshold, and components chain A~B~C~... until unrelated images share a group.
Here the kNN only proposes *candidate* pairs (recall); each candidate is verified on pixels
(:mod:`curation.verify.pixels`) before it becomes an edge (precision); and groups are stars, not
components: images are visited by how many verified copies they have (ties: smaller id first),
an image not yet claimed keeps itself and claims its unclaimed verified copies. So an image is
removed only if it was verified as a copy of the image its group keeps. Both steps depend only on the *set* of
candidate pairs, so a sharded kNN that
yields the same pairs gives the same decisions (:func:`copy_dedup_from_pairs`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from curation.knn.index import Rows, build_index, iter_knn
from curation.core.runner import phase
from curation.core.unionfind import SparseRoots, components_by_smallest_id, id_ranks, in_id_order, is_root

GROUPINGS = ("star", "components")
# kNN cosine above which a pair is a candidate. DINOv2's 0.6 when the descriptor decides alone;
# with pixel verification the descriptor only proposes, and 0.45 reaches the planted copies 0.6
# misses (measured down to 0.46 on micrograph tiles, bench/bench_copy.py).
DINOV2_THRESHOLD = 0.6
VERIFIED_THRESHOLD = 0.45


def resolve_threshold(threshold: float | None, verify: bool) -> float:
    """``dedup.threshold``; null picks the default for the mode (see above)."""
    if threshold is not None:
        return float(threshold)
    return VERIFIED_THRESHOLD if verify else DINOV2_THRESHOLD


@dataclass
class DedupResult:
    component: np.ndarray  # (N,) position of the group's kept image
    keep: np.ndarray  # (N,) bool
    nn_sim: np.ndarray  # (N,) cosine to the nearest other image (-inf when alone)
    nn_index: np.ndarray  # (N,) position of that neighbour (-1 when alone)
    n_edges: int  # copy edges: verified candidate pairs (all candidates without a verifier)
    index_kind: str
    n_candidates: int = 0  # distinct candidate pairs above the threshold
    verify_seconds: float = 0.0  # time spent verifying candidates (reading pixels included)

    @property
    def n_duplicates(self) -> int:
        removed = getattr(self.keep, "n_removed", None)  # unionfind.RootMask: counted over the copied images
        return int(removed) if removed is not None else int((~np.asarray(self.keep)).sum())

    def component_sizes(self) -> np.ndarray:
        """Sizes of all groups (singletons included)."""
        return np.bincount(np.unique(np.asarray(self.component), return_inverse=True)[1].ravel())


def candidate_pairs(rows: Rows, k: int, threshold: float, index_kind: str = "auto",
                    nprobe: int = 16, batch_size: int = 8192, use_gpu: bool | str = "auto",
                    flat_max: int | None = None, progress: bool = False):
    """kNN of every row: ``(a, b, sim, nn_sim, nn_index, index_kind)`` with the pairs whose
    cosine is above ``threshold`` (each direction as found; canonicalised later)."""
    n = len(rows)
    nn_sim = np.full(n, -np.inf, np.float32)
    nn_index = np.full(n, -1, np.int64)
    if n < 2:
        z = np.zeros(0, np.int64)
        return z, z, np.zeros(0, np.float32), nn_sim, nn_index, "none"
    k = max(1, min(k, n - 1))
    kw = {} if flat_max is None else {"flat_max": flat_max}
    index = build_index(rows, kind=index_kind, nprobe=nprobe, use_gpu=use_gpu, **kw)
    aa, bb, ss = [], [], []
    bar = _bar(n, "copy-dedup kNN", progress)
    for pos, sims, idx in iter_knn(index, rows, k, batch_size, exclude_self=True):
        nn_sim[pos] = sims[:, 0]
        nn_index[pos] = idx[:, 0]
        hit = (sims > threshold) & (idx >= 0)
        aa.append(np.repeat(pos, hit.sum(axis=1)))
        bb.append(idx[hit])
        ss.append(sims[hit])
        bar.update(len(pos))
    bar.close()
    return (np.concatenate(aa).astype(np.int64), np.concatenate(bb).astype(np.int64),
            np.concatenate(ss).astype(np.float32), nn_sim, nn_index, index.kind)


def copy_dedup(embeddings, ids, k: int = 64, threshold: float = 0.6, index_kind: str = "auto",
               nprobe: int = 16, batch_size: int = 8192, use_gpu: bool | str = "auto",
               flat_max: int | None = None, progress: bool = False,
               verifier: Callable | None = None, grouping: str = "star") -> DedupResult:
    """kNN candidates with cosine > ``threshold``, verified by ``verifier``, grouped.

    ``embeddings``: (N, D) L2-normalised rows (array, fp16 memmap, EmbeddingSet or Rows view);
    ``ids``: the N ids, which decide the kept image of each group. ``k`` is capped at N-1.
    ``verifier(a, b) -> bool (P,)`` over row positions (e.g. :class:`curation.verify.pixels.PixelVerifier`);
    None trusts the descriptor (every candidate is an edge).
    """
    rows = embeddings if isinstance(embeddings, Rows) else Rows(embeddings)
    n = len(rows)
    if len(ids) != n:
        raise ValueError(f"copy_dedup got {n} embeddings but {len(ids)} ids")
    a, b, sim, nn_sim, nn_index, kind = candidate_pairs(
        rows, k, threshold, index_kind, nprobe, batch_size, use_gpu, flat_max, progress)
    res = copy_dedup_from_pairs(n, ids, a, b, sim, threshold=threshold, verifier=verifier,
                                grouping=grouping)
    res.component, res.keep = np.asarray(res.component), np.asarray(res.keep)  # in memory: whole arrays
    res.nn_sim, res.nn_index, res.index_kind = nn_sim, nn_index, kind
    return res


def copy_dedup_from_pairs(n: int, ids, a, b, sim, *, threshold: float,
                          verifier: Callable | None = None, grouping: str = "star",
                          progress: bool = False) -> DedupResult:
    """Verification and grouping of candidate pairs ``(a[i], b[i])`` with cosine ``sim[i]``.

    Pairs may come in any order, from either side, repeated (a kNN finds most pairs twice, a
    sharded kNN in shard order): each unordered pair counts once, with its largest cosine, and is
    verified smaller-id first. The result depends only on the set of pairs above ``threshold``.
    ``grouping``: 'star' (no chaining; see the module docstring) or 'components' (DINOv2's
    connected components, kept for comparison). ``nn_sim``/``nn_index`` are left empty (the
    kNN fills them in :func:`copy_dedup`).
    """
    return _verify_and_group(n, ids, verifier, grouping, lambda rank: canonical_pairs(rank, a, b, sim, threshold, n=n))


def copy_dedup_from_keys(n: int, ids, keys: Callable[[], np.ndarray], *, verifier: Callable | None = None,
                         grouping: str = "star") -> DedupResult:
    """:func:`copy_dedup_from_pairs` of pairs given as sorted unique keys ``lo * n + hi`` of positions, already
    above the threshold (``keys()``, e.g. knn_shards.pair_keys: 8 B per pair, read a chunk at a time): the same
    decisions. A callable, so that the keys are dropped once split into (lo, hi), not held by the caller."""
    def canonical(rank):
        k = keys()
        lo, hi = np.divmod(k, n)
        del k
        if rank is None:  # positions are ranks: the keys are already the canonical pairs, in their order
            return lo, hi, None
        return canonical_pairs(rank, lo, hi, np.ones(len(lo), np.float32), -np.inf)[:2] + (None,)
    return _verify_and_group(n, ids, verifier, grouping, canonical)


def copy_dedup_from_edges(n: int, ids, lo: np.ndarray, hi: np.ndarray, *, n_candidates: int,
                          verifier: Callable | None = None, grouping: str = "star",
                          verify_seconds: float = 0.0) -> DedupResult:
    """:func:`copy_dedup_from_keys` when the candidates were verified elsewhere (curation.verify.tasks: W tasks
    reading the chunk files): ``lo``/``hi`` the verified edges in rank space sorted by (lo, hi), ``n_candidates``
    the candidates they came from. ``verifier``: the lone images' second look only. The same decisions; the ids
    must be in canonical order (positions are ranks)."""
    def canonical(rank):
        if rank is not None:
            raise ValueError("copy_dedup_from_edges needs the rows in canonical id order")
        return lo, hi, None
    res = _verify_and_group(n, ids, verifier, grouping, canonical, verified=True)
    res.n_candidates, res.verify_seconds = int(n_candidates), res.verify_seconds + verify_seconds
    return res


def _verify_and_group(n: int, ids, verifier, grouping: str, canonical, verified: bool = False) -> DedupResult:
    """The body of :func:`copy_dedup_from_pairs`; ``canonical(rank)``: the canonical pairs (lo, hi, _) in rank
    space (``verified``: already verified edges: only the lone images' pass calls ``verifier``)."""
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping {grouping!r}: choose one of {GROUPINGS}")
    if not hasattr(ids, "dtype"):  # a lazy sliceable (curation.dedup.knn: the survivors' ids, read a block at a time) stays
        ids = np.asarray(ids)
    if len(ids) != n:
        raise ValueError(f"copy_dedup_from_pairs got n={n} but {len(ids)} ids")
    # rows in canonical order (input ids increase: the usual case): positions are ranks, no array per row for the
    # mapping; otherwise id_ranks' permutation and its inverse
    order, rank = (None, None) if in_id_order(ids) else id_ranks(ids)

    def pos(r):  # ranks -> positions
        return r if order is None else order[r]

    lo, hi, _ = canonical(rank)
    n_candidates = len(lo)
    t0 = time.perf_counter()
    if verifier is not None and len(lo) and not verified:
        ok = np.asarray(verifier(pos(lo), pos(hi)), bool)  # positions, smaller id first
        lo, hi = lo[ok], hi[ok]
    seconds = time.perf_counter() - t0 if verifier is not None else 0.0
    if grouping == "components":
        with phase("grouping"):
            component = components_by_smallest_id(n, np.asarray(ids), pos(lo), pos(hi))
    else:
        with phase("grouping"):
            root = star_groups(n, lo, hi)
        if verifier is not None and len(lo):
            t1 = time.perf_counter()
            root = attach_singletons(root, lo, hi, lambda x, y: verifier(pos(x), pos(y)))
            seconds += time.perf_counter() - t1
        component = root if order is None else order[root[rank]]
    keep = is_root(component)
    # read-only placeholders (no memory): the kNN's arrays replace them (copy_dedup, curation.dedup.knn.sharded_copy_dedup)
    empty_sim, empty_idx = np.broadcast_to(np.float32(-np.inf), (n,)), np.broadcast_to(np.int64(-1), (n,))
    return DedupResult(component, keep, empty_sim, empty_idx, len(lo), "none", n_candidates,
                       seconds)


def canonical_pairs(rank: np.ndarray | None, a, b, sim, threshold: float, n: int | None = None):
    """Unique unordered pairs above ``threshold`` in rank space: (lo, hi, max cosine), sorted. ``rank`` None:
    positions are ranks (rows in canonical order; then ``n``, the number of rows)."""
    a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
    sim = np.asarray(sim, np.float32)
    hit = (sim > threshold) & (a != b) & (a >= 0) & (b >= 0)
    ra, rb, s = (a[hit], b[hit], sim[hit]) if rank is None else (rank[a[hit]], rank[b[hit]], sim[hit])
    n = len(rank) if rank is not None else int(n)
    lo, hi = np.minimum(ra, rb), np.maximum(ra, rb)
    key = lo * n + hi
    srt = np.lexsort((-s, key))  # by pair, largest cosine first
    key, s = key[srt], s[srt]
    first = np.ones(len(key), bool)
    first[1:] = key[1:] != key[:-1]
    key, s = key[first], s[first]
    return key // n, key % n, s


ROUNDS_MAX = 64
"""Vectorised rounds of :func:`star_groups` before the few images still undecided (long chains of copies
whose order forces one decision per round) are finished one by one."""


def star_groups(n: int, lo: np.ndarray, hi: np.ndarray) -> SparseRoots:
    """Group root (in rank space) of every rank: star clustering of the verified-copy graph (a
    :class:`curation.core.unionfind.SparseRoots`: stored for the images with a verified copy only).

    Images with copies are visited by decreasing number of verified copies (ties: smaller id
    first); an unclaimed one keeps itself and claims its unclaimed neighbours; claimed images
    claim nothing. So a group is a star around its kept image (no chains), and the image most
    others are copies of is kept, which gathers a copy, its original and the original's other
    copies in one group. Depends only on the set of edges.

    Computed without a loop over images: the kept images are the greedy maximal independent set in that
    visiting order (an image is kept iff none of its neighbours visited before it is kept), found in rounds
    over the sorted edge arrays -- each round keeps every undecided image whose earlier neighbours are all
    decided (none of them kept), then removes the undecided neighbours of the new kept images; the first
    undecided image in the order is always decided, and on copy graphs a handful of rounds decide all.
    After :data:`ROUNDS_MAX` rounds the rest (a chain) is finished in order, as the greedy visit would. A
    removed image's root is its kept neighbour visited first (the one that claimed it).
    """
    if not len(lo):
        return SparseRoots(n, np.zeros(0, np.int64))
    # only images with a verified copy take part: every array below is per such image (m of them, in rank
    # order), not per row of the pool, and so is the result (unionfind.SparseRoots: identity elsewhere)
    ends = np.unique(np.concatenate([lo, hi]).astype(np.int64))
    root = SparseRoots(n, ends)
    m = len(ends)
    # indices into the m images with a copy: int32 where they fit (half of the per-edge arrays below)
    ix = np.int32 if m < 2**31 else np.int64
    lo_c, hi_c = np.searchsorted(ends, lo).astype(ix), np.searchsorted(ends, hi).astype(ix)
    src, dst = np.concatenate([lo_c, hi_c]), np.concatenate([hi_c, lo_c])
    del lo_c, hi_c
    degree = np.bincount(src, minlength=m)
    nodes = np.lexsort((np.arange(m), -degree)).astype(ix)  # the visiting order (ties: smaller rank = smaller id)
    del degree
    prio = np.empty(m, ix)
    prio[nodes] = np.arange(m, dtype=ix)
    state = np.zeros(m, np.int8)  # 0 undecided, 1 kept, 2 claimed
    es, ed = src, dst  # edges whose two ends are undecided
    for _ in range(ROUNDS_MAX):
        blocked = np.zeros(m, bool)
        blocked[es[prio[ed] < prio[es]]] = True  # an earlier neighbour still undecided
        new = nodes[(state[nodes] == 0) & ~blocked[nodes]]
        state[new] = 1
        hit = state[es] == 1
        state[ed[hit & (state[ed] == 0)]] = 2
        live = (state[es] == 0) & (state[ed] == 0)
        es, ed = es[live], ed[live]
        if not (state[nodes] == 0).any():
            break
    rest = nodes[state[nodes] == 0]
    if len(rest):  # a long chain: the greedy visit over what is left (the decided part is already exact)
        srt = np.lexsort((ed, es))
        es, ed = es[srt], ed[srt]
        starts = np.searchsorted(es, np.arange(m + 1))
        for r in rest:
            if state[r]:
                continue
            state[r] = 1
            nb = ed[starts[r]:starts[r + 1]]
            state[nb[state[nb] == 0]] = 2
    # every claimed image: its kept neighbour visited first
    keep_edge = (state[src] == 2) & (state[dst] == 1)
    c, k = src[keep_edge], dst[keep_edge]
    srt = np.lexsort((prio[k], c))
    c, k = c[srt], k[srt]
    first = np.ones(len(c), bool)
    first[1:] = c[1:] != c[:-1]
    root.roots[c[first]] = ends[k[first]]
    return root


def attach_singletons(root: np.ndarray, lo: np.ndarray, hi: np.ndarray, verify) -> np.ndarray:
    """Second look at images left alone. A lone image C has verified copies, all of them removed
    into other groups (a copy O of C went to K's group because K had more copies). Then C joins
    K if ``verify`` confirms C against K itself (each C: the smallest such K); otherwise O
    leaves K's group and keeps C as its copy (the smallest such O). Either way as many images
    are removed as before, each still verified against the image its group keeps, and C ends
    in one group with its original. Ranks; pairs go to ``verify`` smaller first. ``root`` is updated in place
    (and returned).
    """
    n = len(root)
    if not len(lo):
        return root
    # group sizes of the images with an edge only (every member of a group of two or more has one; an image
    # without an edge is its own group of one): no count per row of the pool
    ends = np.union1d(np.unique(lo), np.unique(hi))
    roots_e, sizes_e = np.unique(root[ends], return_counts=True)
    del ends
    # each direction of the edges in turn, narrowed one condition at a time: a few bytes per edge at a time,
    # not a dozen int64 temporaries per directed edge (the result is a set: the order of (o, c) does not matter)
    parts = [_lone(root, s, d, roots_e, sizes_e) for s, d in ((lo, hi), (hi, lo))]
    o, c = (np.concatenate(x) for x in zip(*parts))  # C alone, O removed (every verified neighbour of a lone C is)
    del parts
    if not len(o):
        return root
    key = np.unique(root[o] * n + c)  # distinct (keeper of O, lone image) pairs
    k, kc = key // n, key % n
    ok = np.asarray(verify(np.minimum(k, kc), np.maximum(k, kc)), bool)
    k, kc = k[ok], kc[ok]
    srt = np.lexsort((k, kc))
    k, kc = k[srt], kc[srt]
    first = np.ones(len(kc), bool)
    first[1:] = kc[1:] != kc[:-1]
    root[kc[first]] = k[first]
    rest = ~np.isin(c, kc)  # still alone: their smallest verified copy O keeps them instead
    o, c = o[rest], c[rest]
    srt = np.lexsort((o, c))
    o, c = o[srt], c[srt]
    first = np.ones(len(c), bool)
    first[1:] = c[1:] != c[:-1]
    o, c = o[first], c[first]
    root[o] = o
    root[c] = o
    return root


def _lone(root, s: np.ndarray, d: np.ndarray, roots_e: np.ndarray, sizes_e: np.ndarray):
    """The edges s -> d of :func:`attach_singletons` whose s was removed into a group and whose d is alone."""
    sel = np.flatnonzero(np.asarray(root[s]) != s)
    s, d = s[sel], d[sel]
    sel = np.flatnonzero(np.asarray(root[d]) == d)
    s, d = s[sel], d[sel]
    at = np.minimum(np.searchsorted(roots_e, d), len(roots_e) - 1)
    sel = (roots_e[at] == d) & (sizes_e[at] == 1)
    return s[sel], d[sel]


def _bar(total: int, desc: str, enabled: bool):
    from dinopipe.utils.progress import progress as reporter

    return reporter(total=total, desc=desc, unit="img", disable=not enabled)
