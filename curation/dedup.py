"""Copy deduplication on embeddings (DINOv2, Oquab et al. 2023, App. A.2; Pizzi et al. 2022).

Every image is linked to its k nearest neighbours with cosine similarity above a threshold;
connected components of this graph are groups of copies, and one image per group is kept — the
one with the smallest id, so reruns and differently split runs keep the same images.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .index import Rows, build_index, iter_knn
from .unionfind import UnionFind, id_ranks


@dataclass
class DedupResult:
    component: np.ndarray  # (N,) position of the component's kept image (smallest id)
    keep: np.ndarray  # (N,) bool
    nn_sim: np.ndarray  # (N,) cosine to the nearest other image (-inf when alone)
    nn_index: np.ndarray  # (N,) position of that neighbour (-1 when alone)
    n_edges: int  # kNN edges above the threshold (each direction counted once per query)
    index_kind: str

    @property
    def n_duplicates(self) -> int:
        return int((~self.keep).sum())

    def component_sizes(self) -> np.ndarray:
        """Sizes of all components (singletons included)."""
        return np.bincount(np.unique(self.component, return_inverse=True)[1].ravel())


def copy_dedup(embeddings, ids, k: int = 64, threshold: float = 0.6, index_kind: str = "auto",
               nprobe: int = 16, batch_size: int = 8192, use_gpu: bool | str = "auto",
               flat_max: int | None = None, progress: bool = False) -> DedupResult:
    """Connected components of the kNN graph with edges where cosine > ``threshold``.

    ``embeddings``: (N, D) L2-normalised rows (array, fp16 memmap, EmbeddingSet or Rows view);
    ``ids``: the N ids, which decide the kept image of each component. ``k`` is capped at N-1.
    """
    rows = embeddings if isinstance(embeddings, Rows) else Rows(embeddings)
    n = len(rows)
    if len(ids) != n:
        raise ValueError(f"copy_dedup got {n} embeddings but {len(ids)} ids")
    nn_sim = np.full(n, -np.inf, np.float32)
    nn_index = np.full(n, -1, np.int64)
    if n < 2:
        comp = np.arange(n, dtype=np.int64)
        return DedupResult(comp, np.ones(n, bool), nn_sim, nn_index, 0, "none")
    k = max(1, min(k, n - 1))
    kw = {} if flat_max is None else {"flat_max": flat_max}
    index = build_index(rows, kind=index_kind, nprobe=nprobe, use_gpu=use_gpu, **kw)
    order, rank = id_ranks(ids)
    uf = UnionFind(n)  # rank space: roots are the smallest ids
    n_edges = 0
    bar = _bar(n, "copy-dedup kNN", progress)
    for pos, sims, idx in iter_knn(index, rows, k, batch_size, exclude_self=True):
        nn_sim[pos] = sims[:, 0]
        nn_index[pos] = idx[:, 0]
        hit = (sims > threshold) & (idx >= 0)
        a = np.repeat(pos, hit.sum(axis=1))
        b = idx[hit]
        n_edges += len(a)
        if len(a):
            uf.union(rank[a], rank[b])
        bar.update(len(pos))
    bar.close()
    component = order[uf.roots()[rank]]
    keep = component == np.arange(n)
    return DedupResult(component, keep, nn_sim, nn_index, n_edges, index.kind)


def _bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="img", disable=not enabled, mininterval=2.0)
