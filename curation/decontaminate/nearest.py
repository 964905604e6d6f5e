"""Each pool image's nearest eval image on the sharded kNN: the eval images embedded in the pool's copy space (as
views: curation.decontaminate.views), the eval index saved once, the pool rows searched in chunks and rescored
exactly."""

from __future__ import annotations


import numpy as np

from dinopipe.config import ConfigError

from curation.knn.jobs import descriptor_dir, digest, row_source
from curation.embed.embeddings import embed_pool
from curation.core.embstore import EmbeddingSet, open_embeddings
from curation.knn.index import Rows
from curation.knn.shards import KnnJob, run_search
from curation.decontaminate.views import embed_views, eval_position, eval_targets
from curation.core.layout import RunLayout


EVAL_K = 4  # eval candidates rescored exactly per pool image (the best one decides)


def eval_params(ev: EmbeddingSet, knn: dict | None = None, views: int = 1) -> dict:
    """The eval index's parameters (a new eval set, or other views: a new index)."""
    knn = knn or {}
    # index kind "auto": flat up to 50k rows (views included), IVF beyond; k: EVAL_K, the search's default
    return {"n_eval": len(ev), "eval_ids": ev.digest, "views": views,
            **{key: knn[key] for key in ("chunk_size", "batch_size") if knn.get(key) is not None}}


def eval_index(out_dir: str, ev: EmbeddingSet, knn: dict | None, pool_rows: np.ndarray):
    """The eval index over what it holds (curation.decontaminate.views.eval_targets), built unless one with these
    parameters is saved (``pool_rows``: the pool positions it will be searched with). Returns (job, rows, their
    source for task processes)."""
    job = KnnJob(out_dir, "eval")
    targets, views, source = eval_targets(out_dir, ev)
    params = {**eval_params(ev, knn, views), "pool_rows": digest(pool_rows)}
    if len(ev) and not job.matches(params):
        job.build(targets, params, use_gpu=False)
    return job, targets, source


def embed_eval(out_dir: str, eval_sources, batch_size: int = 64, num_workers: int = 2,
               progress: bool = False, trust_code: bool = False, views: bool = True) -> EmbeddingSet:
    """Eval images in the pool's copy space (the copy model recorded in ``out_dir``, else the
    descriptor; resumable: finished shards are skipped), and with ``views`` (``decontaminate.views``) their crops
    and mirrors too (curation.decontaminate.views). ``trust_code``: this run's ``dedup.trust_code``."""
    from curation.embed.copyspace import copy_embedder

    fn, tf = copy_embedder(out_dir, trust_code=trust_code)
    eval_dir = RunLayout(out_dir).embeddings("eval")
    embed_pool(eval_sources, fn, eval_dir, batch_size=batch_size, num_workers=num_workers,
               transform=tf, hash_name=None, progress=progress)
    ev = open_embeddings(eval_dir)
    if views and len(ev):
        embed_views(out_dir, eval_sources, fn, tf, ev, batch_size, num_workers, progress)
    return ev


def sharded_nearest_eval(out_dir: str, pool: EmbeddingSet, alive: np.ndarray, ev: EmbeddingSet,
                         knn: dict | None = None, progress: bool = False, tasks: dict | None = None,
                         stream: bool = False):
    """(max cosine, eval position) of every pool row in ``alive``: exact float64 rescoring of the
    eval index's nearest candidates, from the saved chunks (searched here when missing). ``stream``: instead,
    an iterator of (first position in ``alive``, max cosines, eval positions) a saved chunk at a time."""
    if ev.dim != pool.dim:
        raise ConfigError(f"pool embeddings have {pool.dim} dims but eval embeddings {ev.dim}: "
                         "embed both with the same model / descriptor")
    job, targets, target_source = eval_index(out_dir, ev, knn, alive)
    sources = (row_source(out_dir, "eval", descriptor_dir(out_dir), alive, "query"), target_source)
    run_search(out_dir, "eval", "nearest", Rows(pool, alive), targets, False, tasks, sources)
    if not stream:
        r = job.read(len(alive))
        return r["sim"], eval_position(r["idx"], len(ev))
    return ((s, c["sim"], eval_position(c["idx"], len(ev))) for s, c in job.iter(len(alive)))
