"""The curation steps as plain functions over one output folder, and ``run_curation`` chaining them.

Output folder::

    descriptor.npz              the fitted copy-detection descriptor (shared by all array tasks)
    copy_model.json             the copy model used instead of it (dedup.model), when one was
    embeddings/descriptor/      copy-detection descriptors of the pool (fp16 shards + ids)
    embeddings/model/           backbone embeddings (only with a model embed_fn), for rebalancing
    embeddings/eval/, seeds/    descriptors of eval images / embeddings of seed images
    steps/<step>.npz            per-step decisions, so each step can be rerun alone
    shards/*.tar                the curated webdataset
    manifest.json               input = kept + duplicates + decontaminated + unreadable + not selected
    decisions.tsv               id, source, status, group (kept image of its copy group)

Each step reads the previous steps' files; ``curate embed|dedup|...`` map onto these functions.
"""

from __future__ import annotations

import os
from typing import Callable

import numpy as np

from dinopipe.data.sources import as_multi
from dinopipe.utils.io import atomic_open, atomic_path

from .dedup import resolve_threshold
from .decontaminate import expand_to_components
from .descriptor import DescriptorConfig, PCADescriptor, fit_descriptor
from .embeddings import EmbedTarget, embed_pool, embed_pool_multi, open_embeddings
from .hashdedup import DEFAULT_MAX_DISTANCE
from .index import Rows
from .knn_steps import embed_eval, hash_survivors, sharded_copy_dedup, sharded_nearest_eval
from .rebalance import rebalance
from .verify import DEFAULT_THRESHOLD as DEFAULT_VERIFY_THRESHOLD
from .verify import pixel_verifier
from .write import build_manifest, write_json_atomic, write_shards

KEPT, HASH_DUP, COPY_DUP, DECONTAM, NOT_SELECTED = 0, 1, 2, 3, 4
_STATUS_NAMES = {KEPT: "kept", HASH_DUP: "hash_duplicates", COPY_DUP: "copy_duplicates",
                 DECONTAM: "decontaminated", NOT_SELECTED: "not_selected"}


def _p(out_dir: str, *parts: str) -> str:
    return os.path.join(out_dir, *parts)


def _save_step(out_dir: str, name: str, **arrays) -> None:
    os.makedirs(_p(out_dir, "steps"), exist_ok=True)
    path = _p(out_dir, "steps", f"{name}.npz")
    with atomic_path(path, suffix=".npz") as tmp:
        np.savez(tmp, **arrays)


def load_step(out_dir: str, name: str) -> dict:
    path = _p(out_dir, "steps", f"{name}.npz")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: run the '{name}' step first")
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def get_descriptor(out_dir: str, sources=None, config: DescriptorConfig | None = None
                   ) -> PCADescriptor:
    """Load ``descriptor.npz``, or build/fit and save it (so every array task uses the same)."""
    path = _p(out_dir, "descriptor.npz")
    if os.path.exists(path):
        return PCADescriptor.load(path)
    os.makedirs(out_dir, exist_ok=True)
    desc = fit_descriptor(sources, config) if sources is not None else PCADescriptor(config)
    desc.save(path)
    return desc


def copy_embedder(out_dir: str, sources=None, config: DescriptorConfig | None = None,
                  model: str | None = None, image_size: int = 224, device: str = "auto",
                  precision: str = "auto"):
    """``(embed_fn, transform)`` of the copy space: the copy model recorded in ``out_dir`` (or
    given as ``model``), else the descriptor. Eval and seed images must be embedded alike."""
    from .copymodel import build_copy_embedder, load_record, save_record

    rec = load_record(out_dir)
    if model is not None:
        save_record(out_dir, model, image_size)
    elif rec is not None and rec["model"]:
        model, image_size = rec["model"], rec["image_size"]
    if model is None:
        desc = get_descriptor(out_dir, sources, config)
        return desc, desc.transform()
    emb = build_copy_embedder(model, image_size, device, precision)
    return emb, emb.transform


def step_embed(sources, out_dir: str, model_embed_fn: Callable | None = None,
               model_transform=None, descriptor_config: DescriptorConfig | None = None,
               shard_size: int = 10000, batch_size: int = 64, num_workers: int = 2,
               task_index: int = 0, num_tasks: int = 1, progress: bool = True,
               copy_model: str | None = None, copy_image_size: int = 224,
               device: str = "auto", precision: str = "auto") -> dict:
    """Copy descriptors (+ perceptual hashes) of this task's share of the pool; model embeddings
    too when ``model_embed_fn`` is given. Resumable and split by ``task_index/num_tasks``.
    ``copy_model``: a copy-detection model (TorchScript or ``dinopipe.load``) in place of the
    descriptor (see :mod:`curation.copymodel`)."""
    fn, tf = copy_embedder(out_dir, sources, descriptor_config, copy_model, copy_image_size,
                           device, precision)
    targets = {"descriptor": EmbedTarget(fn, _p(out_dir, "embeddings", "descriptor"), tf, "phash")}
    if model_embed_fn is not None:  # the same decoded image feeds both (one read + decode per image)
        targets["model"] = EmbedTarget(model_embed_fn, _p(out_dir, "embeddings", "model"), model_transform)
    counts = embed_pool_multi(sources, list(targets.values()), shard_size=shard_size, batch_size=batch_size,
                              num_workers=num_workers, task_index=task_index, num_tasks=num_tasks,
                              progress=progress)
    return dict(zip(targets, counts))


def step_dedup(out_dir: str, hash_max_distance: int = DEFAULT_MAX_DISTANCE, k: int = 64,
               threshold: float | None = None, index_kind: str = "auto", nprobe: int = 16,
               progress: bool = True, hash_enabled: bool = True, sources=None,
               verify: bool = True, verify_threshold: float = DEFAULT_VERIFY_THRESHOLD,
               verify_size: int = 128, grouping: str = "star", knn: dict | None = None) -> dict:
    """Hash pre-dedup (unless ``hash_enabled`` is False), then copy dedup of the hash survivors:
    kNN candidates on the copy descriptors through the sharded kNN (curation.knn_steps: the saved
    index and the chunks of `curate search` array tasks are reused, whatever is missing is computed
    here), each verified on the pixels of ``sources`` (unless ``verify`` is False), grouped without
    chaining (``grouping='star'``). ``threshold``: the kNN cosine of candidates (None: 0.45 with
    verification, DINOv2's 0.6 without)."""
    threshold = resolve_threshold(threshold, verify)
    emb = open_embeddings(_p(out_dir, "embeddings", "descriptor"))
    if verify and sources is None:
        raise ValueError("copy verification reads the images again: pass the pool's sources "
                         "(or verify=False to trust the descriptor alone)")
    verify_with = (sources, verify_size, verify_threshold) if verify else None
    h = hash_survivors(emb, hash_enabled, hash_max_distance, verify_with)
    verifier = None
    surv = np.flatnonzero(h.keep)
    if verify:
        verifier = pixel_verifier(sources, emb.ids, surv, verify_size, verify_threshold)
    d = sharded_copy_dedup(out_dir, emb, surv, k, threshold, index_kind, nprobe, knn, progress,
                           verifier=verifier, grouping=grouping)
    component = h.group.copy()  # hash duplicates join their kept image's copy component
    component[surv] = surv[d.component]
    component = component[component]  # a hash group's kept image may itself be a copy
    status = np.full(len(emb), KEPT, np.int8)
    status[~h.keep] = HASH_DUP
    status[surv[~d.keep]] = COPY_DUP
    nn_sim = np.full(len(emb), np.nan, np.float32)
    nn_sim[surv] = d.nn_sim
    _save_step(out_dir, "dedup", status=status, component=component, nn_sim=nn_sim)
    return {"hash_duplicates": h.n_duplicates, "copy_duplicates": d.n_duplicates,
            "index": d.index_kind, "candidates": d.n_candidates, "edges": d.n_edges,
            "threshold": threshold, "verify_seconds": round(d.verify_seconds, 2)}


def step_decontaminate(out_dir: str, eval_sources=None, threshold: float = 0.45,
                       batch_size: int = 64, num_workers: int = 2, progress: bool = True,
                       knn: dict | None = None) -> dict:
    """Drop the copy component of every pool image with cosine > threshold to an eval image."""
    dd = load_step(out_dir, "dedup")
    status, component = dd["status"], dd["component"]
    max_sim = np.full(len(status), np.nan, np.float32)
    n_removed = 0
    if eval_sources:
        ev = embed_eval(out_dir, eval_sources, batch_size, num_workers, progress)
        pool = open_embeddings(_p(out_dir, "embeddings", "descriptor"))
        alive = np.flatnonzero(status != HASH_DUP)  # hash duplicates are gone already
        sim, nearest = (sharded_nearest_eval(out_dir, pool, alive, ev, knn, progress) if len(ev) and len(alive)
                        else (np.full(len(alive), -np.inf), np.full(len(alive), -1, np.int64)))
        res = expand_to_components(sim, nearest, threshold, component[alive])
        max_sim[alive] = res.max_sim
        status[alive[res.removed]] = DECONTAM
        n_removed = res.n_removed
    _save_step(out_dir, "decontaminate", status=status, eval_sim=max_sim)
    return {"decontaminated": n_removed}


def rebalance_rows(out_dir: str):
    """What the rebalance step clusters: (embedding folder, its positions of the rows still kept
    after dedup + decontamination, in pool order, those rows' pool positions, the statuses)."""
    status = load_step(out_dir, "decontaminate")["status"]
    desc_set = open_embeddings(_p(out_dir, "embeddings", "descriptor"))
    model_dir = _p(out_dir, "embeddings", "model")
    space_dir = model_dir if os.path.isdir(model_dir) else _p(out_dir, "embeddings", "descriptor")
    pos_in_space = open_embeddings(space_dir).index_of()
    alive = np.flatnonzero(status == KEPT)
    rows_idx = np.array([pos_in_space[i] for i in desc_set.ids[alive]], np.int64)
    return space_dir, rows_idx, alive, status


def embed_seeds(out_dir: str, seed_sources, seed_embed_fn: Callable | None = None, seed_transform=None,
                batch_size: int = 64, num_workers: int = 2, progress: bool = True):
    """Seed images in the rebalance space (the model's, else the copy space), resumable."""
    use_model = os.path.isdir(_p(out_dir, "embeddings", "model"))
    seed_dir = _p(out_dir, "embeddings", "seeds")
    if use_model and seed_embed_fn is None:
        raise ValueError("seed images must be embedded with the same model as the pool: "
                         "pass seed_embed_fn (and seed_transform)")
    fn, tf = (seed_embed_fn, seed_transform) if use_model else copy_embedder(out_dir)
    embed_pool(seed_sources, fn, seed_dir, batch_size=batch_size, num_workers=num_workers,
               transform=tf, hash_name=None, progress=progress)
    return open_embeddings(seed_dir)


def step_rebalance(out_dir: str, mode: str = "none", seed_sources=None,
                   seed_embed_fn: Callable | None = None, seed_transform=None,
                   batch_size: int = 64, num_workers: int = 2, progress: bool = True,
                   kmeans_dir: str | None = None, knn: dict | None = None, **mode_kwargs) -> dict:
    """Rebalance the survivors on model embeddings (descriptors when no model was embedded).

    ``kmeans_dir``: mode=hierarchical takes its k-means tree from there (written by
    ``python -m curation.dist_kmeans --curate``) after checking it was made for these rows and
    settings, instead of clustering in this process. mode=sample retrieves through the sharded kNN
    (curation.knn_steps.sharded_retrieval: the chunks of `curate search` tasks, else searched here)."""
    space_dir, rows_idx, alive, status = rebalance_rows(out_dir)
    space = open_embeddings(space_dir)
    if kmeans_dir and mode == "hierarchical":
        from .dist_kmeans import curate_settings, load_tree

        mode_kwargs["tree"] = load_tree(kmeans_dir, curate_settings(
            len(rows_idx), space.ids[rows_idx], **mode_kwargs), "rebalance.kmeans_dir")
    seeds, seed_ids = None, np.zeros(0, object)
    if seed_sources:
        seed_set = embed_seeds(out_dir, seed_sources, seed_embed_fn, seed_transform, batch_size,
                               num_workers, progress)
        seeds, seed_ids = Rows(seed_set), seed_set.ids
        if mode == "sample" and len(seed_set) and len(rows_idx):
            from .knn_steps import sharded_retrieval

            mode_kwargs["candidates"] = sharded_retrieval(out_dir, space, rows_idx, seed_set,
                                                          mode_kwargs.get("k", 4), knn, progress)
    res = rebalance(mode, Rows(space, rows_idx), seeds, progress=progress, **mode_kwargs)
    status = status.copy()
    status[alive[~res.selected]] = NOT_SELECTED
    n = len(status)
    cluster = np.full(n, -1, np.int64)
    nearest_seed = np.full(n, "", dtype=object)
    seed_sim = np.full(n, np.nan, np.float32)
    cluster[alive] = res.cluster
    has_seed = res.nearest_seed >= 0
    nearest_seed[alive[has_seed]] = seed_ids[res.nearest_seed[has_seed]]
    seed_sim[alive] = res.seed_sim
    _save_step(out_dir, "rebalance", status=status, cluster=cluster,
               nearest_seed=nearest_seed.astype(str), seed_sim=seed_sim)
    write_json_atomic(_p(out_dir, "steps", "rebalance_report.json"), res.report)
    return res.report


def step_write(sources, out_dir: str, shard_size: int = 1000, extra: dict | None = None,
               progress: bool = False) -> dict:
    """Write kept images as webdataset shards; write manifest.json and decisions.tsv."""
    src = as_multi(sources)
    emb = open_embeddings(_p(out_dir, "embeddings", "descriptor"))
    rb, dd = load_step(out_dir, "rebalance"), load_step(out_dir, "dedup")
    status, component = rb["status"], dd["component"]
    kept = np.flatnonzero(status == KEPT)
    kept = kept[np.argsort(emb.ids[kept].astype(str), kind="stable")]  # stable shard order
    sources_arr = emb.sources
    meta = [{"id": str(emb.ids[i]), "source": str(sources_arr[i]),
             "component": str(emb.ids[component[i]]), "cluster": int(rb["cluster"][i]),
             "nearest_seed": str(rb["nearest_seed"][i]) or None,
             "seed_similarity": _num(rb["seed_sim"][i]), "nn_similarity": _num(dd["nn_sim"][i])}
            for i in kept]
    out = write_shards(src, [m["id"] for m in meta], meta, _p(out_dir, "shards"), shard_size,
                       progress=progress)
    statuses = {str(emb.ids[i]): _STATUS_NAMES[int(s)] for i, s in enumerate(status)}
    srcs = {str(i): str(s) for i, s in zip(emb.ids, sources_arr)}
    reasons = {}
    for image_id, source, reason in emb.unreadable:
        statuses[image_id], srcs[image_id], reasons[image_id] = "unreadable", source, reason
    for image_id, reason in out["failed"]:  # vanished between embedding and writing
        statuses[image_id], reasons[image_id] = "unreadable", reason
    manifest = build_manifest(statuses, srcs, reasons, {
        "shards": [os.path.relpath(s, out_dir) for s in out["shards"]], **(extra or {})})
    write_json_atomic(_p(out_dir, "manifest.json"), manifest)
    group = {str(emb.ids[i]): str(emb.ids[c]) for i, c in enumerate(component)}
    with atomic_open(_p(out_dir, "decisions.tsv")) as f:  # why each image was kept or dropped, for people to grep
        f.write("id\tsource\tstatus\tgroup_or_reason\n")
        for image_id in sorted(statuses):
            why = reasons.get(image_id) or group.get(image_id, "")
            f.write(f"{image_id}\t{srcs[image_id]}\t{statuses[image_id]}\t{why}\n")
    return manifest


def _num(x) -> float | None:
    return None if not np.isfinite(x) else round(float(x), 5)


def run_curation(inputs, out_dir: str, *, eval_sources=None, seed_sources=None,
                 model_embed_fn: Callable | None = None, model_transform=None,
                 descriptor_config: DescriptorConfig | None = None,
                 hash_max_distance: int = DEFAULT_MAX_DISTANCE, k: int = 64,
                 dedup_threshold: float | None = None, decontam_threshold: float = 0.45,
                 index_kind: str = "auto", nprobe: int = 16,
                 rebalance_mode: str = "none", rebalance_kwargs: dict | None = None,
                 embed_shard_size: int = 10000, batch_size: int = 64, num_workers: int = 2,
                 write_shard_size: int = 1000, progress: bool = True, verify: bool = True,
                 verify_threshold: float = DEFAULT_VERIFY_THRESHOLD) -> dict:
    """All steps on one machine: embed -> dedup -> decontaminate -> rebalance -> write."""
    src = as_multi(inputs)
    step_embed(src, out_dir, model_embed_fn, model_transform, descriptor_config,
               embed_shard_size, batch_size, num_workers, progress=progress)
    summary = {"dedup": step_dedup(out_dir, hash_max_distance, k, dedup_threshold, index_kind,
                                   nprobe, progress, sources=src, verify=verify,
                                   verify_threshold=verify_threshold)}
    summary["decontaminate"] = step_decontaminate(out_dir, eval_sources, decontam_threshold,
                                                  batch_size, num_workers, progress)
    summary["rebalance"] = step_rebalance(
        out_dir, rebalance_mode, seed_sources, model_embed_fn, model_transform, batch_size,
        num_workers, progress, **(rebalance_kwargs or {}))
    params = {"hash_max_distance": hash_max_distance, "k": k,
              "dedup_threshold": resolve_threshold(dedup_threshold, verify), "verify": verify,
              "decontam_threshold": decontam_threshold, "rebalance_mode": rebalance_mode}
    return step_write(src, out_dir, write_shard_size, extra={"params": params,
                                                              "steps": summary},
                      progress=progress)
