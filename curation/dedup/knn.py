"""Copy dedup on the sharded kNN (curation.knn.shards): the hash survivors, the pool index and its searches, the
candidate pairs verified as W tasks and grouped (`curate dedup` reads what `curate index` / `curate search` saved)."""

from __future__ import annotations

import functools
import os

import numpy as np


from curation.knn.jobs import descriptor_dir, digest, mapped_positions, row_source
from curation.config import DedupConfig, HashDedupConfig
from curation.dedup.copies import DedupResult, copy_dedup_from_edges, copy_dedup_from_keys
from curation.core.embstore import EmbeddingSet
from curation.dedup.hash_step import hash_step, pixel_verifier_of
from curation.dedup.hashdedup import HashDedupResult
from curation.knn.index import Rows
from curation.knn.shards import KnnJob, pair_keys, run_search
from curation.core.unionfind import in_id_order
from curation.verify.pixels import PartedVerifier
from curation.verify.tasks import verified_edges
from curation.core.layout import RunLayout


def hash_survivors(out_dir: str, emb: EmbeddingSet, enabled: bool, max_distance: int,
                   verify_with: tuple | None = None, plan: dict | None = None) -> tuple[HashDedupResult, dict]:
    """The perceptual-hash pre-pass, computed once as the plan's W tasks and saved in ``out_dir``
    (curation.dedup.hash_step): `curate index`, the `curate search` tasks and `curate dedup` read the same
    result, so they agree on the rows they index and search. -> (result, {"tasks": W, "reused": ...})."""
    return hash_step(out_dir, emb, enabled, max_distance, verify_with, plan)


def pool_params(surv: np.ndarray, k: int, threshold: float, index_kind: str, nprobe: int,
                knn: dict | None = None) -> dict:
    """Everything the pool index and its searches depend on (a change retrains the index).
    ``knn``: nlist, pq_m, train_size, chunk_size, batch_size, margin, seed (None: defaults)."""
    k = max(1, min(k, len(surv) - 1))
    extra = {key: v for key, v in (knn or {}).items() if v is not None and key not in ("use_gpu",)}
    return {"rows": digest(surv), "k": k, "threshold": float(threshold), "kind": index_kind,
            "nprobe": nprobe, **extra}


def sharded_copy_dedup(out_dir: str, emb: EmbeddingSet, surv: np.ndarray, k: int, threshold: float,
                       index_kind: str = "auto", nprobe: int = 16, knn: dict | None = None,
                       progress: bool = False, verifier=None, grouping: str = "star",
                       verify_tasks: int | None = None, tasks: dict | None = None,
                       verifier_factory=None) -> DedupResult:
    """Copy dedup of rows ``surv`` of ``emb``: reuse the saved index and finished chunks when their
    parameters match, else build/search them here (``tasks``: W tasks of the index add, of the
    search and of the verification, curation.config.task_plan; default one, inline), then merge the
    candidate pairs and verify + group them (curation.dedup.copies.copy_dedup_from_keys: depends only on the
    pair set). ``verifier_factory``: a picklable callable building the verifier inside each verification
    task (W local processes); ``verifier``: one built here (the tasks then run in this process).
    ``verify_tasks``: W of the verification (default: the plan's). The result's ``nn_sim`` is read from the
    chunks a chunk at a time (knn_shards.ChunkColumn: sliced by the caller's blocks, no whole column held),
    its ``nn_index`` not at all (a read-only -1 placeholder: the chunks on disk hold it; no step keeps it)."""
    from curation.core.rows import Gathered

    n = len(surv)
    ids = Gathered(emb.ids, surv)  # read a block at a time by the grouping (no int64 per survivor held)
    if n < 2:
        return DedupResult(np.arange(n, dtype=np.int64), np.ones(n, bool), np.full(n, -np.inf, np.float32),
                           np.full(n, -1, np.int64), 0, "none")
    rows = Rows(emb, surv)
    use_gpu = (knn or {}).get("use_gpu", "auto")
    job = KnnJob(out_dir, "pool")
    params = pool_params(surv, k, threshold, index_kind, nprobe, knn)
    src = row_source(out_dir, "pool", descriptor_dir(out_dir), surv, "pool")
    if not job.matches(params):
        job.build(rows, params, use_gpu=use_gpu, progress=progress, source=src, tasks=tasks)
    run_search(out_dir, "pool", "pairs", rows, None, use_gpu, tasks, (src, None))  # only chunks not on disk
    plan = tasks or {"tasks": 1, "launcher": "inline"}
    vw = int(verify_tasks if verify_tasks is not None else plan["tasks"])
    parted = None
    if verifier is not None or verifier_factory is not None:  # verdicts in parts: a rerun verifies what is missing
        parted = verifier = PartedVerifier(verifier, RunLayout(out_dir).steps("verify"), vw,
                                           plan["launcher"] if verifier is None else "inline", verifier_factory)
    if parted is not None and in_id_order(ids):
        # the usual case (ids in order: positions are ranks): W tasks read their own candidates from the chunk
        # files and verify them (curation.verify.tasks); this process reads only the verified edges
        lo, hi, cand, secs, _ = verified_edges(out_dir, n, threshold, parted.parts_dir, vw, parted.launcher,
                                               verifier_factory if parted.verifier is None
                                               else functools.partial(same_verifier, parted.verifier))
        parted.calls = 1  # the lone images' second look: steps/verify/call1-*, as before
        res = copy_dedup_from_edges(n, ids, lo, hi, n_candidates=cand, verifier=verifier, grouping=grouping,
                                    verify_seconds=secs)
    else:
        # no verifier (every candidate an edge), or ids out of order (id_ranks' permutation): the pairs as sorted
        # unique keys, read a chunk at a time (8 B per pair held, dropped once split)
        res = copy_dedup_from_keys(n, ids, lambda: pair_keys(job.iter(n), n, threshold), verifier=verifier,
                                   grouping=grouping)
    # nn_sim is read a chunk at a time, nn_idx not at all
    res.nn_sim, res.index_kind = job.column(n, "nn_sim"), job.meta()["kind"]  # res.nn_index: the placeholder
    res.verify_tasks = vw if parted is not None else 0
    return res


def same_verifier(verifier):
    """The factory of a verifier built by the caller (the tasks then run in this process)."""
    return verifier


def survivors(out_dir: str, emb: EmbeddingSet, sources, dedup: DedupConfig, hash_dedup: HashDedupConfig,
               plan: dict | None = None) -> tuple[np.ndarray, dict]:
    """(the hash survivors, the hash step's {"tasks", "reused"}): the saved hash dedup (curation.dedup.hash_step),
    computed here as ``plan``'s W tasks when no step has yet (hash duplicates are verified on the pixels of
    ``sources`` too, unless dedup.verify is off)."""
    verify_with = (sources, dedup.verify_size, dedup.verify_threshold) if dedup.verify else None
    h, info = hash_survivors(out_dir, emb, hash_dedup.enabled, hash_dedup.max_distance, verify_with, plan)
    return mapped_positions(RunLayout(out_dir).knn(), h.keep), info


def save_verify_rows(out_dir: str, surv: np.ndarray) -> str:
    """``steps/verify_rows.npy``: the rows whose positions the verification pairs hold (memory-mapped by each
    verification task)."""
    path = RunLayout(out_dir).steps("verify_rows.npy")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp.npy"
    np.save(tmp, np.asarray(surv, np.int64))
    os.replace(tmp, path)
    return path


def verifier_factory(out_dir: str, sources, surv: np.ndarray, size: int, threshold: float):
    """A picklable factory of the pixel verifier of pairs of positions into ``surv``."""
    import functools

    return functools.partial(pixel_verifier_of, sources, descriptor_dir(out_dir), save_verify_rows(out_dir, surv),
                             size, threshold)
