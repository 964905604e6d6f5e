"""dinopipe slurm submit --config configs/slurm/X.yaml [--dry-run] [flags] [key=value | STAGE:key=value ...]

Submits the pipeline as a chain of Slurm jobs, each one starting only if the one before succeeded
(--dependency=afterok):

    curate_embed   slurm/curate.sbatch          array: task i embeds 1/N of the pool
    curate_index   slurm/curate_finish.sbatch   (curate.search_tasks > 0) train + save the kNN index once
    curate_search  slurm/curate.sbatch          (curate.search_tasks > 0) array: task i searches its chunks
    curate_prepare slurm/curate_finish.sbatch   (curate.kmeans_tasks > 0, or search_tasks > 0 with
                                                rebalance.mode=sample and seeds) dedup, decontaminate
    curate_retrieval_index / curate_retrieval_search   (search_tasks > 0, mode=sample with seeds) the
                                                seeds' retrieval index, then an array searching seed chunks
    curate_kmeans  slurm/curate_kmeans.sbatch   (curate.kmeans_tasks > 0) srun --ntasks N: the distributed
                                                hierarchical k-means of the survivors (curation.kmeans.dist)
    curate_finish  slurm/curate_finish.sbatch   dedup, decontaminate, rebalance, write shards, report
                                                (after curate_prepare: rebalance, write, report only)
    pretrain       slurm/pretrain.sbatch        --requeue --signal=USR1@<lead>: checkpoint, requeue, resume
    distill        slurm/distill.sbatch         same, teacher = the pretrain run

The stages are chained through output_dir: curation writes output_dir/curated, pretraining reads
its shards/ and writes output_dir/pretrain, distillation uses that as its teacher and writes
output_dir/distill; job logs go to output_dir/logs. Every stage config is loaded with its overrides
before anything is submitted, so a typo exits 2 here rather than hours later in the queue.

key=value overrides this file's config (e.g. slurm.time=04:00:00 stages=[pretrain,distill]);
STAGE:key=value (STAGE = curate | pretrain | distill) is appended to that stage's overrides as is
(e.g. pretrain:train.epochs=10). Flags (--partition, --account, ...) win over both. Prints one
stage: job id line per job (with --dry-run: a shell script of the sbatch commands instead).
Every key of this file, its default and what it does: dinopipe config --kind slurm (a stage's keys:
--kind curation / pretrain / distill).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from ..config import ConfigError, exit_on_config_error, load_config

STAGES = ("curate", "pretrain", "distill")
DEFAULT_SCRIPTS = Path(__file__).resolve().parents[2] / "slurm"  # the repository's slurm/ (this file: dinopipe/app/)


@dataclass
class ClusterConfig:
    """Site settings: every job of the chain gets them (a stage may change `nodes` and `time`)."""

    partition: Optional[str] = None
    """sbatch --partition; null leaves the site default."""
    account: Optional[str] = None
    """sbatch --account; null leaves the site default."""
    qos: Optional[str] = None
    """sbatch --qos; null leaves the site default."""
    nodes: int = 1
    """Nodes per training job (a stage's own nodes overrides it)."""
    gpus_per_node: int = 0
    """0 runs on CPU (one task per node)."""
    tasks_per_node: Optional[int] = None
    """Training tasks per node; default one per GPU (1 without GPUs)."""
    cpus_per_task: int = 8
    """sbatch --cpus-per-task (data workers and decoding run on these)."""
    mem: Optional[str] = None
    """--mem per node, e.g. 64G; null leaves the site default."""
    time: str = "24:00:00"
    """Time limit of each job (HH:MM:SS or D-HH:MM:SS); training jobs requeue themselves before it."""
    env_setup: str = ""
    """Shell line each job runs first, e.g. 'source /path/to/dinopipe/.venv/bin/activate' or 'module load ...'."""
    signal_lead: int = 120
    """Seconds before the time limit at which pretrain/distill get USR1: save, requeue, resume."""
    extra_args: list[str] = field(default_factory=list)
    """More sbatch flags for every job, e.g. ['--constraint=a100', '--exclusive']."""
    scripts_dir: Optional[str] = None
    """Folder with the sbatch scripts; default the repository's slurm/."""


@dataclass
class CurateStageConfig:
    config: str = "configs/curation/default.yaml"
    """Curation YAML (configs/curation/...)."""
    overrides: list[str] = field(default_factory=list)
    """key=value overrides of the curation config."""
    tasks: int = 4
    """Embedding array tasks (each embeds its share of the pool)."""
    gpus_per_task: Optional[int] = None
    """GPUs per embedding task; default 1 when slurm.gpus_per_node > 0, else 0."""
    time: Optional[str] = None
    """Time limit of each embedding task (default slurm.time); the finishing job gets the same."""
    search_tasks: int = 0
    """kNN search array tasks after a `curate index` job (sharded dedup/decontamination kNN, same
    decisions for any count); 0 runs the kNN inside the finishing job. See `curate plan`."""
    kmeans_tasks: int = 0
    """Processes (srun --ntasks) of a distributed hierarchical k-means job between decontamination and
    the rebalancing (rebalance.mode=hierarchical; the same selection as in one process, written to
    output.dir/kmeans unless rebalance.kmeans_dir is set); 0 clusters inside the finishing job."""
    finish_tasks: int = 0
    """Slurm tasks (--ntasks, possibly on several nodes) of the finishing jobs (index, prepare, finish): curate
    runs with tasks.launcher=srun tasks.count=N, each sharded step after embedding as one `srun --ntasks=N`
    step over them; 0: one task, the steps as local processes on its node."""


@dataclass
class TrainStageConfig:
    config: str = ""
    """The stage's YAML (configs/pretrain/... or configs/distill/...)."""
    overrides: list[str] = field(default_factory=list)
    """key=value overrides of that config."""
    nodes: Optional[int] = None
    """Default slurm.nodes."""
    time: Optional[str] = None
    """Default slurm.time."""


@dataclass
class SlurmConfig:
    output_dir: str = "runs/slurm"
    """Root of the chain: curated/, pretrain/, distill/ and logs/ go under it."""
    input_paths: list[str] = field(default_factory=list)
    """Image folders / file lists / tar shards to curate (curation's input.paths)."""
    stages: list[str] = field(default_factory=lambda: list(STAGES))
    """Jobs to submit, chained with afterok: curate, pretrain, distill."""
    slurm: ClusterConfig = field(default_factory=ClusterConfig)
    curate: CurateStageConfig = field(default_factory=CurateStageConfig)
    pretrain: TrainStageConfig = field(default_factory=lambda: TrainStageConfig(config="configs/pretrain/quickstart.yaml"))
    distill: TrainStageConfig = field(default_factory=lambda: TrainStageConfig(config="configs/distill/quickstart.yaml"))


@dataclass
class Job:
    """One sbatch call: its name in the chain, extra environment, sbatch flags, script and script args."""

    name: str
    env: dict[str, str]
    flags: list[str]
    script: Path
    args: list[str]
    after: Optional[str] = None
    """The job (by chain name) that must succeed first."""

    def argv(self, ids: dict[str, str]) -> list[str]:
        dep = [f"--dependency=afterok:{ids[self.after]}"] if self.after else []
        return ["sbatch", "--parsable", *dep, *self.flags, str(self.script), *self.args]


# ---------------------------------------------------------------------------------------------


def stage_overrides(cfg: SlurmConfig) -> dict[str, list[str]]:
    """Each stage's key=value list: the paths that chain the stages first, then the user's (which win)."""
    root = cfg.output_dir.rstrip("/") or "/"
    curated, pretrain_dir = f"{root}/curated", f"{root}/pretrain"
    out = {"curate": [f"output.dir={curated}"], "pretrain": [f"train.output_dir={pretrain_dir}"],
           "distill": [f"train.output_dir={root}/distill"]}
    if cfg.input_paths:
        out["curate"].append(f"input.paths=[{','.join(cfg.input_paths)}]")
    if "curate" in cfg.stages:
        out["pretrain"].append(f"data.paths=[{curated}/shards]")
        out["distill"].append(f"data.paths=[{curated}/shards]")
    if "pretrain" in cfg.stages:
        out["distill"].append(f"teacher_model.path={pretrain_dir}")
    for stage in STAGES:
        out[stage] += list(getattr(cfg, stage).overrides)
    return out


def validate(cfg: SlurmConfig, overrides: dict[str, list[str]], check_paths: bool = True) -> None:
    """Load every stage config that will run, with its overrides: a mistake fails here, naming the stage.
    ``check_paths``: the images to curate must exist (left out for --dry-run, e.g. away from the cluster)."""
    bad = [s for s in cfg.stages if s not in STAGES]
    if bad or not cfg.stages:
        raise ConfigError(f"stages: expected a non-empty subset of {list(STAGES)}, got {cfg.stages}")
    if [s for s in STAGES if s in cfg.stages] != list(cfg.stages):
        raise ConfigError(f"stages: list them in pipeline order {list(STAGES)}, got {cfg.stages}")
    s = cfg.slurm
    for key, val in (("slurm.nodes", s.nodes), ("slurm.cpus_per_task", s.cpus_per_task),
                     ("slurm.signal_lead", s.signal_lead), ("curate.tasks", cfg.curate.tasks)):
        if val < 1:
            raise ConfigError(f"{key}: must be >= 1, got {val}")
    if cfg.curate.search_tasks < 0:
        raise ConfigError(f"curate.search_tasks: must be >= 0 (0: kNN in the finishing job), got {cfg.curate.search_tasks}")
    if cfg.curate.finish_tasks < 0:
        raise ConfigError(f"curate.finish_tasks: must be >= 0 (0: one task), got {cfg.curate.finish_tasks}")
    if cfg.curate.kmeans_tasks < 0:
        raise ConfigError(f"curate.kmeans_tasks: must be >= 0 (0: k-means in the finishing job), got {cfg.curate.kmeans_tasks}")
    if s.gpus_per_node < 0:
        raise ConfigError(f"slurm.gpus_per_node: must be >= 0, got {s.gpus_per_node}")
    for stage in cfg.stages:
        path = getattr(cfg, stage).config
        try:
            if stage == "curate":
                from curation.config import CurationConfig, validate as check

                c = load_config(CurationConfig, path, [*overrides[stage], f"embed.num_tasks={cfg.curate.tasks}"])
                if c.input.paths:
                    check(c, "embed" if check_paths else "dedup")  # `dedup` does not look at input.paths
            elif stage == "pretrain":
                from ..ssl.config import PretrainConfig
                from ..ssl.config_checks import validate as check

                check(load_config(PretrainConfig, path, overrides[stage]))
            else:
                from ..ssl.distill_config import DistillConfig, validate as check

                check(load_config(DistillConfig, path, overrides[stage]))
        except ConfigError as exc:
            raise ConfigError(f"{stage} stage ({path}): {exc}") from None
        if stage == "curate" and not c.input.paths:
            raise ConfigError("input_paths: give the images to curate, e.g. input_paths=[/data/images]")
        if stage == "curate" and cfg.curate.kmeans_tasks and c.rebalance.mode != "hierarchical":
            raise ConfigError(f"curate.kmeans_tasks: the distributed k-means serves rebalance.mode=hierarchical, "
                              f"the curation config has mode={c.rebalance.mode}")


def _site_flags(s: ClusterConfig, time: str) -> list[str]:
    flags = [f"--time={time}", f"--cpus-per-task={s.cpus_per_task}"]
    for opt, val in (("partition", s.partition), ("account", s.account), ("qos", s.qos), ("mem", s.mem)):
        if val:
            flags.append(f"--{opt}={val}")
    return flags + list(s.extra_args)


def log_dir(cfg: SlurmConfig) -> str:
    return f"{cfg.output_dir.rstrip('/')}/logs"


def _sample_retrieval(c: "CurateStageConfig", overrides: list[str]) -> bool:
    """Whether the curation config retrieves with seeds (rebalance.mode=sample + input.seed_paths)."""
    from curation.config import CurationConfig

    cc = load_config(CurationConfig, c.config, [*overrides, f"embed.num_tasks={c.tasks}"])
    return cc.rebalance.mode == "sample" and bool(cc.input.seed_paths)


def build_jobs(cfg: SlurmConfig, overrides: dict[str, list[str]]) -> list[Job]:
    """The chain, in submission order; each job depends on the one before it."""
    s = cfg.slurm
    scripts = Path(s.scripts_dir) if s.scripts_dir else DEFAULT_SCRIPTS
    logs = log_dir(cfg)
    jobs: list[Job] = []

    def add(name: str, env: dict, flags: list, script: str, args: list) -> None:
        jobs.append(Job(name, env, flags, scripts / script, args, after=jobs[-1].name if jobs else None))

    if "curate" in cfg.stages:
        c = cfg.curate
        gpus = c.gpus_per_task if c.gpus_per_task is not None else (1 if s.gpus_per_node > 0 else 0)
        # no CURATE_CMD: the embed tasks run `curate`, the finishing job all its steps in one python process
        env = {"CURATE_SETUP": s.env_setup, "CURATE_NUM_TASKS": str(c.tasks)}
        site = _site_flags(s, c.time or s.time) + ([f"--gpus-per-task={gpus}"] if gpus else [])
        args = ["--config", c.config, *overrides["curate"]]
        add("curate_embed", env, ["--job-name=dinopipe-curate-embed", f"--array=0-{c.tasks - 1}", "--requeue",
                                  *site, f"--output={logs}/%x-%A_%a.out"], "curate.sbatch", args)
        # the finishing jobs on N Slurm tasks: their steps' tasks as srun steps over them (0: one task)
        fin = [f"--ntasks={c.finish_tasks}"] if c.finish_tasks else []
        srun = ["tasks.launcher=srun", f"tasks.count={c.finish_tasks}"] if c.finish_tasks else []
        if c.search_tasks:  # the sharded kNN: index once, then an array searching query chunks
            add("curate_index", {**env, "CURATE_STEPS": "index"},
                ["--job-name=dinopipe-curate-index", *site, *fin, f"--output={logs}/%x-%j.out"],
                "curate_finish.sbatch", args + srun)
            add("curate_search", {**env, "CURATE_STEP": "search"},
                ["--job-name=dinopipe-curate-search", f"--array=0-{c.search_tasks - 1}", "--requeue", *site,
                 f"--output={logs}/%x-%A_%a.out"], "curate.sbatch", args)
        finish_env = env
        if c.search_tasks and _sample_retrieval(c, overrides["curate"]):
            # seeds retrieve among the images kept after decontamination: a second index + search pass
            # (`curate index` adds the retrieval index, the array searches seed chunks; pool chunks on
            # disk are skipped), then the finishing job only merges the retrieval candidates
            add("curate_prepare", {**env, "CURATE_STEPS": "dedup decontaminate"},
                ["--job-name=dinopipe-curate-prepare", *site, *fin, f"--output={logs}/%x-%j.out"],
                "curate_finish.sbatch", args + srun)
            add("curate_retrieval_index", {**env, "CURATE_STEPS": "index"},
                ["--job-name=dinopipe-curate-retrieval-index", *site, *fin, f"--output={logs}/%x-%j.out"],
                "curate_finish.sbatch", args + srun)
            add("curate_retrieval_search", {**env, "CURATE_STEP": "search"},
                ["--job-name=dinopipe-curate-retrieval-search", f"--array=0-{c.search_tasks - 1}", "--requeue",
                 *site, f"--output={logs}/%x-%A_%a.out"], "curate.sbatch", args)
            finish_env = {**env, "CURATE_STEPS": "rebalance write report"}
        if c.kmeans_tasks:  # survivors known after decontamination -> k-means on N ranks -> select
            add("curate_prepare", {**env, "CURATE_STEPS": "dedup decontaminate"},
                ["--job-name=dinopipe-curate-prepare", *site, *fin, f"--output={logs}/%x-%j.out"],
                "curate_finish.sbatch", args + srun)
            if not any(a.startswith("rebalance.kmeans_dir=") for a in args):
                args = [*args, "rebalance.kmeans_dir=kmeans"]  # under output.dir
            add("curate_kmeans", env, ["--job-name=dinopipe-curate-kmeans", f"--ntasks={c.kmeans_tasks}", *site,
                                       f"--output={logs}/%x-%j.out"], "curate_kmeans.sbatch", args)
            finish_env = {**env, "CURATE_STEPS": "rebalance write report"}
        add("curate_finish", finish_env, ["--job-name=dinopipe-curate-finish", *site, *fin,
                                          f"--output={logs}/%x-%j.out"], "curate_finish.sbatch", args + srun)
    for stage in ("pretrain", "distill"):
        if stage not in cfg.stages:
            continue
        t: TrainStageConfig = getattr(cfg, stage)
        tasks = s.tasks_per_node or max(s.gpus_per_node, 1)
        flags = [f"--job-name=dinopipe-{stage}", f"--nodes={t.nodes or s.nodes}", f"--ntasks-per-node={tasks}",
                 # explicit even when 0: it replaces the script's GPU default
                 f"--gpus-per-node={s.gpus_per_node}", *_site_flags(s, t.time or s.time),
                 "--requeue", f"--signal=USR1@{s.signal_lead}", "--open-mode=append", f"--output={logs}/%x-%j.out"]
        add(stage, {"DINOPIPE_ENV": s.env_setup}, flags, f"{stage}.sbatch", ["--config", t.config, *overrides[stage]])
    return jobs


def dry_run_script(jobs: list[Job], logs: str) -> str:
    """The chain as a shell script that would submit it (each id kept in a shell variable for the next)."""
    lines = ["#!/bin/bash", "set -euo pipefail", f"mkdir -p {shlex.quote(logs)}  # Slurm does not create it"]
    for job in jobs:
        words = [f"{k}={shlex.quote(v)}" for k, v in job.env.items()] + ["sbatch", "--parsable"]
        if job.after:
            words.append(f'"--dependency=afterok:${{{job.after}}}"')
        words += [shlex.quote(a) for a in (*job.flags, str(job.script), *job.args)]
        lines.append(f"{job.name}=$({' '.join(words)})")
        lines.append(f'{job.name}=${{{job.name}%%;*}}; echo "{job.name}: ${{{job.name}}}"')
    return "\n".join(lines) + "\n"


def submit(jobs: list[Job], logs: str) -> dict[str, str]:
    """Submit in order; returns chain name -> job id. Stops at the first sbatch error (exit status 1)."""
    ids: dict[str, str] = {}
    os.makedirs(logs, exist_ok=True)  # Slurm does not create the folders of --output
    base = {k: v for k, v in os.environ.items() if k != "CONFIG"}  # pretrain.sbatch would read a stray CONFIG
    for job in jobs:
        r = subprocess.run(job.argv(ids), env={**base, **job.env}, capture_output=True, text=True)
        if r.returncode != 0:
            done = ", ".join(f"{k}={v}" for k, v in ids.items()) or "none"
            cancel = f"; cancel them with: scancel {' '.join(ids.values())}" if ids else ""
            raise SystemExit(f"error: sbatch for {job.name} failed ({r.stderr.strip() or r.returncode}); "
                             f"already submitted: {done}{cancel}")
        ids[job.name] = r.stdout.strip().split(";")[0]  # "id;cluster" on multi-cluster sites
        print(f"{job.name}: {ids[job.name]}", flush=True)
    return ids


def _split_overrides(items: Sequence[str]) -> tuple[list[str], dict[str, list[str]]]:
    own, per_stage = [], {s: [] for s in STAGES}
    for item in items:
        head, sep, rest = item.partition(":")
        if sep and head in STAGES and "=" not in head:
            per_stage[head].append(rest)
        else:
            own.append(item)
    return own, per_stage


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dinopipe slurm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["submit"], help="submit: the curate -> pretrain -> distill chain")
    p.add_argument("--config", required=True, help="e.g. configs/slurm/quickstart.yaml")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch commands, submit nothing")
    p.add_argument("--partition", help="slurm.partition")
    p.add_argument("--account", help="slurm.account")
    p.add_argument("--nodes", type=int, help="slurm.nodes (pretrain and distill)")
    p.add_argument("--gpus-per-node", type=int, help="slurm.gpus_per_node (0 = CPU)")
    p.add_argument("--time", help="slurm.time, e.g. 24:00:00")
    p.add_argument("--env", help="slurm.env_setup, e.g. 'source .venv/bin/activate'")
    p.add_argument("overrides", nargs="*", help="key=value for this config, STAGE:key=value for a stage")
    return p


def load(args: argparse.Namespace) -> SlurmConfig:
    own, per_stage = _split_overrides(args.overrides)
    cfg = load_config(SlurmConfig, args.config, own)
    for flag, key in (("partition", "partition"), ("account", "account"), ("nodes", "nodes"),
                      ("gpus_per_node", "gpus_per_node"), ("time", "time"), ("env", "env_setup")):
        if getattr(args, flag) is not None:
            setattr(cfg.slurm, key, getattr(args, flag))
    for stage, items in per_stage.items():
        getattr(cfg, stage).overrides.extend(items)
    return cfg


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    try:
        cfg = load(args)
        overrides = stage_overrides(cfg)
        validate(cfg, overrides, check_paths=not args.dry_run)
    except ConfigError as exc:
        exit_on_config_error(exc)
    jobs = build_jobs(cfg, overrides)
    missing = [str(j.script) for j in jobs if not j.script.is_file()]
    if missing:
        print(f"error: sbatch script(s) not found: {', '.join(missing)}; set slurm.scripts_dir to the repository's "
              "slurm/ folder", file=sys.stderr)
        return 1
    logs = log_dir(cfg)
    if args.dry_run:
        print(dry_run_script(jobs, logs), end="")
        return 0
    if shutil.which("sbatch") is None:
        print("error: sbatch not found: run this on a Slurm login node (or start a local cluster: "
              "slurm/local_cluster.sh start), or use --dry-run", file=sys.stderr)
        return 1
    ids = submit(jobs, logs)
    print(f"logs in {logs}/; follow with: squeue -j {','.join(ids.values())}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
