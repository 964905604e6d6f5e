"""The rebalance step of the chain (curation.pipeline runs it): the survivors of dedup + decontamination clustered
by the sharded k-means tree (or retrieved around seed images) and a balanced selection of them, written as the
step's arrays a block at a time (curation.core.stepfiles.StepWriter); and the seed images it retrieves around."""

from __future__ import annotations

import functools
import os
from typing import Callable

import numpy as np

from dinopipe.config import ConfigError

from curation.config import EmbedConfig, KnnConfig, RebalanceConfig, TasksConfig, knn_kwargs, rebalance_kwargs, task_plan
from curation.embed.embeddings import embed_pool
from curation.core.embstore import open_embeddings
from curation.knn.index import Rows
from curation.rebalance.modes import rebalance as select
from curation.core.stepfiles import StepWriter, blocks, rebalance_rows, step_dir
from curation.core.status import NOT_SELECTED
from curation.embed.copyspace import copy_embedder
from curation.core.stepfiles import write_json_atomic
from curation.core.layout import RunLayout


def embed_seeds(out_dir: str, seed_sources, embedder: Callable | None = None, embed: EmbedConfig | None = None,
                progress: bool = True, trust_code: bool = False):
    """Seed images in the rebalance space (the model's, else the copy space), resumable. ``trust_code``: this
    run's ``dedup.trust_code`` (a TorchScript copy model named by the folder runs only with it)."""
    e = embed or EmbedConfig()
    use_model = os.path.isdir(RunLayout(out_dir).embeddings("model"))
    seed_dir = RunLayout(out_dir).embeddings("seeds")
    if use_model and embedder is None:
        raise ConfigError("seed images must be embedded with the same model as the pool: "
                         "pass the embedder (embed.model) the pool was embedded with")
    fn, tf = (embedder, getattr(embedder, "transform", None)) if use_model else copy_embedder(out_dir, trust_code=trust_code)
    embed_pool(seed_sources, fn, seed_dir, batch_size=e.batch_size, num_workers=e.num_workers,
               transform=tf, hash_name=None, progress=progress)
    return open_embeddings(seed_dir)


def step_rebalance(out_dir: str, rebalance: RebalanceConfig | None = None, seed_sources=None,
                   embedder: Callable | None = None, embed: EmbedConfig | None = None,
                   knn: KnnConfig | None = None, progress: bool = True, kmeans_dir: str | None = None,
                   tasks: TasksConfig | None = None, trust_code: bool = False, seeds_embedded: bool = False) -> dict:
    """Rebalance the survivors on model embeddings (descriptors when no model was embedded).

    ``kmeans_dir``: mode=hierarchical takes its k-means tree from there (written by
    ``curate kmeans --curate``) after checking it was made for these rows and settings; without it the
    tree is clustered here by the sharded k-means as ``tasks`` W ranks (curation.kmeans.tree).
    mode=sample retrieves through the sharded kNN
    (curation.rebalance.retrieval.sharded_retrieval: the chunks of `curate search` tasks, else searched here)."""
    r = rebalance or RebalanceConfig()
    mode, mode_kwargs = r.mode, rebalance_kwargs(r)
    scratch = step_dir(out_dir, "rebalance")  # the kept rows' positions: mapped scratch files in the step's folder
    os.makedirs(scratch, exist_ok=True)
    space_dir, rows_idx, alive, prev = rebalance_rows(out_dir, scratch=scratch)
    space = open_embeddings(space_dir)
    plan = task_plan(tasks or TasksConfig(), len(rows_idx))
    tree_tasks = []
    if mode == "hierarchical":
        from curation.kmeans import hierarchical as _km
        from curation.kmeans.dist import curate_settings, load_tree
        from curation.core.rows import Gathered
        from curation.kmeans.tree import fit_tree
        from curation.kmeans.sampling import sharded_pick

        # the random pick within clusters: three passes as W tasks
        mode_kwargs["picker"] = functools.partial(sharded_pick, folder=RunLayout(out_dir).steps("sample"),
                                                  tasks=plan["tasks"], launcher=plan["launcher"])
        # the k-means tree: rows and centroids sharded over the W tasks (the same tree for any W)
        record = curate_settings(len(rows_idx), Gathered(space.ids, rows_idx), **mode_kwargs, block=_km.BLOCK)
        if kmeans_dir:
            mode_kwargs["tree"] = load_tree(kmeans_dir, record, "rebalance.kmeans_dir")
        elif len(rows_idx):
            mode_kwargs["tree"], tree_tasks = fit_tree(RunLayout(out_dir).steps("kmeans"), space_dir, rows_idx, record,
                                                       plan["tasks"], plan["launcher"])
    seeds = None
    if seed_sources:
        seed_set = open_embeddings(RunLayout(out_dir).embeddings("seeds")) if seeds_embedded else \
            embed_seeds(out_dir, seed_sources, embedder, embed, progress, trust_code)  # generated: a simulation's
        seeds = Rows(seed_set)
        if mode == "sample" and len(seed_set) and len(rows_idx):
            from curation.rebalance.retrieval import sharded_retrieval

            mode_kwargs["candidates"] = sharded_retrieval(out_dir, space, rows_idx, seed_set, r.k,
                                                          None if knn is None else knn_kwargs(knn),
                                                          progress, plan, space_dir)
    tree_tasks += _row_tasks(out_dir, mode, mode_kwargs, space_dir, rows_idx, scratch, seeds is not None, plan)
    # the result's per-row columns: mapped files in the step's folder, not arrays in this process
    res = select(mode, Rows(space, rows_idx), seeds, progress=progress, scratch=scratch, **mode_kwargs)
    # the step's arrays written in place a block at a time (mapped files, not whole arrays in this process)
    out, n, n_pool = StepWriter(out_dir, "rebalance"), len(prev), len(rows_idx)
    status = out.array("status", np.int8, n)
    cluster = out.array("cluster", np.int64, n, fill=-1)
    nearest_seed = out.array("nearest_seed", np.int64, n, fill=-1)  # row of embeddings/seeds (its id: seeds' table)
    seed_sim = out.array("seed_sim", np.float32, n, fill=np.nan)
    for s, t in blocks(n):
        status[s:t] = prev[s:t]
    for s, t in blocks(len(alive)):
        rows, near = alive[s:t], res.nearest_seed[s:t]
        status[rows[~res.selected[s:t]]] = NOT_SELECTED
        cluster[rows] = res.cluster[s:t]
        nearest_seed[rows[near >= 0]] = near[near >= 0]
        seed_sim[rows] = res.seed_sim[s:t]
    n_selected = int(res.selected.sum())
    del rows_idx, alive
    res.selected = res.nearest_seed = res.seed_sim = res.cluster = None  # unmapped before their files go
    for f in os.listdir(scratch):
        if f in ("alive.scratch.npy", "rows.scratch.npy") or f.startswith("result-"):
            os.remove(os.path.join(scratch, f))
    out.finish()
    if tree_tasks:  # what each k-means task took (curation.core.runner): its own heap, not the orchestrator's
        res.report["kmeans_tasks"] = [{"task": t["task"], "wall_s": t["wall_s"], "heap_bytes": t["peak_anon"] - t["start_anon"],
                                       **t["result"]} for t in tree_tasks]
    res.report["tasks"] = {"kmeans": len(tree_tasks) or (plan["tasks"] if mode == "hierarchical" else 0),
                           "sample": plan["tasks"] if mode == "hierarchical" else 0}
    res.report["selection"] = _selection_note(r, n_pool, n_selected)
    write_json_atomic(RunLayout(out_dir).steps("rebalance_report.json"), res.report)
    return res.report


def _row_tasks(out_dir: str, mode: str, kw: dict, space_dir: str, rows_idx, scratch: str, has_seeds: bool,
               plan: dict) -> list[dict]:
    """The other modes' row work as W tasks (curation.rebalance.tasks), handed to the selection through
    ``kw``: the cluster mode's k-means and pick, the ``balance_clusters`` k-means, the nearest seed of every selected
    row. Returns the k-means tasks' runner reports."""
    from curation.rebalance.tasks import flat_kmeans, sharded_nearest_seed
    from curation.kmeans.sampling import sharded_pick

    w, launcher, reports = plan["tasks"], plan["launcher"], []
    if not len(rows_idx):
        return reports
    if hasattr(rows_idx, "flush"):
        rows_idx.flush()  # the tasks map the positions from the scratch file
    if mode == "cluster":
        kw["cluster_level"], got = flat_kmeans(RunLayout(out_dir).steps("kmeans_cluster"), space_dir, rows_idx,
                                               kw["n_clusters"], kw["seed"], kw.get("kmeans"), w, launcher)
        kw["picker"] = functools.partial(sharded_pick, folder=RunLayout(out_dir).steps("sample"), tasks=w,
                                         launcher=launcher)
        reports += got
    if kw.get("balance_clusters") is not None:
        level, got = flat_kmeans(RunLayout(out_dir).steps("kmeans_balance"), space_dir, rows_idx, kw["balance_clusters"],
                                 kw["seed"], kw.get("kmeans"), w, launcher)
        kw["balance_labels"] = (level.labels, len(level.sizes))
        reports += got
    if has_seeds and mode != "sample":
        kw["attach"] = functools.partial(sharded_nearest_seed, folder=RunLayout(out_dir).steps("nearest_seed"),
                                         space_dir=space_dir, rows_path=os.path.join(scratch, "rows.scratch.npy"),
                                         seed_dir=RunLayout(out_dir).embeddings("seeds"), tasks=w, launcher=launcher)
    return reports


def _selection_note(r: RebalanceConfig, n_pool: int, n_kept: int) -> str:
    """How many images rebalancing keeps and why, in words (the log and the report print it)."""
    if r.mode == "hierarchical":
        why = ("rebalance.target_size is null: half of the deduplicated pool (set rebalance.target_size "
               "to keep more)" if r.target_size is None else f"rebalance.target_size={r.target_size}")
    else:
        why = f"rebalance.mode={r.mode}"
    return f"rebalancing keeps {n_kept} of {n_pool} images after dedup + decontamination ({why})"
