"""Rebalance mode 'sample' on the sharded kNN: every seed image's nearest kept rows, from the retrieval index that
`curate index` builds after decontamination and the chunks `curate search` tasks search (else here)."""

from __future__ import annotations

import os

import numpy as np


from curation.knn.jobs import digest, row_source
from curation.core.embstore import EmbeddingSet, open_embeddings
from curation.knn.index import Rows
from curation.knn.shards import KnnJob, RowSource, run_search
from curation.core.layout import RunLayout


def retrieval_params(rows_idx: np.ndarray, seeds: EmbeddingSet, k: int, knn: dict | None = None) -> dict:
    """The retrieval index (rebalance mode 'sample') and its searches: the rebalanced rows, the seed
    set and k (a change of any rebuilds it); kind/nprobe as the one-process mode always used."""
    knn = knn or {}
    return {"rows": digest(rows_idx), "seeds": seeds.digest, "n_seeds": len(seeds),
            "k": max(1, min(int(k), len(rows_idx))), "kind": "auto", "nprobe": 64,
            **{key: knn[key] for key in ("chunk_size", "batch_size") if knn.get(key) is not None}}


def sharded_retrieval(out_dir: str, space: EmbeddingSet, rows_idx: np.ndarray, seeds: EmbeddingSet,
                      k: int, knn: dict | None = None, progress: bool = False, tasks: dict | None = None,
                      space_dir: str | None = None):
    """(seed, pool position, exact sim) candidates of every seed's k nearest rows ``rows_idx`` of
    ``space``: from the saved index and chunks when `curate index` / `curate search` made them for
    these rows and seeds, else built and searched here as task 0 of 1 (the same chunks)."""
    job = KnnJob(out_dir, "retrieval")
    params = retrieval_params(rows_idx, seeds, k, knn)
    rows = Rows(space, rows_idx)
    tsrc = None if space_dir is None else row_source(out_dir, "retrieval", space_dir, rows_idx, "pool")
    if not job.matches(params):
        job.build(rows, params, use_gpu=(knn or {}).get("use_gpu", "auto"), progress=progress, source=tsrc,
                  tasks=tasks if tsrc is not None else None)
    plan = tasks if tsrc is not None else None  # W processes need to know where the rows are
    run_search(out_dir, "retrieval", "retrieval", Rows(seeds), rows, False, plan,
               (RowSource(RunLayout(out_dir).embeddings("seeds")), tsrc))  # only chunks not on disk
    r = job.read(len(seeds))
    return r["seed"], r["pos"], r["sim"]


def retrieval_inputs(out_dir: str):
    """(space, rows_idx, seeds) of rebalance mode 'sample', or None before decontamination or
    seed embedding (then `curate index` / `curate search` have no retrieval work yet)."""
    from curation.core.stepfiles import rebalance_rows, step_exists

    seed_dir = RunLayout(out_dir).embeddings("seeds")
    if not (step_exists(out_dir, "decontaminate") and os.path.isdir(seed_dir)):
        return None
    space_dir, rows_idx, _, _ = rebalance_rows(out_dir)
    seeds = open_embeddings(seed_dir)
    return (open_embeddings(space_dir), rows_idx, seeds) if len(rows_idx) and len(seeds) else None


def step_retrieval_index(out_dir: str, k: int, knn: dict | None = None, progress: bool = False) -> dict:
    """``curate index`` after decontamination (mode 'sample', seeds embedded): the retrieval index."""
    got = retrieval_inputs(out_dir)
    if got is None:
        return {"retrieval": "waits for decontaminate and the seed embeddings"}
    space, rows_idx, seeds = got
    job = KnnJob(out_dir, "retrieval")
    params = retrieval_params(rows_idx, seeds, k, knn)
    meta = job.meta() if job.matches(params) else job.build(
        Rows(space, rows_idx), params, use_gpu=(knn or {}).get("use_gpu", "auto"), progress=progress)
    return {"retrieval_rows": int(len(rows_idx)), "seeds": len(seeds), "retrieval_kind": meta["kind"]}


def step_retrieval_search(out_dir: str, task_index: int, num_tasks: int, knn: dict | None = None,
                          progress: bool = False) -> dict | None:
    """``curate search``: this task's chunks of the seeds against the retrieval index, if built
    for the current rows and seeds."""
    job = KnnJob(out_dir, "retrieval")
    meta = job.meta()
    if meta is None:
        return None
    got = retrieval_inputs(out_dir)
    if got is None or meta["params"]["rows"] != digest(got[1]) or meta["params"]["seeds"] != \
            retrieval_params(got[1], got[2], 1)["seeds"]:
        # stale (an earlier run in this folder): not an error for the pool/eval search before dedup;
        # `curate rebalance` rebuilds it in-process unless `curate index` is rerun after decontaminate
        return {"skipped": "index for other rows or seeds: rerun `curate index` after decontaminate"}
    space, rows_idx, seeds = got
    return job.search_retrieval(Rows(seeds), Rows(space, rows_idx), task_index, num_tasks,
                                (knn or {}).get("use_gpu", "auto"), progress)
