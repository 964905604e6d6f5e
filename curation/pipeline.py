"""The curation chain's orchestrator: ``run_steps`` / ``run_curation`` run the steps (one module each:
curation.embed.step, dedup_step, decontaminate_step, rebalance_step, write_step, report_step) over one output folder.

Output folder::

    descriptor.npz              the fitted copy-detection descriptor (shared by all array tasks)
    copy_model.json             the copy model used instead of it (dedup.model), when one was
    embeddings/descriptor/      copy-detection descriptors of the pool (fp16 shards + ids)
    embeddings/model/           backbone embeddings (only with a model embed_fn), for rebalancing
    embeddings/eval/, seeds/    descriptors of eval images / embeddings of seed images
    steps/<step>/<array>.npy    per-step decisions, one memory-mappable array per file (done.json written
                                last), so each step can be rerun alone and a task maps only its rows;
                                a folder's older steps/<step>.npz is still read (curation.core.stepfiles)
    shards/*.tar                the curated webdataset
    manifest.json               input = kept + duplicates + decontaminated + unreadable + not selected
    decisions/part-*.tsv        id, source, status, group_or_reason, by input id (curation.core.decisions)
    decisions.tsv               the parts merged (the same bytes for any number of tasks)

Each step reads the previous steps' files; ``curate embed|dedup|...`` map onto these functions.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Sequence

from dinopipe.config import ConfigError, save_config
from dinopipe.utils.exits import UnfinishedError

from curation.config import CurationConfig, decontam_threshold, kmeans_dir, knn_kwargs, check_launcher, validate
from curation.dedup.copies import resolve_threshold
from curation.rebalance.step import embed_seeds, step_rebalance
from curation.core.stepfiles import step_exists
from curation.core.srun import spool as runner_spool
from curation.core.runner import step_log
from curation.core.supervise import step_named
from curation.core.stepfiles import write_json_atomic
# the steps, one module each; this module orchestrates them
from curation.embed.step import build_tables, step_embed
from curation.dedup.step import step_dedup
from curation.decontaminate.step import step_decontaminate
from curation.write.step import step_write
from curation.core.layout import RunLayout


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
    """< 1: only this fraction of the rows queries the copy search (curation.knn.candidates.queried: a per-row key;
    every row is indexed) -- the growth bench's stand-in for a search this machine cannot run whole at 10M
    rows, said beside its figures; `curate run` queries every row."""

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
    memory (`curate run --progress FILE`; :func:`curation.core.runner.step_log`)."""
    out = cfg.output.dir
    check_launcher(cfg, steps)  # tasks.launcher=srun: inside an allocation of enough tasks, before writing
    from curation.embed.copymodel import check_record_trust  # torch: not imported by the array tasks that never embed

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
            with step_log(progress_log, step), runner_spool(RunLayout(out).steps("srun")), step_named(step):
                result = run_step(step, cfg, embedder, inputs)
        except FileNotFoundError as exc:
            raise missing_file(step, exc, out) from exc
        except ConfigError as exc:  # not RuntimeError / ValueError: faiss, torch, ours
            raise StepError(step, exc) from exc
        if step == "embed" and embedder is not None:
            embedder.release()  # the index steps may want the GPU memory for faiss-gpu
        if step in _SUMMARIZED + SHARDED:
            name = step if step != "search" else f"search-{cfg.knn.task_index:05d}"
            os.makedirs(RunLayout(out).steps(), exist_ok=True)
            write_json_atomic(RunLayout(out).step_json(name), result)
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
    from curation.embed.embedder import build_embedder

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
        from curation.report.step import make_report

        return make_report(out, cfg.input.paths, _params(cfg, out), cfg.report.n_examples, tasks=cfg.tasks,
                           eval_sources=cfg.input.eval_paths or None)
    raise ValueError(f"unknown step '{step}'; choose from {', '.join(STEPS + SHARDED)}")


def _run_sharded(step: str, cfg: CurationConfig, embedder=None) -> dict:
    """`curate index` / `curate search`: the sharded kNN behind dedup, decontamination and retrieval."""
    from curation.index.step import step_index, step_search
    from curation.rebalance.retrieval import step_retrieval_index

    out, prog, sections = cfg.output.dir, cfg.progress, (cfg.dedup, cfg.hash_dedup, cfg.knn)
    if step == "search":
        return step_search(out, *sections, cfg.input.paths, prog)
    w = build_tables(out, cfg.tasks)  # the first step after the embedding array: the path tables as W tasks
    res = step_index(out, *sections, cfg.input.paths, cfg.input.eval_paths or None, cfg.embed, prog, cfg.tasks,
                     cfg.decontaminate.views)
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
    """The settings recorded in manifest.json and the report. The decontamination threshold and whether its matches
    were verified on pixels are the step's, from its summary in ``out`` (steps/decontaminate.json: 0.2 verified,
    0.45 without pixels -- no eval images, or an eval set given as embeddings), else what the config implies."""
    ran: dict = {}
    path = RunLayout(out).steps("decontaminate.json") if out else None
    if path and os.path.exists(path):
        with open(path) as f:
            ran = json.load(f)
    used = ran.get("threshold")
    return {"hash_enabled": cfg.hash_dedup.enabled, "hash_max_distance": cfg.hash_dedup.max_distance,
            "k": cfg.dedup.k, "index": cfg.dedup.index,
            "dedup_threshold": resolve_threshold(cfg.dedup.threshold, cfg.dedup.verify),
            "verify": cfg.dedup.verify, "verify_threshold": cfg.dedup.verify_threshold,
            "grouping": cfg.dedup.grouping, "copy_model": cfg.dedup.model,
            "decontam_threshold": used if used is not None else decontam_threshold(cfg.decontaminate,
                                                                                     cfg.dedup.model is not None),
            "decontam_verify": bool(ran.get("verify", cfg.decontaminate.verify)),
            "decontam_eval": bool(cfg.input.eval_paths),
            "decontam_verify_threshold": cfg.decontaminate.verify_threshold,
            "rebalance_mode": cfg.rebalance.mode,
            "embed_model": cfg.embed.model}


def _load_summaries(out: str) -> dict:
    found = {}
    for step in _SUMMARIZED:
        path = RunLayout(out).step_json(step)
        if os.path.exists(path):
            with open(path) as f:  # without this run's measurements: a rerun's manifest equals the first run's
                found[step] = {k: v for k, v in json.load(f).items() if not _measured(k)}
    return found


def _measured(key: str) -> bool:
    """A step summary's key that measures this run rather than the result (``verify_seconds``; ``kmeans_tasks``:
    each k-means task's wall time and heap, there only when the tree was fitted in this run, not reused): kept
    in ``steps/<step>.json``, left out of manifest.json, which a rerun after a kill must reproduce byte for byte."""
    return key.endswith("_seconds") or key == "kmeans_tasks"
