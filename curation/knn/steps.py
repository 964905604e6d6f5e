"""The curation steps on the sharded kNN (curation.knn.shards): ``curate index`` and ``curate search``,
and the copy dedup / decontamination that ``curate dedup`` / ``curate decontaminate`` run on their
merged results.

One code path for any number of workers: ``curate run`` (and a ``curate dedup`` that finds no
finished search) trains the same index and searches every chunk in its own process as task 0 of 1;
on Slurm, ``curate index`` (one job) and ``curate search knn.task_index=i knn.num_tasks=N`` (an array)
have done that work before, and the finishing job only merges. Hence identical ``decisions.tsv``.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile

import numpy as np

from dinopipe.config import ConfigError

from curation.config import DedupConfig, EmbedConfig, HashDedupConfig, KnnConfig, knn_kwargs, task_plan
from curation.dedup.copies import DedupResult, copy_dedup_from_edges, copy_dedup_from_keys, resolve_threshold
from curation.embed.embeddings import embed_pool
from curation.core.embstore import EmbeddingSet, open_embeddings
from curation.dedup.hash_step import hash_step, pixel_verifier_of
from curation.dedup.hashdedup import HashDedupResult
from curation.knn.index import Rows
from curation.knn.shards import KnnJob, RowSource, pair_keys, run_search
from curation.core.stepfiles import positions_where
from curation.core.unionfind import in_id_order
from curation.verify.pixels import PartedVerifier
from curation.verify.tasks import verified_edges

EVAL_K = 4  # eval candidates rescored exactly per pool image (the best one decides)


def _desc_dir(out_dir: str) -> str:
    return os.path.join(out_dir, "embeddings", "descriptor")


def _source(out_dir: str, name: str, emb_dir: str, positions: np.ndarray | None, what: str) -> RowSource:
    """The rows a task process reopens: ``knn/<name>/<what>_rows.npy`` (positions) in ``emb_dir``."""
    return RowSource.save(emb_dir, positions, os.path.join(out_dir, "knn", f"{name}-{what}_rows.npy"))


def hash_survivors(out_dir: str, emb: EmbeddingSet, enabled: bool, max_distance: int,
                   verify_with: tuple | None = None, plan: dict | None = None) -> tuple[HashDedupResult, dict]:
    """The perceptual-hash pre-pass, computed once as the plan's W tasks and saved in ``out_dir``
    (curation.dedup.hash_step): `curate index`, the `curate search` tasks and `curate dedup` read the same
    result, so they agree on the rows they index and search. -> (result, {"tasks": W, "reused": ...})."""
    return hash_step(out_dir, emb, enabled, max_distance, verify_with, plan)


def _digest(positions: np.ndarray, block: int = 1 << 16) -> str:
    """sha1 of the int64 bytes of ``positions``, fed a block at a time (no whole copy of a mapped array)."""
    h = hashlib.sha1()
    for s in range(0, len(positions), block):
        h.update(np.ascontiguousarray(positions[s:s + block], np.int64).tobytes())
    return h.hexdigest()[:16]


def pool_params(surv: np.ndarray, k: int, threshold: float, index_kind: str, nprobe: int,
                knn: dict | None = None) -> dict:
    """Everything the pool index and its searches depend on (a change retrains the index).
    ``knn``: nlist, pq_m, train_size, chunk_size, batch_size, margin, seed (None: defaults)."""
    k = max(1, min(k, len(surv) - 1))
    extra = {key: v for key, v in (knn or {}).items() if v is not None and key not in ("use_gpu",)}
    return {"rows": _digest(surv), "k": k, "threshold": float(threshold), "kind": index_kind,
            "nprobe": nprobe, **extra}


def eval_params(ev: EmbeddingSet, knn: dict | None = None) -> dict:
    knn = knn or {}
    return {"n_eval": len(ev), "eval_ids": ev.digest,  # a new eval set: new index "kind": "flat", "k": EVAL_K,
            **{key: knn[key] for key in ("chunk_size", "batch_size") if knn.get(key) is not None}}


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
    from curation.kmeans.dist import Gathered

    n = len(surv)
    ids = Gathered(emb.ids, surv)  # read a block at a time by the grouping (no int64 per survivor held)
    if n < 2:
        return DedupResult(np.arange(n, dtype=np.int64), np.ones(n, bool), np.full(n, -np.inf, np.float32),
                           np.full(n, -1, np.int64), 0, "none")
    rows = Rows(emb, surv)
    use_gpu = (knn or {}).get("use_gpu", "auto")
    job = KnnJob(out_dir, "pool")
    params = pool_params(surv, k, threshold, index_kind, nprobe, knn)
    src = _source(out_dir, "pool", _desc_dir(out_dir), surv, "pool")
    if not job.matches(params):
        job.build(rows, params, use_gpu=use_gpu, progress=progress, source=src, tasks=tasks)
    run_search(out_dir, "pool", "pairs", rows, None, use_gpu, tasks, (src, None))  # only chunks not on disk
    plan = tasks or {"tasks": 1, "launcher": "inline"}
    vw = int(verify_tasks if verify_tasks is not None else plan["tasks"])
    parted = None
    if verifier is not None or verifier_factory is not None:  # verdicts in parts: a rerun verifies what is missing
        parted = verifier = PartedVerifier(verifier, os.path.join(out_dir, "steps", "verify"), vw,
                                           plan["launcher"] if verifier is None else "inline", verifier_factory)
    if parted is not None and in_id_order(ids):
        # the usual case (ids in order: positions are ranks): W tasks read their own candidates from the chunk
        # files and verify them (curation.verify.tasks); this process reads only the verified edges
        lo, hi, cand, secs, _ = verified_edges(out_dir, n, threshold, parted.parts_dir, vw, parted.launcher,
                                               verifier_factory if parted.verifier is None
                                               else functools.partial(_same, parted.verifier))
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


def _same(verifier):
    """The factory of a verifier built by the caller (the tasks then run in this process)."""
    return verifier


def embed_eval(out_dir: str, eval_sources, batch_size: int = 64, num_workers: int = 2,
               progress: bool = False, trust_code: bool = False) -> EmbeddingSet:
    """Eval images in the pool's copy space (the copy model recorded in ``out_dir``, else the
    descriptor; resumable: finished shards are skipped). ``trust_code``: this run's ``dedup.trust_code``."""
    from curation.core.stepfiles import copy_embedder

    fn, tf = copy_embedder(out_dir, trust_code=trust_code)
    eval_dir = os.path.join(out_dir, "embeddings", "eval")
    embed_pool(eval_sources, fn, eval_dir, batch_size=batch_size, num_workers=num_workers,
               transform=tf, hash_name=None, progress=progress)
    return open_embeddings(eval_dir)


def sharded_nearest_eval(out_dir: str, pool: EmbeddingSet, alive: np.ndarray, ev: EmbeddingSet,
                         knn: dict | None = None, progress: bool = False, tasks: dict | None = None,
                         stream: bool = False):
    """(max cosine, eval position) of every pool row in ``alive``: exact float64 rescoring of the
    eval index's nearest candidates, from the saved chunks (searched here when missing). ``stream``: instead,
    an iterator of (first position in ``alive``, max cosines, eval positions) a saved chunk at a time."""
    if ev.dim != pool.dim:
        raise ConfigError(f"pool embeddings have {pool.dim} dims but eval embeddings {ev.dim}: "
                         "embed both with the same model / descriptor")
    job = KnnJob(out_dir, "eval")
    params = {**eval_params(ev, knn), "pool_rows": _digest(alive)}
    if not job.matches(params):
        job.build(Rows(ev), params, use_gpu=False)
    sources = (_source(out_dir, "eval", _desc_dir(out_dir), alive, "query"),
               RowSource(os.path.join(out_dir, "embeddings", "eval")))
    run_search(out_dir, "eval", "nearest", Rows(pool, alive), Rows(ev), False, tasks, sources)
    if not stream:
        r = job.read(len(alive))
        return r["sim"], r["idx"]
    return ((s, c["sim"], c["idx"]) for s, c in job.iter(len(alive)))


def _survivors(out_dir: str, emb: EmbeddingSet, sources, dedup: DedupConfig, hash_dedup: HashDedupConfig,
               plan: dict | None = None) -> tuple[np.ndarray, dict]:
    """(the hash survivors, the hash step's {"tasks", "reused"}): the saved hash dedup (curation.dedup.hash_step),
    computed here as ``plan``'s W tasks when no step has yet (hash duplicates are verified on the pixels of
    ``sources`` too, unless dedup.verify is off)."""
    verify_with = (sources, dedup.verify_size, dedup.verify_threshold) if dedup.verify else None
    h, info = hash_survivors(out_dir, emb, hash_dedup.enabled, hash_dedup.max_distance, verify_with, plan)
    return mapped_positions(os.path.join(out_dir, "knn"), h.keep), info


def mapped_positions(folder: str, keep) -> np.ndarray:
    """``np.flatnonzero(keep)`` as a memory-mapped int64 array written a block at a time: every `curate search`
    array task (and `curate index`) reads the survivors' positions without an int64 per survivor in memory (8 GB at
    10^9 rows). The file is this process's own (a unique name: array tasks on many nodes share the folder) and is
    unlinked once mapped, so nothing is left behind; the mapping lives on until the array is dropped."""
    os.makedirs(folder, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix="survivors-", suffix=".scratch.npy", dir=folder)
    os.close(fd)
    try:
        return positions_where(folder, path, keep, lambda b: b)
    finally:
        os.remove(path)


def save_verify_rows(out_dir: str, surv: np.ndarray) -> str:
    """``steps/verify_rows.npy``: the rows whose positions the verification pairs hold (memory-mapped by each
    verification task)."""
    path = os.path.join(out_dir, "steps", "verify_rows.npy")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp.npy"
    np.save(tmp, np.asarray(surv, np.int64))
    os.replace(tmp, path)
    return path


def verifier_factory(out_dir: str, sources, surv: np.ndarray, size: int, threshold: float):
    """A picklable factory of the pixel verifier of pairs of positions into ``surv``."""
    import functools

    return functools.partial(pixel_verifier_of, sources, _desc_dir(out_dir), save_verify_rows(out_dir, surv),
                             size, threshold)


def step_index(out_dir: str, dedup: DedupConfig, hash_dedup: HashDedupConfig, knn_cfg: KnnConfig,
               sources=None, eval_sources=None, embed: EmbedConfig | None = None,
               progress: bool = False, tasks=None) -> dict:
    """``curate index``: train and save the pool index (and the eval index) once, for the array
    (``tasks``: curation.config.TasksConfig, W add tasks into inverted-list files merged on disk)."""
    e, knn = embed or EmbedConfig(), knn_kwargs(knn_cfg)
    emb = open_embeddings(os.path.join(out_dir, "embeddings", "descriptor"))
    plan = None if tasks is None else task_plan(tasks, len(emb))
    surv, hinfo = _survivors(out_dir, emb, sources, dedup, hash_dedup, plan)
    out = {"rows": int(len(surv)), "hash_tasks": hinfo["tasks"]}
    if len(surv) >= 2:
        job = KnnJob(out_dir, "pool")
        params = pool_params(surv, dedup.k, resolve_threshold(dedup.threshold, dedup.verify), dedup.index,
                             dedup.nprobe, knn)
        meta = job.meta() if job.matches(params) else job.build(
            Rows(emb, surv), params, use_gpu=(knn or {}).get("use_gpu", "auto"), progress=progress,
            source=_source(out_dir, "pool", _desc_dir(out_dir), surv, "pool"),
            tasks=None if tasks is None else task_plan(tasks, len(surv)))
        out.update(kind=meta["kind"], index_bytes=meta["index_bytes"])
    if eval_sources:
        ev = embed_eval(out_dir, eval_sources, e.batch_size, e.num_workers, progress, dedup.trust_code)
        job = KnnJob(out_dir, "eval")
        params = {**eval_params(ev, knn), "pool_rows": _digest(surv)}
        if len(ev) and not job.matches(params):
            job.build(Rows(ev), params, use_gpu=False)
        out["eval_rows"] = len(ev)
    return out


def step_search(out_dir: str, dedup: DedupConfig, hash_dedup: HashDedupConfig, knn_cfg: KnnConfig,
                sources=None, progress: bool = False) -> dict:
    """``curate search``: array task ``knn.task_index`` of ``knn.num_tasks`` searches its chunks of the
    pool (copy pairs, and nearest eval images when ``curate index`` built an eval index)."""
    task_index, num_tasks, knn = knn_cfg.task_index, knn_cfg.num_tasks, knn_kwargs(knn_cfg)
    emb = open_embeddings(os.path.join(out_dir, "embeddings", "descriptor"))
    surv, _ = _survivors(out_dir, emb, sources, dedup, hash_dedup)  # saved by `curate index`
    use_gpu = (knn or {}).get("use_gpu", "auto")
    out = {}
    pool_job, eval_job = KnnJob(out_dir, "pool"), KnnJob(out_dir, "eval")
    if len(surv) >= 2:
        if pool_job.meta() is None or pool_job.meta()["params"]["rows"] != _digest(surv):
            raise FileNotFoundError(f"{pool_job.dir}: no index for this pool; run `curate index` first")
        out["pool"] = pool_job.search_pairs(Rows(emb, surv), task_index, num_tasks, use_gpu, progress)
    if eval_job.meta() is not None:
        ev = open_embeddings(os.path.join(out_dir, "embeddings", "eval"))
        out["eval"] = eval_job.search_nearest(Rows(emb, surv), Rows(ev), task_index, num_tasks,
                                              progress=progress)
    retrieval = step_retrieval_search(out_dir, task_index, num_tasks, knn, progress)
    if retrieval is not None:
        out["retrieval"] = retrieval
    return out


# ---------------------------------------------------------------------------------- retrieval


def retrieval_params(rows_idx: np.ndarray, seeds: EmbeddingSet, k: int, knn: dict | None = None) -> dict:
    """The retrieval index (rebalance mode 'sample') and its searches: the rebalanced rows, the seed
    set and k (a change of any rebuilds it); kind/nprobe as the one-process mode always used."""
    knn = knn or {}
    return {"rows": _digest(rows_idx), "seeds": seeds.digest, "n_seeds": len(seeds),
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
    tsrc = None if space_dir is None else _source(out_dir, "retrieval", space_dir, rows_idx, "pool")
    if not job.matches(params):
        job.build(rows, params, use_gpu=(knn or {}).get("use_gpu", "auto"), progress=progress, source=tsrc,
                  tasks=tasks if tsrc is not None else None)
    plan = tasks if tsrc is not None else None  # W processes need to know where the rows are
    run_search(out_dir, "retrieval", "retrieval", Rows(seeds), rows, False, plan,
               (RowSource(os.path.join(out_dir, "embeddings", "seeds")), tsrc))  # only chunks not on disk
    r = job.read(len(seeds))
    return r["seed"], r["pos"], r["sim"]


def retrieval_inputs(out_dir: str):
    """(space, rows_idx, seeds) of rebalance mode 'sample', or None before decontamination or
    seed embedding (then `curate index` / `curate search` have no retrieval work yet)."""
    from curation.core.stepfiles import rebalance_rows, step_exists

    seed_dir = os.path.join(out_dir, "embeddings", "seeds")
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
    if got is None or meta["params"]["rows"] != _digest(got[1]) or meta["params"]["seeds"] != \
            retrieval_params(got[1], got[2], 1)["seeds"]:
        # stale (an earlier run in this folder): not an error for the pool/eval search before dedup;
        # `curate rebalance` rebuilds it in-process unless `curate index` is rerun after decontaminate
        return {"skipped": "index for other rows or seeds: rerun `curate index` after decontaminate"}
    space, rows_idx, seeds = got
    return job.search_retrieval(Rows(seeds), Rows(space, rows_idx), task_index, num_tasks,
                                (knn or {}).get("use_gpu", "auto"), progress)
