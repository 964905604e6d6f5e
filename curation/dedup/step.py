"""The dedup step of the chain (curation.pipeline runs it): the hash pre-dedup, then copy dedup of its survivors
through the sharded kNN, verified on pixels and grouped; writes steps/dedup/."""

from __future__ import annotations

import os
from typing import Callable

import numpy as np

from curation.config import (DedupConfig, HashDedupConfig, KnnConfig,
                             TasksConfig, knn_dict, task_plan)
from curation.dedup.copies import resolve_threshold
from curation.core.embstore import open_embeddings
from curation.dedup.knn import hash_survivors, sharded_copy_dedup, verifier_factory
from curation.core.stepfiles import StepWriter, blocks, positions_where, step_dir
from curation.core.status import COPY_DUP, HASH_DUP, KEPT
from curation.core.layout import RunLayout


def step_dedup(out_dir: str, dedup: DedupConfig | None = None, hash_dedup: HashDedupConfig | None = None,
               knn: KnnConfig | None = None, sources=None, progress: bool = True,
               tasks: TasksConfig | None = None, make_verifier: Callable | None = None,
               query_fraction: float = 1.0) -> dict:
    """Hash pre-dedup (unless ``hash_dedup.enabled`` is False), then copy dedup of the hash survivors:
    kNN candidates on the copy descriptors through the sharded kNN (curation.dedup.knn: the saved
    index and the chunks of `curate search` array tasks are reused, whatever is missing is computed
    here), each verified on the pixels of ``sources`` (unless ``dedup.verify`` is False), grouped
    without chaining (``dedup.grouping='star'``). ``dedup.threshold``: the kNN cosine of candidates
    (None: 0.45 with verification, DINOv2's 0.6 without). ``tasks``: W of the hash dedup, the index add,
    the search and the verification (curation.config.TasksConfig; decisions do not depend on it)."""
    dd, hc = dedup or DedupConfig(), hash_dedup or HashDedupConfig()
    threshold = resolve_threshold(dd.threshold, dd.verify)
    emb = open_embeddings(RunLayout(out_dir).embeddings("descriptor"))
    if dd.verify and sources is None and make_verifier is None:
        raise ValueError("copy verification reads the images again: pass the pool's sources "
                         "(or dedup.verify=False to trust the descriptor alone)")
    verify_with = (sources, dd.verify_size, dd.verify_threshold) if dd.verify and make_verifier is None else None
    h, hinfo = hash_survivors(out_dir, emb, hc.enabled, hc.max_distance, verify_with,
                              task_plan(tasks or TasksConfig(), len(emb)))
    # the survivors' positions: a mapped int64 file written a block at a time (not an array in this process)
    surv_path = os.path.join(step_dir(out_dir, "dedup"), "survivors.scratch.npy")
    surv = positions_where(out_dir, surv_path, h.keep, lambda b: b)
    plan = task_plan(tasks or TasksConfig(), len(surv))
    factory = (make_verifier or verifier_factory)(out_dir, sources, surv, dd.verify_size, dd.verify_threshold) \
        if dd.verify else None
    knn_d = knn_dict(knn) if query_fraction >= 1.0 else {**(knn_dict(knn) or {}), "query_fraction": float(query_fraction)}
    d = sharded_copy_dedup(out_dir, emb, surv, dd.k, threshold, dd.index, dd.nprobe, knn_d, progress,
                           grouping=dd.grouping, tasks=plan, verifier_factory=factory)
    # the step's arrays written in place a block at a time (mapped files, not whole arrays in this process)
    n, out = len(emb), StepWriter(out_dir, "dedup")
    joined = np.lib.format.open_memmap(os.path.join(out.dir, "joined.scratch.npy"), mode="w+", dtype=np.int64,
                                       shape=(n,))
    status = out.array("status", np.int8, n)
    for s, t in blocks(n):  # hash duplicates join their kept image's copy component
        joined[s:t] = h.group[s:t]
        status[s:t] = np.where(h.keep[s:t], KEPT, HASH_DUP)
    nn_sim = out.array("nn_sim", np.float32, n, fill=np.nan)
    for s, t in blocks(len(surv)):
        rows = surv[s:t]
        joined[rows] = surv[d.component[s:t]]
        status[rows[~d.keep[s:t]]] = COPY_DUP
        nn_sim[rows] = d.nn_sim[s:t]
    component = out.array("component", np.int64, n)
    for s, t in blocks(n):  # a hash group's kept image may itself be a copy
        component[s:t] = joined[joined[s:t]]
    del joined, surv
    os.remove(os.path.join(out.dir, "joined.scratch.npy"))
    os.remove(surv_path)
    out.finish()
    return {"hash_duplicates": h.n_duplicates, "copy_duplicates": d.n_duplicates,
            "index": d.index_kind, "candidates": d.n_candidates, "edges": d.n_edges,
            "threshold": threshold, "verify_seconds": round(d.verify_seconds, 2),
            "tasks": {"hash": hinfo["tasks"], "knn": plan["tasks"], "verify": getattr(d, "verify_tasks", 0)}}


