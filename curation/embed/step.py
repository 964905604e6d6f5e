"""The embed step of the chain (curation.pipeline runs it): copy descriptors, perceptual hashes and model
embeddings of the pool, then the path tables (curation.core.pathtable) as W tasks."""

from __future__ import annotations

import functools
import os
from typing import Callable

from curation.config import DedupConfig, EmbedConfig, TasksConfig, task_plan
from curation.config import DescriptorConfig
from curation.embed.embeddings import EmbedTarget, embed_pool_multi
from curation.core.embstore import build_path_table
from curation.embed.copyspace import copy_embedder
from curation.embed.tasks import embed_tasks, embed_with_tasks
from curation.core.layout import RunLayout


def step_embed(sources, out_dir: str, embed: EmbedConfig | None = None,
               descriptor: DescriptorConfig | None = None, dedup: DedupConfig | None = None,
               embedder: Callable | None = None, progress: bool = True, tasks: TasksConfig | None = None) -> dict:
    """Copy descriptors (+ perceptual hashes) of this task's share of the pool (``embed.task_index`` of
    ``embed.num_tasks``); model embeddings too when an ``embedder`` (the built ``embed.model``, with its
    ``transform``) is given. Resumable. ``dedup.model``: a copy-detection model (TorchScript or
    ``dinopipe.load``) in place of the descriptor (see :mod:`curation.embed.copymodel`). When this process embedded
    the whole pool (``embed.num_tasks`` 1), the path tables follow as ``tasks`` W tasks (:func:`build_tables`;
    after an array of embedding tasks, the first step of the next job builds them)."""
    e, dd = embed or EmbedConfig(), dedup or DedupConfig()
    fn, tf = copy_embedder(out_dir, sources, descriptor, dd.model, dd.image_size, e.device, e.precision,
                           dd.trust_code)
    targets = {"descriptor": EmbedTarget(fn, RunLayout(out_dir).embeddings("descriptor"), tf, "phash")}
    if embedder is not None:  # the same decoded image feeds both (one read + decode per image)
        targets["model"] = EmbedTarget(embedder, RunLayout(out_dir).embeddings("model"), transform_of(embedder))
    w_embed = embed_tasks(out_dir, e, tasks, embedder)
    if w_embed > 1:  # W tasks, each listing and embedding its share (curation.embed.tasks)
        counts = embed_with_tasks(sources, out_dir, e, descriptor, dd, embedder is not None, w_embed,
                                  str((tasks or TasksConfig()).launcher))
    else:
        counts = embed_pool_multi(sources, list(targets.values()), shard_size=e.shard_size,
                                  batch_size=e.batch_size, num_workers=e.num_workers, task_index=e.task_index,
                                  num_tasks=e.num_tasks, progress=progress)
    w = build_tables(out_dir, tasks) if e.num_tasks == 1 else 0
    return {**dict(zip(targets, counts)), "tasks": {"table": w, "embed": w_embed}}


def build_tables(out_dir: str, tasks: TasksConfig | None = None) -> int:
    """The path tables of embeddings/descriptor and embeddings/model (when there), each as W tasks of
    ``tasks``' plan (curation.core.pathtable) unless complete and current; returns the largest W (0: all there)."""
    w = 0
    for name in ("descriptor", "model"):
        d = RunLayout(out_dir).embeddings(name)
        if os.path.isdir(d) and any(f.endswith(".ids.json") for f in os.listdir(d)):
            w = max(w, build_path_table(d, functools.partial(task_plan, tasks or TasksConfig())))
    return w


def transform_of(embedder):
    return getattr(embedder, "transform", None)
