"""Eval images embedded as views, so that a pool image that is a crop of an eval image finds it.

The copy descriptor squashes a whole image into a thumbnail: a pool image cut from 75-95 % of an eval image (a
side each) lands far from the eval image's own vector (bench/bench_curation_precision.py, mild leaks: 3 of 30 crops
ranked 8th-86th in a mixed pool, 4 of 30 ranked 21st-77th among the look-alike tiles of one retina). Each eval image
is therefore embedded, in the pool's copy space, as :data:`VIEW_BOXES`: the whole image, crops of 80 and 90 % a
side (each axis on its own: a crop changes the aspect, the thumbnail squashes it back) at three places per axis, and
the mirror of each. The eval index holds every view (view-major rows: row ``k * n_eval + i`` is view ``k`` of eval
image ``i``); a pool image's nearest row names its eval image (``row % n_eval``), which pixel verification then
checks as before. Candidate recall of those mild leaks: 0.90 / 0.87 / 0.97 -> 1.00 / 0.97 / 1.00 (mixed / retina /
low-detail).

The views are written once to ``embeddings/eval-views/views.npy`` (float16, (V * n_eval, dim)) with
``views.json`` naming the eval set and the boxes; the per-view embedding folders under it make the embedding
resumable. A simulation (no pixels) or ``decontaminate.views: false`` has no views: the index holds the eval
embeddings themselves.
"""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
from PIL import Image, ImageOps

from dinopipe.utils.io import atomic_path, atomic_write_json

from curation.core.embstore import EmbeddingSet, open_embeddings
from curation.core.layout import RunLayout

SIDES = (1.0, 0.9, 0.8)  # a crop's side, per axis, as a share of the eval image's
PLACES = (0.0, 0.5, 1.0)  # where a crop sits along an axis (share of the free range)
GROUP = 8  # views embedded per pass over the eval images (memory: GROUP transformed copies of a batch)


def view_boxes() -> list[tuple[float, float, float, float, bool]]:
    """(side y, side x, place y, place x, mirrored) of every view; the first is the whole image."""
    boxes = []
    for flip in (False, True):
        for sy, sx in itertools.product(SIDES, SIDES):
            for py in ((0.0,) if sy == 1.0 else PLACES):
                for px in ((0.0,) if sx == 1.0 else PLACES):
                    boxes.append((sy, sx, py, px, flip))
    return boxes


VIEW_BOXES = view_boxes()


def view_of(img: Image.Image, box) -> Image.Image:
    """The view ``box`` (see :func:`view_boxes`) of ``img``."""
    sy, sx, py, px, flip = box
    w, h = img.size
    ch, cw = max(1, round(sy * h)), max(1, round(sx * w))
    y0, x0 = round(py * (h - ch)), round(px * (w - cw))
    out = img.crop((x0, y0, x0 + cw, y0 + ch)) if (ch, cw) != (h, w) else img
    return ImageOps.mirror(out) if flip else out


class ViewTransform:
    """The copy space's transform of one view (picklable: the embedding's data workers run it)."""

    def __init__(self, box, transform):
        self.box, self.transform = tuple(box), transform

    def __call__(self, img: Image.Image):
        return self.transform(view_of(img, self.box))


def views_path(out_dir: str, suffix: str = ".npy") -> str:
    """``views.npy`` (the rows) or, with ``suffix=".json"``, what they were written for."""
    return RunLayout(out_dir).embeddings("eval-views", "views" + suffix)


def _key(ev: EmbeddingSet) -> dict:
    return {"eval_ids": ev.digest, "n_eval": len(ev), "boxes": [list(b) for b in VIEW_BOXES]}


def embed_views(out_dir: str, eval_sources, embed_fn, transform, ev: EmbeddingSet, batch_size: int = 64,
                num_workers: int = 2, progress: bool = False) -> str:
    """Embed every view of the eval images (``ev``: their whole-image embeddings, view 0) with the copy space's
    ``embed_fn`` / ``transform`` into ``views.npy``; resumable (finished view folders are skipped, a finished
    ``views.npy`` for this eval set is kept). Returns its path."""
    from curation.embed.embeddings import EmbedTarget, embed_pool_multi

    path = views_path(out_dir)
    if _matches(out_dir, ev):
        return path
    root = os.path.dirname(path)
    dirs = [os.path.join(root, f"v{k:03d}") for k in range(len(VIEW_BOXES))]
    todo = list(range(1, len(VIEW_BOXES)))
    for g in range(0, len(todo), GROUP):
        ks = todo[g:g + GROUP]
        embed_pool_multi(eval_sources, [EmbedTarget(embed_fn, dirs[k], ViewTransform(VIEW_BOXES[k], transform), None)
                                        for k in ks], batch_size=batch_size, num_workers=num_workers,
                         progress=progress)
    sets = [ev] + [open_embeddings(d) for d in dirs[1:]]
    for k, s in enumerate(sets):
        if len(s) != len(ev) or s.dim != ev.dim:
            raise RuntimeError(f"eval view {k} has {len(s)} x {s.dim} rows but the eval set {len(ev)} x {ev.dim}: "
                               f"remove {root} and rerun")
    n = len(ev)
    with atomic_path(path, suffix=".npy") as tmp:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=(len(sets) * n, ev.dim))
        for k, s in enumerate(sets):
            for start in range(0, n, 65536):
                idx = np.arange(start, min(n, start + 65536))
                out[k * n + idx] = s.rows(idx).astype(np.float16)
        out.flush()
        del out
    atomic_write_json(views_path(out_dir, ".json"), _key(ev))
    return path


def _matches(out_dir: str, ev: EmbeddingSet) -> bool:
    """Whether ``views.npy`` was written for this eval set and these boxes."""
    meta = views_path(out_dir, ".json")
    if not (os.path.exists(meta) and os.path.exists(views_path(out_dir))):
        return False
    with open(meta) as f:
        return json.load(f) == json.loads(json.dumps(_key(ev)))


def eval_targets(out_dir: str, ev: EmbeddingSet):
    """What the eval index holds: (rows, number of views, the rows' source for task processes). The views when
    ``views.npy`` was written for this eval set, else the eval embeddings (one view)."""
    from curation.knn.index import Rows
    from curation.knn.shards import RowSource

    if len(ev) and _matches(out_dir, ev):
        path = views_path(out_dir)
        return Rows(np.load(path, mmap_mode="r")), len(VIEW_BOXES), RowSource(path)
    return Rows(ev), 1, RowSource(RunLayout(out_dir).embeddings("eval"))


def eval_position(idx: np.ndarray, n_eval: int) -> np.ndarray:
    """The eval image of each index row (-1 stays -1: no neighbour)."""
    idx = np.asarray(idx)
    return np.where(idx >= 0, idx % max(1, n_eval), idx)
