"""The decontamination step of the chain (curation.pipeline runs it): each pool image's nearest eval image,
verified on pixels, and the copy components of the matches removed; writes steps/decontaminate/."""

from __future__ import annotations

import os

import numpy as np

from curation.config import (DecontaminateConfig, EmbedConfig, KnnConfig,
                             TasksConfig, decontam_threshold, task_plan)
from curation.core.embstore import open_embeddings
from curation.decontaminate.nearest import embed_eval, sharded_nearest_eval
from curation.core.stepfiles import StepWriter, blocks, load_step, positions_where, step_dir
from curation.core.status import DECONTAM, HASH_DUP, KEPT
from curation.config import knn_dict
from curation.core.layout import RunLayout


def step_decontaminate(out_dir: str, eval_sources=None, decontaminate: DecontaminateConfig | None = None,
                       embed: EmbedConfig | None = None, knn: KnnConfig | None = None,
                       progress: bool = True, tasks: TasksConfig | None = None, eval_embedded: bool = False,
                       trust_code: bool = False, pool_sources=None) -> dict:
    """Drop the copy component of every pool image whose nearest eval image (cosine > the candidate threshold,
    curation.config.decontam_threshold) is verified on pixels (``decontaminate.verify``: the pixels of
    ``pool_sources`` and ``eval_sources``, curation.decontaminate.verify; without pixels -- eval_embedded, or verify
    off -- the cosine decides). Eval images embedded with ``embed.batch_size`` / ``embed.num_workers``;
    ``eval_embedded``: read embeddings/eval/ as it is."""
    dc = decontaminate or DecontaminateConfig()
    verify = dc.verify and bool(eval_sources) and pool_sources is not None and not eval_embedded
    threshold = decontam_threshold(dc, os.path.exists(RunLayout(out_dir).copy_model), verify)
    e = embed or EmbedConfig()
    # every whole-pool array is a mapped file, read and written a block at a time: what this process holds is a
    # block's temporaries and the copy components of the direct eval matches (few), not O(pool)
    dd = load_step(out_dir, "dedup", keys=("status", "component"), mmap=True)
    prev, component = dd["status"], dd["component"]  # component: only the alive rows are read
    n_removed, w, chunks = 0, 0, None
    if eval_sources or eval_embedded:
        ev = open_embeddings(RunLayout(out_dir).embeddings("eval")) if eval_embedded else \
            embed_eval(out_dir, eval_sources, e.batch_size, e.num_workers, progress, trust_code, dc.views)
        pool = open_embeddings(RunLayout(out_dir).embeddings("descriptor"))
        scratch = step_dir(out_dir, "decontaminate")
        os.makedirs(scratch, exist_ok=True)
        alive_path = os.path.join(scratch, "alive.scratch.npy")  # hash duplicates are gone already
        alive = positions_where(out_dir, alive_path, prev, lambda b: b != HASH_DUP)
        plan = task_plan(tasks or TasksConfig(), len(alive))
        w = plan["tasks"] if len(ev) and len(alive) else 0
        def stream():  # the saved chunks, a chunk at a time (searched on the first call)
            return (sharded_nearest_eval(out_dir, pool, alive, ev, knn_dict(knn), progress, plan, stream=True)
                    if len(ev) and len(alive) else
                    ((s, np.full(t - s, -np.inf), np.full(t - s, -1, np.int64)) for s, t in blocks(len(alive))))
        chunks = stream()
    cand = None
    if chunks is not None and verify:  # the candidates, verified on pixels before anything is written
        cand = _verified(out_dir, chunks, alive, alive_path, threshold, eval_sources, pool_sources, dc, ev, plan)
        chunks = stream()
    out = StepWriter(out_dir, "decontaminate")  # after the search: a wrong input leaves the old step as it was
    status = out.array("status", np.int8, len(prev))
    max_sim = out.array("eval_sim", np.float32, len(prev), fill=np.nan)
    for s, t in blocks(len(prev)):
        status[s:t] = prev[s:t]
    if cand is not None:  # per row: its nearest eval image and the pixel score (NaN: not a candidate)
        nearest_a = out.array("eval_nearest", np.int64, len(prev), fill=-1)
        score_a = out.array("eval_score", np.float32, len(prev), fill=np.nan)
        nearest_a[alive[cand["pos"]]] = cand["nearest"]
        score_a[alive[cand["pos"]]] = cand["score"]
    if chunks is not None:
        # curation.decontaminate.remove.expand_to_components a chunk at a time: the direct matches' components first,
        # marked in a mapped flag per component (a component is named by a row position), so nothing here grows
        # with the matches: a list of them, sorted unique, held 44 MB at 10M rows with 7% of them matching an eval
        # image (46 B per match)
        hit_path = os.path.join(scratch, "hit.scratch.npy")
        hit = np.lib.format.open_memmap(hit_path, mode="w+", dtype=np.bool_, shape=(len(prev),))  # all False
        for s, sim, _nearest in chunks:
            rows = alive[s:s + len(sim)]
            max_sim[rows] = np.asarray(sim, np.float32)
            hit[np.asarray(component[rows[_direct(sim, s, threshold, cand)]])] = True
        # then their whole components. One reason per image, the first step's: a copy duplicate stays a copy
        # duplicate, so the manifest's counts are the step summaries' (decontaminated = kept images removed here).
        for s, t in blocks(len(alive)):
            rows = alive[s:t]
            removed = rows[hit[np.asarray(component[rows])]]
            removed = removed[status[removed] == KEPT]
            status[removed] = DECONTAM
            n_removed += len(removed)
        del alive, hit
        os.remove(alive_path)
        os.remove(hit_path)
    out.finish()
    summary = {"decontaminated": n_removed, "threshold": threshold, "verify": verify, "tasks": {"eval_search": w}}
    if cand is not None:
        summary.update(candidates=int(len(cand["pos"])), verified=int(cand["ok"].sum()),
                       verify_threshold=dc.verify_threshold)
    return summary


def _verified(out_dir: str, chunks, alive, alive_path: str, threshold: float, eval_sources, pool_sources,
              dc: DecontaminateConfig, ev, plan: dict):
    """The candidates of the chunk stream (positions in ``alive`` with cosine > ``threshold``) scored on pixels
    (curation.decontaminate.verify, W tasks): {"pos", "nearest", "score", "ok"}; 21 B per candidate held."""
    from curation.decontaminate.verify import candidate_scores
    from curation.knn.jobs import digest

    pos, nearest = [], []
    for s, sim, near in chunks:
        sim, near = np.asarray(sim), np.asarray(near)
        hit = np.flatnonzero(sim > threshold)
        pos.append(s + hit)
        nearest.append(near[hit])
    pos = np.concatenate(pos) if pos else np.zeros(0, np.int64)
    nearest = np.concatenate(nearest) if nearest else np.zeros(0, np.int64)
    score = candidate_scores(out_dir, pos, nearest, alive_path, eval_sources, pool_sources, dc,
                             f"{ev.digest}-{digest(alive)}", plan)
    return {"pos": pos, "nearest": nearest, "score": score, "ok": score > dc.verify_threshold}


def _direct(sim, start: int, threshold: float, cand: dict | None) -> np.ndarray:
    """The rows of a chunk (first alive position ``start``) that matched an eval image: verified candidates, or
    (no verification) cosine > threshold."""
    sim = np.asarray(sim)
    if cand is None:
        return sim > threshold
    lo, hi = np.searchsorted(cand["pos"], [start, start + len(sim)])
    direct = np.zeros(len(sim), bool)
    direct[cand["pos"][lo:hi][cand["ok"][lo:hi]] - start] = True
    return direct
