"""Remove evaluation-set images (and all their copies) from the pool (DINOv2 App. A.2).

Each pool image is compared with its nearest evaluation image; if the cosine exceeds the
threshold, the image's whole copy component goes, so a kept representative cannot smuggle back
a picture whose copy matched the test set. ``curate decontaminate`` runs the same rule on the
sharded kNN (curation.decontaminate.nearest: eval index saved once, pool rows searched in array chunks, the
best candidates rescored exactly); :func:`decontaminate` is the in-memory form.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dinopipe.config import InputError
from curation.knn.index import Rows, build_index, iter_knn


@dataclass
class DecontaminationResult:
    removed: np.ndarray  # (N,) bool: in a component with at least one match
    direct: np.ndarray  # (N,) bool: matched an eval image itself
    max_sim: np.ndarray  # (N,) cosine to the nearest eval image
    nearest_eval: np.ndarray  # (N,) position of that eval image

    @property
    def n_removed(self) -> int:
        return int(self.removed.sum())


def decontaminate(pool, eval_embeddings, threshold: float = 0.45,
                  components: np.ndarray | None = None, batch_size: int = 8192,
                  index_kind: str = "auto", nprobe: int = 64,
                  use_gpu: bool | str = "auto") -> DecontaminationResult:
    """Flag pool images with cosine > ``threshold`` to any eval image, expanded to components.

    ``pool`` and ``eval_embeddings`` must come from the same embedder (same descriptor fit).
    ``components``: per pool image, its copy-component label (e.g. ``DedupResult.component``).
    """
    rows = pool if isinstance(pool, Rows) else Rows(pool)
    ev = eval_embeddings if isinstance(eval_embeddings, Rows) else Rows(eval_embeddings)
    n = len(rows)
    max_sim = np.full(n, -np.inf, np.float32)
    nearest = np.full(n, -1, np.int64)
    if len(ev) and n:
        if ev.dim != rows.dim:
            raise InputError(f"pool embeddings have {rows.dim} dims but eval embeddings "
                             f"{ev.dim}: embed both with the same model / descriptor")
        # The eval set is the index (usually far smaller): one k=1 query per pool image.
        index = build_index(ev, kind=index_kind, nprobe=nprobe, use_gpu=use_gpu)
        for pos, sims, idx in iter_knn(index, rows, 1, batch_size):
            max_sim[pos], nearest[pos] = sims[:, 0], idx[:, 0]
    return expand_to_components(max_sim, nearest, threshold, components)


def expand_to_components(max_sim: np.ndarray, nearest: np.ndarray, threshold: float,
                         components: np.ndarray | None = None) -> DecontaminationResult:
    """Flag images with ``max_sim`` > threshold and, with ``components``, their whole copy groups.
    Shared by the in-memory search above and the sharded one (curation.decontaminate.nearest)."""
    direct = np.asarray(max_sim) > threshold
    if components is None:
        removed = direct.copy()
    else:
        components = np.asarray(components)
        removed = np.isin(components, np.unique(components[direct]))
    return DecontaminationResult(removed, direct, np.asarray(max_sim, np.float32), np.asarray(nearest))
