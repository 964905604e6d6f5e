"""The teacher's kNN accuracy during pretraining (``knn.*`` config): a few points over the run, RUN/knn.jsonl.

The losses of a healthy DINO run can rise for a long while (the teacher temperature warms up, the centre
settles), so they cannot tell whether the backbone learns; the weighted kNN top-1 (DINO's protocol,
``dinopipe.eval``) of the EMA teacher on a labelled held-out set can. Points: one before the first step (the
random init, the baseline every later point is compared with) and ``points - 1`` evenly spaced steps after it,
the last at the end. Each point gathers the teacher's full weights (collective under FSDP, like the export),
then rank 0 alone extracts features and writes one JSON line: ``{"step", "top1", "top5", "k", "queries",
"gallery", "classes"}``. Costs one forward of gallery + queries per point; ``knn.max_queries`` bounds it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..eval import LabelError, LabelledImages, extract_features, knn_classify, open_labelled
from ..models import build_vit
from .checkpoint import full_state_dict
from .dist import DistInfo

log = logging.getLogger(__name__)

KNN_FILE = "knn.jsonl"


def probe_steps(points: int, total: int) -> list[int]:
    """0 (before training) and ``points - 1`` evenly spaced steps ending at ``total``; one point: the end."""
    if points <= 1:
        return [total]
    return sorted({0} | {max(1, round(total * i / (points - 1))) for i in range(1, points)})


def open_sets(train: str, val: str, max_queries: int) -> tuple[LabelledImages, LabelledImages]:
    """(gallery, queries); the queries thinned to ``max_queries`` spread over the set (every class keeps its
    share; the same ones at every point). Raises LabelError naming the folder."""
    gallery = open_labelled(train)
    queries = open_labelled(val, classes=gallery.classes)
    n = len(queries)
    if n > max_queries:
        keep = [i * n // max_queries for i in range(max_queries)]
        queries = LabelledImages([queries.refs[i] for i in keep], [queries.labels[i] for i in keep],
                                 queries.classes, queries.read, queries.source)
    return gallery, queries


def read_knn(run_dir: str | Path) -> list[dict]:
    """The points of a run, one per step (a resumed run may have rewritten a point: the last one counts)."""
    path = Path(run_dir) / KNN_FILE
    if not path.is_file():
        return []
    rows = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        rows[int(row["step"])] = row
    return [rows[s] for s in sorted(rows)]


class KnnProbe:
    """Called by the loop at each of ``steps`` on every rank (the weight gather is collective)."""

    def __init__(self, cfg: Any, teacher: Callable[[], nn.Module], run_dir: str | Path, info: DistInfo,
                 total_steps: int) -> None:
        self.cfg, self.teacher, self.info = cfg, teacher, info
        self.path = Path(run_dir) / KNN_FILE
        self.steps = set(probe_steps(cfg.points, total_steps))
        self._sets: Optional[tuple[LabelledImages, LabelledImages]] = None

    def __call__(self, step: int) -> Optional[dict]:
        backbone = self.teacher()
        sd = full_state_dict(backbone)  # every rank gathers; rank 0 evaluates
        if not self.info.is_main:
            return None
        if self._sets is None:
            self._sets = open_sets(self.cfg.train, self.cfg.val, self.cfg.max_queries)
        gallery, queries = self._sets
        with torch.random.fork_rng(devices=[]):  # building the model draws init weights: keep training's stream
            model = build_vit(**backbone.arch_config())
            model.load_state_dict(sd)
            kw = dict(img_size=self.cfg.img_size, num_workers=0, device=self.info.device)
            ft, fq = extract_features(model, gallery, **kw), extract_features(model, queries, **kw)
        k = self.cfg.k
        res = knn_classify(ft.feats, ft.labels, fq.feats, fq.labels, ks=(k,), num_classes=len(gallery.classes))[k]
        row = {"step": step, "top1": res["top1"], "top5": res["top5"], "k": res["k_used"], "queries": len(fq.labels),
               "gallery": len(ft.labels), "classes": len(gallery.classes)}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        log.info("kNN of the teacher at step %d: top-1 %.3f (k=%d, %d queries, %d classes)", step, row["top1"],
                 row["k"], row["queries"], row["classes"])
        del model
        return row


def build_probe(cfg: Any, task: Any, info: DistInfo, total_steps: int) -> Optional[KnnProbe]:
    """The probe of a config with ``knn.train`` / ``knn.val`` set (pretraining), else None."""
    k = getattr(cfg, "knn", None)
    if k is None or not k.train:
        return None
    return KnnProbe(k, lambda: task.export_specs(0)[0].backbone, cfg.train.output_dir, info, total_steps)


def check_sets(cfg: Any) -> None:
    """Both sets readable and sharing their classes; a LabelError names the folder (the stage exits 2)."""
    k = getattr(cfg, "knn", None)
    if k is not None and k.train:
        open_sets(k.train, k.val, k.max_queries)


__all__ = ["KnnProbe", "build_probe", "check_sets", "probe_steps", "read_knn", "open_sets", "KNN_FILE", "LabelError"]
