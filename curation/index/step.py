"""The index step on the sharded kNN (curation.knn.shards): ``curate index`` and ``curate search``, the pool,
eval and retrieval indexes and their chunks that the dedup (curation.dedup.knn), decontaminate
(curation.decontaminate.nearest) and rebalance (curation.rebalance.retrieval) steps merge.

One code path for any number of workers: ``curate run`` (and a ``curate dedup`` that finds no
finished search) trains the same index and searches every chunk in its own process as task 0 of 1;
on Slurm, ``curate index`` (one job) and ``curate search knn.task_index=i knn.num_tasks=N`` (an array)
have done that work before, and the finishing job only merges. Hence identical ``decisions.tsv``.
"""

from __future__ import annotations




from curation.decontaminate.nearest import embed_eval, eval_index
from curation.decontaminate.views import eval_targets
from curation.dedup.knn import pool_params, survivors
from curation.knn.jobs import descriptor_dir, digest, row_source
from curation.rebalance.retrieval import step_retrieval_search
from curation.config import DedupConfig, EmbedConfig, HashDedupConfig, KnnConfig, knn_kwargs, task_plan
from curation.dedup.copies import resolve_threshold
from curation.core.embstore import open_embeddings
from curation.knn.index import Rows
from curation.knn.shards import KnnJob
from curation.core.layout import RunLayout


def step_index(out_dir: str, dedup: DedupConfig, hash_dedup: HashDedupConfig, knn_cfg: KnnConfig,
               sources=None, eval_sources=None, embed: EmbedConfig | None = None,
               progress: bool = False, tasks=None, views: bool = True) -> dict:
    """``curate index``: train and save the pool index (and the eval index) once, for the array
    (``tasks``: curation.config.TasksConfig, W add tasks into inverted-list files merged on disk; ``views``:
    ``decontaminate.views``, the eval images embedded as views too)."""
    e, knn = embed or EmbedConfig(), knn_kwargs(knn_cfg)
    emb = open_embeddings(RunLayout(out_dir).embeddings("descriptor"))
    plan = None if tasks is None else task_plan(tasks, len(emb))
    surv, hinfo = survivors(out_dir, emb, sources, dedup, hash_dedup, plan)
    out = {"rows": int(len(surv)), "hash_tasks": hinfo["tasks"]}
    if len(surv) >= 2:
        job = KnnJob(out_dir, "pool")
        params = pool_params(surv, dedup.k, resolve_threshold(dedup.threshold, dedup.verify), dedup.index,
                             dedup.nprobe, knn)
        meta = job.meta() if job.matches(params) else job.build(
            Rows(emb, surv), params, use_gpu=(knn or {}).get("use_gpu", "auto"), progress=progress,
            source=row_source(out_dir, "pool", descriptor_dir(out_dir), surv, "pool"),
            tasks=None if tasks is None else task_plan(tasks, len(surv)))
        out.update(kind=meta["kind"], index_bytes=meta["index_bytes"])
    if eval_sources:
        ev = embed_eval(out_dir, eval_sources, e.batch_size, e.num_workers, progress, dedup.trust_code, views)
        eval_index(out_dir, ev, knn, surv)
        out["eval_rows"] = len(ev)
    return out


def step_search(out_dir: str, dedup: DedupConfig, hash_dedup: HashDedupConfig, knn_cfg: KnnConfig,
                sources=None, progress: bool = False) -> dict:
    """``curate search``: array task ``knn.task_index`` of ``knn.num_tasks`` searches its chunks of the
    pool (copy pairs, and nearest eval images when ``curate index`` built an eval index)."""
    task_index, num_tasks, knn = knn_cfg.task_index, knn_cfg.num_tasks, knn_kwargs(knn_cfg)
    emb = open_embeddings(RunLayout(out_dir).embeddings("descriptor"))
    surv, _ = survivors(out_dir, emb, sources, dedup, hash_dedup)  # saved by `curate index`
    use_gpu = (knn or {}).get("use_gpu", "auto")
    out = {}
    pool_job, eval_job = KnnJob(out_dir, "pool"), KnnJob(out_dir, "eval")
    if len(surv) >= 2:
        if pool_job.meta() is None or pool_job.meta()["params"]["rows"] != digest(surv):
            raise FileNotFoundError(f"{pool_job.dir}: no index for this pool; run `curate index` first")
        out["pool"] = pool_job.search_pairs(Rows(emb, surv), task_index, num_tasks, use_gpu, progress)
    if eval_job.meta() is not None:
        targets, _, _ = eval_targets(out_dir, open_embeddings(RunLayout(out_dir).embeddings("eval")))
        out["eval"] = eval_job.search_nearest(Rows(emb, surv), targets, task_index, num_tasks, progress=progress)
    retrieval = step_retrieval_search(out_dir, task_index, num_tasks, knn, progress)
    if retrieval is not None:
        out["retrieval"] = retrieval
    return out
