"""What one chunk of a kNN search computes (curation.knn.shards runs the chunks as W tasks): copy-candidate
pairs rescored exactly (float64 of the stored fp16 rows), each query's nearest eval row (decontamination), the
retrieval candidates of seed rows (rebalance mode 'sample'), and the rows a query fraction searches."""

from __future__ import annotations

from typing import Iterator

import numpy as np

from curation.knn.index import KnnIndex, Rows, drop_self

BATCH_DEFAULT = 8192
MARGIN_EXACT = 1e-3  # fp16 codes: faiss's fp32 sums differ from the exact cosine by ~1e-6
MARGIN_LOSSY = 0.05  # SQ8 / PQ codes: approximate similarities, rescored exactly afterwards

# ---------------------------------------------------------------------------------- exact scores


EXACT_PIECE = 2048
"""Pairs :func:`exact_cosine` rescores at a time. Its temporaries are ~28 B per pair and dimension (two fp32
gathers, their float64 copies, the product): 2048 pairs at D = 384 are ~22 MB; the 16,384 it took before were
~176 MB, the largest allocation of every search task whatever its share of rows (docs/curation-scale.md)."""


def exact_cosine(rows_a: Rows, a: np.ndarray, rows_b: Rows, b: np.ndarray,
                 piece: int = EXACT_PIECE) -> np.ndarray:
    """float64 inner products of row pairs (a[i] of ``rows_a``, b[i] of ``rows_b``).

    Products of fp16-valued numbers are exact in float64 and each row is summed in a fixed order,
    so the value depends only on the two vectors: not on batch shape, CPU kernel, pair direction or ``piece``.
    """
    out = np.empty(len(a), np.float64)
    for s in range(0, len(a), piece):
        xa = rows_a.take(a[s:s + piece]).astype(np.float64)
        xb = rows_b.take(b[s:s + piece]).astype(np.float64)
        np.multiply(xa, xb, out=xa)  # in place: no third (piece, D) float64 array
        del xb
        out[s:s + piece] = xa.sum(axis=1)
    return out


# ---------------------------------------------------------------------------------- candidates


NN_RESCORE = 3
"""The index's nearest results per query rescored exactly for ``nn_sim`` besides the candidates: not all k (at
DINOv2's k = 64 that is 0.56 s per 4,096 queries here, 0.025 s for 3)."""


def candidate_pairs(index: KnnIndex, rows: Rows, start: int, stop: int, k: int, threshold: float,
                    batch_size: int = BATCH_DEFAULT, margin: float = MARGIN_EXACT,
                    positions: np.ndarray | None = None) -> Iterator[dict]:
    """Copy-candidate pairs of query rows [start, stop) against the index over the same ``rows``.

    Yields per batch ``{"a", "b", "sim", "nn_sim", "nn_idx"}``: directed pairs (query a, one of its k
    nearest other rows b) whose exact cosine is > ``threshold`` (row positions; sims float64), and
    each query's nearest other row (for reports): the best by exact cosine of the index's NN_RESCORE nearest and
    the candidates (ties: the smaller position), so its value does not move with the index's thread count or
    batch shape as faiss's own similarity does. Batches start at ``start``.
    ``positions``: query only these rows (ascending; e.g. a fraction of [start, stop)), in batches of
    ``batch_size`` of them.
    """
    kk = min(k + 1, index.ntotal)  # +1: the query itself comes back too
    starts = range(start, stop, batch_size) if positions is None else range(0, len(positions), batch_size)
    for s in starts:
        if positions is None:
            pos = np.arange(s, min(s + batch_size, stop), dtype=np.int64)
        else:
            pos = np.asarray(positions[s:s + batch_size], np.int64)
        sims, idx = index.search(rows.take(pos), kk)
        sims, idx = drop_self(sims, idx, pos, k)
        ok = idx >= 0
        cand = ok & (sims > threshold - margin)
        scored = cand.copy()  # rescored exactly: the candidates and the index's NN_RESCORE nearest (for nn_sim)
        scored[:, :NN_RESCORE] |= ok[:, :NN_RESCORE]
        exact = np.full(idx.shape, -np.inf)
        exact[scored] = exact_cosine(rows, np.repeat(pos, scored.sum(axis=1)), rows, idx[scored])
        if idx.shape[1] == 0:
            nn_sim, nn_idx = np.full(len(pos), -np.inf, np.float32), np.full(len(pos), -1, np.int64)
        else:
            best = np.lexsort((np.where(scored, idx, np.iinfo(np.int64).max), -exact), axis=1)[:, 0]
            rr = np.arange(len(pos))
            nn_sim = exact[rr, best].astype(np.float32)
            nn_idx = np.where(np.isfinite(nn_sim), idx[rr, best], -1)
        a = np.repeat(pos, cand.sum(axis=1))
        b = idx[cand]
        sim = exact[cand]
        keep = sim > threshold
        yield {"a": a[keep], "b": b[keep], "sim": sim[keep], "nn_sim": nn_sim, "nn_idx": nn_idx}


QUERY_SALT = 0x51E5
"""Seed of the per-row key that picks a query fraction's rows (:func:`queried`)."""


def queried(rows: Rows, start: int, stop: int, fraction: float) -> np.ndarray | None:
    """The positions in [start, stop) of ``rows`` that query the index at ``fraction`` (None: all of them).

    A row queries iff the splitmix64 key of its row in the embeddings folder (``rows.indices``, else its
    position) falls under ``fraction`` of 2^64: a function of the row alone, the same rows for any W, chunk
    or batch. ``curate simulate --query-fraction`` (the growth bench at sizes whose full search this machine
    cannot run in a session) searches such a fraction; `curate run` queries every row."""
    if fraction >= 1.0:
        return None
    pos = np.arange(start, stop, dtype=np.int64)
    return pos[is_queried(pos if rows.indices is None else rows.indices[start:stop], fraction)]


def is_queried(pool_rows: np.ndarray, fraction: float) -> np.ndarray:
    """Whether each row (of the embeddings folder) queries at this query fraction (:func:`queried`)."""
    from curation.core.rows import row_keys

    return row_keys(np.asarray(pool_rows, np.int64), QUERY_SALT) < np.uint64(min(int(fraction * 2.0 ** 64), 2 ** 64 - 1))


def concat_parts(parts: list[dict]) -> dict:
    """The batches' arrays of a chunk concatenated per name, each name's batches dropped once joined: the
    chunk held once plus its largest array, not twice."""
    out = {}
    for key in list(parts[0]) if parts else []:
        out[key] = np.concatenate([q.pop(key) for q in parts])
    return out


def fraction_pairs(index: KnnIndex, rows: Rows, start: int, stop: int, k: int, threshold: float,
                   batch_size: int, margin: float, fraction: float) -> dict:
    """One chunk of :func:`candidate_pairs`: its query rows (all, or those of a query ``fraction``), the
    pairs concatenated, ``nn_sim`` / ``nn_idx`` for every row of the chunk (-inf / -1 where a row did not
    query)."""
    pos = queried(rows, start, stop, fraction)
    parts = list(candidate_pairs(index, rows, start, stop, k, threshold, batch_size, margin, positions=pos))
    out = {"a": np.zeros(0, np.int64), "b": np.zeros(0, np.int64), "sim": np.zeros(0, np.float64)}
    out.update(concat_parts(parts))
    if pos is not None:
        nn_sim, nn_idx = np.full(stop - start, -np.inf, np.float32), np.full(stop - start, -1, np.int64)
        if parts:
            nn_sim[pos - start], nn_idx[pos - start] = out["nn_sim"], out["nn_idx"]
        out["nn_sim"], out["nn_idx"] = nn_sim, nn_idx
    return out


def nearest_exact(index: KnnIndex, queries: Rows, targets: Rows, start: int, stop: int,
                  k: int = 4, batch_size: int = BATCH_DEFAULT) -> Iterator[dict]:
    """Best target of query rows [start, stop): the index's k nearest rescored exactly (float64);
    ties go to the smallest target position. Yields ``{"sim", "idx"}`` per batch (-inf / -1 if none)."""
    for s in range(start, stop, batch_size):
        pos = np.arange(s, min(s + batch_size, stop), dtype=np.int64)
        _, idx = index.search(queries.take(pos), min(k, index.ntotal))
        ok = idx >= 0
        sim = np.full(idx.shape, -np.inf)
        sim[ok] = exact_cosine(queries, np.repeat(pos, ok.sum(axis=1)), targets, idx[ok])
        # highest exact similarity first, then the smallest target position
        order = np.lexsort((np.where(ok, idx, np.iinfo(np.int64).max), -sim), axis=1)
        best = order[:, 0] if idx.shape[1] else np.zeros(len(pos), np.int64)
        rr = np.arange(len(pos))
        best_sim = sim[rr, best] if idx.shape[1] else np.full(len(pos), -np.inf)
        best_idx = np.where(np.isfinite(best_sim), idx[rr, best] if idx.shape[1] else -1, -1)
        yield {"sim": best_sim, "idx": best_idx}


def retrieval_candidates(index: KnnIndex, queries: Rows, targets: Rows, start: int, stop: int, k: int,
                         batch_size: int = BATCH_DEFAULT) -> Iterator[dict]:
    """Retrieval (rebalance mode 'sample'): each query row (a seed) of [start, stop) with its k nearest
    indexed rows (pool positions), rescored exactly in float64. Yields ``{"seed", "pos", "sim"}``."""
    for s in range(start, stop, batch_size):
        pos = np.arange(s, min(s + batch_size, stop), dtype=np.int64)
        _, idx = index.search(queries.take(pos), min(k, index.ntotal))
        ok = idx >= 0
        seed, tgt = np.repeat(pos, ok.sum(axis=1)), idx[ok].astype(np.int64)
        yield {"seed": seed, "pos": tgt, "sim": exact_cosine(queries, seed, targets, tgt)}
