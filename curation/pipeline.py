"""The curation steps as plain functions over one output folder, and ``run_curation`` chaining them.

Output folder::

    descriptor.npz              the fitted copy-detection descriptor (shared by all array tasks)
    copy_model.json             the copy model used instead of it (dedup.model), when one was
    embeddings/descriptor/      copy-detection descriptors of the pool (fp16 shards + ids)
    embeddings/model/           backbone embeddings (only with a model embed_fn), for rebalancing
    embeddings/eval/, seeds/    descriptors of eval images / embeddings of seed images
    steps/<step>/<array>.npy    per-step decisions, one memory-mappable array per file (done.json written
                                last), so each step can be rerun alone and a task maps only its rows;
                                a folder's older steps/<step>.npz is still read (curation.stepfiles)
    shards/*.tar                the curated webdataset
    manifest.json               input = kept + duplicates + decontaminated + unreadable + not selected
    decisions/part-*.tsv        id, source, status, group_or_reason, by input id (curation.decisions)
    decisions.tsv               the parts merged (the same bytes for any number of tasks)

Each step reads the previous steps' files; ``curate embed|dedup|...`` map onto these functions.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from dinopipe.config import ConfigError, save_config
from dinopipe.utils.exits import UnfinishedError

from .config import (CurationConfig, DecontaminateConfig, DedupConfig, EmbedConfig, HashDedupConfig, KnnConfig,
                     TasksConfig, WriteConfig, decontam_threshold, kmeans_dir, knn_kwargs, task_plan,
                     check_launcher, validate)
from .dedup import resolve_threshold
from .descriptor import DescriptorConfig
from .embeddings import EmbedTarget, build_path_table, embed_pool_multi, open_embeddings
from .knn_steps import embed_eval, hash_survivors, sharded_copy_dedup, sharded_nearest_eval, verifier_factory
from .rebalance_step import embed_seeds, step_rebalance
from .stepfiles import (COPY_DUP, DECONTAM, HASH_DUP, KEPT, NOT_SELECTED, StepWriter,  # noqa: F401
                        _p, _save_step, blocks, copy_embedder, get_descriptor, load_step, positions_where,
                        rebalance_rows, step_dir, step_exists, step_path)
from .decisions import finish_decisions, selection_digest
from .steps.embed_tasks import embed_tasks, embed_with_tasks
from .steps.runner import BLOCK, launch
from .steps.runner import spool as runner_spool
from .steps.runner import run_step as run_tasks
from .steps.runner import step_log
from .steps.supervise import step_named
from .steps.write_tasks import (Selection, _decisions_part_task, _write_inputs, _write_shards_task,  # noqa: F401
                                write_selection, write_task)
from .write import finish_shard_tasks, manifest_from_counts, write_json_atomic

def step_embed(sources, out_dir: str, embed: EmbedConfig | None = None,
               descriptor: DescriptorConfig | None = None, dedup: DedupConfig | None = None,
               embedder: Callable | None = None, progress: bool = True, tasks: TasksConfig | None = None) -> dict:
    """Copy descriptors (+ perceptual hashes) of this task's share of the pool (``embed.task_index`` of
    ``embed.num_tasks``); model embeddings too when an ``embedder`` (the built ``embed.model``, with its
    ``transform``) is given. Resumable. ``dedup.model``: a copy-detection model (TorchScript or
    ``dinopipe.load``) in place of the descriptor (see :mod:`curation.copymodel`). When this process embedded
    the whole pool (``embed.num_tasks`` 1), the path tables follow as ``tasks`` W tasks (:func:`build_tables`;
    after an array of embedding tasks, the first step of the next job builds them)."""
    e, dd = embed or EmbedConfig(), dedup or DedupConfig()
    fn, tf = copy_embedder(out_dir, sources, descriptor, dd.model, dd.image_size, e.device, e.precision,
                           dd.trust_code)
    targets = {"descriptor": EmbedTarget(fn, _p(out_dir, "embeddings", "descriptor"), tf, "phash")}
    if embedder is not None:  # the same decoded image feeds both (one read + decode per image)
        targets["model"] = EmbedTarget(embedder, _p(out_dir, "embeddings", "model"), _transform(embedder))
    w_embed = embed_tasks(out_dir, e, tasks, embedder)
    if w_embed > 1:  # W tasks, each listing and embedding its share (curation.steps.embed_tasks)
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
    ``tasks``' plan (curation.pathtable) unless complete and current; returns the largest W (0: all there)."""
    w = 0
    for name in ("descriptor", "model"):
        d = _p(out_dir, "embeddings", name)
        if os.path.isdir(d) and any(f.endswith(".ids.json") for f in os.listdir(d)):
            w = max(w, build_path_table(d, functools.partial(task_plan, tasks or TasksConfig())))
    return w


def _transform(embedder):
    return getattr(embedder, "transform", None)


@dataclass
class ChainInputs:
    """What the steps after embedding take besides the config and the embeddings folder: the real pool's
    (the defaults) or a simulation's (curation.simulate.chain: generated embeddings, planted truth)."""

    verifier: Callable | None = None
    """``make(out_dir, sources, survivors, size, threshold)`` -> a picklable verifier factory in place of the
    pixel verifier (hash duplicates are then not verified again); None: pixels of ``input.paths``."""
    eval_embedded: bool = False
    """embeddings/eval/ is there already (generated): decontaminate reads it instead of embedding eval_paths."""
    seeds_embedded: bool = False
    """embeddings/seeds/ is there already (generated): the rebalance step reads it instead of embedding seed_paths."""
    query_fraction: float = 1.0
    """< 1: only this fraction of the rows queries the copy search (curation.knn_candidates.queried: a per-row key;
    every row is indexed) -- the growth bench's stand-in for a search this machine cannot run whole at 10M
    rows, said beside its figures; `curate run` queries every row."""


def step_dedup(out_dir: str, dedup: DedupConfig | None = None, hash_dedup: HashDedupConfig | None = None,
               knn: KnnConfig | None = None, sources=None, progress: bool = True,
               tasks: TasksConfig | None = None, make_verifier: Callable | None = None,
               query_fraction: float = 1.0) -> dict:
    """Hash pre-dedup (unless ``hash_dedup.enabled`` is False), then copy dedup of the hash survivors:
    kNN candidates on the copy descriptors through the sharded kNN (curation.knn_steps: the saved
    index and the chunks of `curate search` array tasks are reused, whatever is missing is computed
    here), each verified on the pixels of ``sources`` (unless ``dedup.verify`` is False), grouped
    without chaining (``dedup.grouping='star'``). ``dedup.threshold``: the kNN cosine of candidates
    (None: 0.45 with verification, DINOv2's 0.6 without). ``tasks``: W of the hash dedup, the index add,
    the search and the verification (curation.config.TasksConfig; decisions do not depend on it)."""
    dd, hc = dedup or DedupConfig(), hash_dedup or HashDedupConfig()
    threshold = resolve_threshold(dd.threshold, dd.verify)
    emb = open_embeddings(_p(out_dir, "embeddings", "descriptor"))
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
    knn_d = _knn(knn) if query_fraction >= 1.0 else {**(_knn(knn) or {}), "query_fraction": float(query_fraction)}
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


def _knn(knn: KnnConfig | None) -> dict | None:
    """The ``knn`` dict of curation.knn_steps (None: its defaults)."""
    return None if knn is None else knn_kwargs(knn)


def step_decontaminate(out_dir: str, eval_sources=None, decontaminate: DecontaminateConfig | None = None,
                       embed: EmbedConfig | None = None, knn: KnnConfig | None = None,
                       progress: bool = True, tasks: TasksConfig | None = None, eval_embedded: bool = False,
                       trust_code: bool = False, pool_sources=None) -> dict:
    """Drop the copy component of every pool image whose nearest eval image (cosine > the candidate threshold,
    curation.config.decontam_threshold) is verified on pixels (``decontaminate.verify``: the pixels of
    ``pool_sources`` and ``eval_sources``, curation.decontam_verify; without pixels -- eval_embedded, or verify
    off -- the cosine decides). Eval images embedded with ``embed.batch_size`` / ``embed.num_workers``;
    ``eval_embedded``: read embeddings/eval/ as it is."""
    dc = decontaminate or DecontaminateConfig()
    verify = dc.verify and bool(eval_sources) and pool_sources is not None and not eval_embedded
    threshold = decontam_threshold(dc, os.path.exists(_p(out_dir, "copy_model.json")), verify)
    e = embed or EmbedConfig()
    # every whole-pool array is a mapped file, read and written a block at a time: what this process holds is a
    # block's temporaries and the copy components of the direct eval matches (few), not O(pool)
    dd = load_step(out_dir, "dedup", keys=("status", "component"), mmap=True)
    prev, component = dd["status"], dd["component"]  # component: only the alive rows are read
    n_removed, w, chunks = 0, 0, None
    if eval_sources or eval_embedded:
        ev = open_embeddings(_p(out_dir, "embeddings", "eval")) if eval_embedded else \
            embed_eval(out_dir, eval_sources, e.batch_size, e.num_workers, progress, trust_code)
        pool = open_embeddings(_p(out_dir, "embeddings", "descriptor"))
        scratch = step_dir(out_dir, "decontaminate")
        os.makedirs(scratch, exist_ok=True)
        alive_path = os.path.join(scratch, "alive.scratch.npy")  # hash duplicates are gone already
        alive = positions_where(out_dir, alive_path, prev, lambda b: b != HASH_DUP)
        plan = task_plan(tasks or TasksConfig(), len(alive))
        w = plan["tasks"] if len(ev) and len(alive) else 0
        def stream():  # the saved chunks, a chunk at a time (searched on the first call)
            return (sharded_nearest_eval(out_dir, pool, alive, ev, _knn(knn), progress, plan, stream=True)
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
        # curation.decontaminate.expand_to_components a chunk at a time: the direct matches' components first,
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
    (curation.decontam_verify, W tasks): {"pos", "nearest", "score", "ok"}; 21 B per candidate held."""
    from .decontam_verify import candidate_scores
    from .knn_steps import _digest

    pos, nearest = [], []
    for s, sim, near in chunks:
        sim, near = np.asarray(sim), np.asarray(near)
        hit = np.flatnonzero(sim > threshold)
        pos.append(s + hit)
        nearest.append(near[hit])
    pos = np.concatenate(pos) if pos else np.zeros(0, np.int64)
    nearest = np.concatenate(nearest) if nearest else np.zeros(0, np.int64)
    score = candidate_scores(out_dir, pos, nearest, alive_path, eval_sources, pool_sources, dc,
                             f"{ev.digest}-{_digest(alive)}", plan)
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


def step_write(sources, out_dir: str, write: WriteConfig | None = None, extra: dict | None = None,
               progress: bool = False, num_tasks: int | None = None, tasks: TasksConfig | None = None,
               launcher: str | None = None) -> dict:
    """Write kept images as webdataset shards (``write.shard_size`` images each) and the decisions
    parts, each as W tasks of the step runner (``num_tasks``, else ``tasks``' plan: inline, or W local
    processes), then manifest.json and decisions.tsv. The manifest records W (``tasks.write``).

    The selection (its digest, the kept count, kept rows per block) is computed here once, streamed over the
    memory-mapped status array, and handed to the tasks: each maps only the rows it owns."""
    shard_size = (write or WriteConfig()).shard_size
    sel = write_selection(out_dir, shard_size)
    plan = task_plan(tasks or TasksConfig(), sel.n_kept)
    w = int(num_tasks if num_tasks is not None else plan["tasks"])
    how = launch(launcher or plan["launcher"], w)
    if (write or WriteConfig()).shards:
        run_tasks(_write_shards_task, w, **how, out_dir=out_dir,
                  sources=sources, shard_size=shard_size, progress=progress, selection=sel)
        shards = finish_shard_tasks(out_dir, _p(out_dir, "shards"), sel.n_kept, shard_size, sel.digest)
    else:  # decisions only (write.shards=false)
        shards = {"shards": [], "failed": []}
    emb, rb, dd = _write_inputs(out_dir)
    failed = np.sort(emb.ids[emb.positions_of([f[0] for f in shards["failed"]])]) if shards["failed"] else \
        np.zeros(0, np.int64)  # vanished between embedding and writing: few, by nature
    digest = selection_digest(emb, rb["status"], dd["component"], failed, BLOCK)  # streamed: a block at a time
    del emb, rb, dd
    run_tasks(_decisions_part_task, w, **how, out_dir=out_dir, failed=failed,
             digest=digest)
    per_source, reasons = finish_decisions(out_dir, w)
    manifest = manifest_from_counts(per_source, reasons, {
        "shards": [os.path.relpath(s, out_dir) for s in shards["shards"]], "decisions_parts": w,
        "tasks": {"write": w}, **(extra or {})})
    write_json_atomic(_p(out_dir, "manifest.json"), manifest)
    return manifest


# ----------------------------------------------------------------------------- the orchestrator
# One code path for every way curation runs: `curate run|<step>` (curation.cli), `dinopipe pipeline`
# (through the CLI) and the Slurm finishing job (the CLI once per step, in one process).

STEPS = ("embed", "dedup", "decontaminate", "rebalance", "write", "report")
SHARDED = ("index", "search")  # between embed and dedup, for Slurm arrays; `run` does them in-process
_SUMMARIZED = ("dedup", "decontaminate", "rebalance")  # steps/<step>.json, gathered into the manifest


class StepError(RuntimeError):
    """A step that cannot run because of the user's input (the one before it has not run yet, an input file it
    needs is missing, outputs of another run mixed in): a :class:`ConfigError`, or a ``FileNotFoundError`` that is
    not a file of the output folder (:func:`missing_file`), named with the step (exit 2). Anything else a step
    raises is a bug and propagates (exit 1, please report)."""

    def __init__(self, step: str, exc: Exception) -> None:
        super().__init__(f"curate {step}: error: {exc}")
        self.step = step


def missing_file(step: str, exc: FileNotFoundError, out: str) -> Exception:
    """What a missing file means, in one place: a file of the output folder that the OS did not find (a part, a
    step array, a work file a killed task or job left unwritten) is unfinished work -- exit 75, rerun; anything
    else (an input path of the user's, or a step's own "run the 'X' step first", which names no file) is the
    user's -- exit 2 naming the step."""
    name = exc.filename
    if name and os.path.abspath(os.fspath(name)).startswith(os.path.join(os.path.abspath(out), "")):
        return UnfinishedError(f"step {step}: {name} is missing ({exc.strerror or 'not found'}): a task or job "
                               f"was stopped before it wrote it")
    return StepError(step, exc)


def run_steps(cfg: CurationConfig, steps: Sequence[str], embedder=None, command: str = "run",
              echo: Callable[[str, object], None] | None = None, inputs: ChainInputs | None = None,
              progress_log: str | None = None) -> dict:
    """Run ``steps`` in order with their settings from ``cfg`` (validated); returns each step's result.

    Writes the resolved config into ``output.dir`` first. ``embedder``: the built ``embed.model`` (see
    :func:`build_embedder_for`), needed to embed and to embed seed images like the pool was.
    ``echo(step, result)`` is called after each step (the CLI prints there). ``progress_log``: a JSONL file that
    gets one line per finished step: its wall time and every task it ran, with each task's wall time and peak
    memory (`curate run --progress FILE`; :func:`curation.steps.runner.step_log`)."""
    out = cfg.output.dir
    check_launcher(cfg, steps)  # tasks.launcher=srun: inside an allocation of enough tasks, before writing
    from .copymodel import check_record_trust  # torch: not imported by the array tasks that never embed

    if _embeds_copy_space(cfg, steps):  # the folder's copy model runs only with this run's own opt-in
        try:
            check_record_trust(out, cfg.dedup.trust_code)
        except ConfigError as exc:
            raise StepError(command, exc) from exc
    save_config(cfg, out, header=f"resolved config of `curate {command}`")  # array tasks may race: atomic
    results = {}
    for step in steps:
        try:
            # tasks.launcher=srun: the calls' spec files under steps/srun; a dead task is named with the step
            with step_log(progress_log, step), runner_spool(_p(out, "steps", "srun")), step_named(step):
                result = run_step(step, cfg, embedder, inputs)
        except FileNotFoundError as exc:
            raise missing_file(step, exc, out) from exc
        except ConfigError as exc:  # not RuntimeError / ValueError: faiss, torch, ours
            raise StepError(step, exc) from exc
        if step == "embed" and embedder is not None:
            embedder.release()  # the index steps may want the GPU memory for faiss-gpu
        if step in _SUMMARIZED + SHARDED:
            name = step if step != "search" else f"search-{cfg.knn.task_index:05d}"
            os.makedirs(_p(out, "steps"), exist_ok=True)
            write_json_atomic(_p(out, "steps", f"{name}.json"), result)
        results[step] = result
        if echo is not None:
            echo(step, result)
    return results


def _embeds_copy_space(cfg: CurationConfig, steps: Sequence[str]) -> bool:
    """Whether ``steps`` embed images with the folder's copy model (the pool, eval or seed images)."""
    return "embed" in steps or (bool(cfg.input.eval_paths) and bool({"index", "decontaminate"} & set(steps))) or (
        bool(cfg.input.seed_paths) and bool({"index", "rebalance"} & set(steps)))


def run_curation(cfg: CurationConfig, embedder=None, echo: Callable[[str, object], None] | None = None) -> dict:
    """All steps on one machine (``curate run``): embed -> dedup -> decontaminate -> rebalance -> write
    (-> report unless ``report.enabled`` is false). ``cfg`` is validated here; returns the manifest."""
    validate(cfg, "run")
    if embedder is None and cfg.embed.model is not None:
        embedder = build_embedder_for(cfg)
    return run_steps(cfg, steps_of("run", cfg), embedder, "run", echo)["write"]


def steps_of(command: str, cfg: CurationConfig) -> tuple[str, ...]:
    """The steps a ``curate`` command runs: ``run`` is all of them (the report unless disabled)."""
    if command != "run":
        return (command,)
    return STEPS if cfg.report.enabled else STEPS[:-1]


def needs_embedder(cfg: CurationConfig, command: str) -> bool:
    """The model is needed to embed, and to embed seed images like the pool was."""
    return command in ("run", "embed") or (command == "rebalance" and bool(cfg.input.seed_paths)) or (
        command == "index" and _retrieval(cfg) and step_exists(cfg.output.dir, "decontaminate"))


def build_embedder_for(cfg: CurationConfig):
    """The ``embed.model`` embedder, or None (descriptor only); config mistakes raise ConfigError."""
    if cfg.embed.model is None:
        return None
    from .embedder import build_embedder

    e = cfg.embed
    return build_embedder(e.model, e.image_size, e.device, e.precision)


def run_step(step: str, cfg: CurationConfig, embedder=None, inputs: ChainInputs | None = None):
    """One step with its config sections from ``cfg``; returns the step's summary dict (or a path).
    ``inputs``: a simulation's generated inputs (:class:`ChainInputs`; None: the real pool's)."""
    out, e, prog, dd, knn = cfg.output.dir, cfg.embed, cfg.progress, cfg.dedup, cfg.knn
    inputs = inputs or ChainInputs()
    if step in SHARDED:
        return _run_sharded(step, cfg, embedder)
    if step == "embed":
        return step_embed(cfg.input.paths, out, e, cfg.descriptor, dd, embedder, prog, cfg.tasks)
    if step == "dedup":  # after an array of embedding tasks (or a simulation's generated parts): the tables first
        w = build_tables(out, cfg.tasks)
        res = step_dedup(out, dd, cfg.hash_dedup, knn, cfg.input.paths, prog, cfg.tasks, inputs.verifier,
                         inputs.query_fraction)
        return {**res, "tasks": {**res["tasks"], "table": w}} if w else res  # (after `curate run`'s embed: 0)
    if step == "decontaminate":
        return step_decontaminate(out, cfg.input.eval_paths or None, cfg.decontaminate, e, knn, prog, cfg.tasks,
                                  inputs.eval_embedded, cfg.dedup.trust_code, cfg.input.paths)
    if step == "rebalance":
        return step_rebalance(out, cfg.rebalance, cfg.input.seed_paths or None, embedder, e, knn, prog,
                              kmeans_dir=kmeans_dir(cfg), tasks=cfg.tasks, trust_code=cfg.dedup.trust_code,
                              seeds_embedded=inputs.seeds_embedded)
    if step == "write":
        return step_write(cfg.input.paths, out, cfg.write, progress=prog, tasks=cfg.tasks, extra={
            "params": _params(cfg, out), "steps": _load_summaries(out)})
    if step == "report":
        from .report_step import make_report

        return make_report(out, cfg.input.paths, _params(cfg, out), cfg.report.n_examples, tasks=cfg.tasks,
                           eval_sources=cfg.input.eval_paths or None)
    raise ValueError(f"unknown step '{step}'; choose from {', '.join(STEPS + SHARDED)}")


def _run_sharded(step: str, cfg: CurationConfig, embedder=None) -> dict:
    """`curate index` / `curate search`: the sharded kNN behind dedup, decontamination and retrieval."""
    from .knn_steps import step_index, step_retrieval_index, step_search

    out, prog, sections = cfg.output.dir, cfg.progress, (cfg.dedup, cfg.hash_dedup, cfg.knn)
    if step == "search":
        return step_search(out, *sections, cfg.input.paths, prog)
    w = build_tables(out, cfg.tasks)  # the first step after the embedding array: the path tables as W tasks
    res = step_index(out, *sections, cfg.input.paths, cfg.input.eval_paths or None, cfg.embed, prog, cfg.tasks)
    if w:
        res["table_tasks"] = w
    if _retrieval(cfg) and step_exists(out, "decontaminate"):
        # rerun after decontaminate (the pool/eval indexes are reused): the retrieval index
        embed_seeds(out, cfg.input.seed_paths, embedder, cfg.embed, prog, cfg.dedup.trust_code)
        res.update(step_retrieval_index(out, cfg.rebalance.k, knn_kwargs(cfg), prog))
    return res


def _retrieval(cfg: CurationConfig) -> bool:
    """Sample-based retrieval with seeds: its kNN runs sharded too (`curate index` after decontaminate)."""
    return cfg.rebalance.mode == "sample" and bool(cfg.input.seed_paths)


def _params(cfg: CurationConfig, out: str | None = None) -> dict:
    """The settings recorded in manifest.json and the report. The decontamination threshold is the one the step
    used, from its summary in ``out`` (steps/decontaminate.json: 0.2 with pixel verification, 0.45 without -- an
    eval set given as embeddings has no pixels), else the one the config implies."""
    used = None
    path = _p(out, "steps", "decontaminate.json") if out else None
    if path and os.path.exists(path):
        with open(path) as f:
            used = json.load(f).get("threshold")
    return {"hash_enabled": cfg.hash_dedup.enabled, "hash_max_distance": cfg.hash_dedup.max_distance,
            "k": cfg.dedup.k, "index": cfg.dedup.index,
            "dedup_threshold": resolve_threshold(cfg.dedup.threshold, cfg.dedup.verify),
            "verify": cfg.dedup.verify, "verify_threshold": cfg.dedup.verify_threshold,
            "grouping": cfg.dedup.grouping, "copy_model": cfg.dedup.model,
            "decontam_threshold": used if used is not None else decontam_threshold(cfg.decontaminate,
                                                                                     cfg.dedup.model is not None),
            "decontam_verify": cfg.decontaminate.verify, "decontam_verify_threshold": cfg.decontaminate.verify_threshold,
            "rebalance_mode": cfg.rebalance.mode,
            "embed_model": cfg.embed.model}


def _load_summaries(out: str) -> dict:
    found = {}
    for step in _SUMMARIZED:
        path = _p(out, "steps", f"{step}.json")
        if os.path.exists(path):
            with open(path) as f:  # without this run's measurements: a rerun's manifest equals the first run's
                found[step] = {k: v for k, v in json.load(f).items() if not _measured(k)}
    return found


def _measured(key: str) -> bool:
    """A step summary's key that measures this run rather than the result (``verify_seconds``; ``kmeans_tasks``:
    each k-means task's wall time and heap, there only when the tree was fitted in this run, not reused): kept
    in ``steps/<step>.json``, left out of manifest.json, which a rerun after a kill must reproduce byte for byte."""
    return key.endswith("_seconds") or key == "kmeans_tasks"
