"""``curate``: the curation stage from the command line (also ``dinopipe curate ...``).

    curate run --config configs/curation/default.yaml input.paths=[DIR] output.dir=OUT [k=v ...]
    curate embed|dedup|decontaminate|rebalance|write|report --config ... [k=v ...]
    curate index|search --config ... [knn.task_index=i knn.num_tasks=N]   (the sharded kNN)
    curate plan --pool 142M --dim 1024 --index ivf_pq --tasks 160 [--gpus 160]   (no config)

Load config -> validate (config mistakes exit 2, before anything is written) -> save the resolved
config into output.dir -> run the step(s) -> print the manifest summary. Each step reads the
previous steps' files in output.dir, so a Slurm array can run ``embed`` and one dependent job
the rest (slurm/submit_curation.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from dinopipe.config import ConfigError, exit_on_config_error, load_config, to_yaml
from dinopipe.logs import setup_logging

from .config import CurationConfig, kmeans_dir, knn_kwargs, rebalance_kwargs, validate

STEPS = ("embed", "dedup", "decontaminate", "rebalance", "write", "report")
SHARDED = ("index", "search")  # between embed and dedup, for Slurm arrays; `run` does them in-process


def _embedder(cfg: CurationConfig):
    if cfg.embed.model is None:
        return None
    from .embedder import build_embedder

    e = cfg.embed
    return build_embedder(e.model, e.image_size, e.device, e.precision)


def _params(cfg: CurationConfig) -> dict:
    from .dedup import resolve_threshold

    return {"hash_enabled": cfg.hash_dedup.enabled, "hash_max_distance": cfg.hash_dedup.max_distance,
            "k": cfg.dedup.k, "index": cfg.dedup.index,
            "dedup_threshold": resolve_threshold(cfg.dedup.threshold, cfg.dedup.verify),
            "verify": cfg.dedup.verify, "verify_threshold": cfg.dedup.verify_threshold,
            "grouping": cfg.dedup.grouping, "copy_model": cfg.dedup.model,
            "decontam_threshold": cfg.decontaminate.threshold, "rebalance_mode": cfg.rebalance.mode,
            "embed_model": cfg.embed.model}


def _save_summary(out: str, step: str, result: dict) -> None:
    from .write import write_json_atomic

    os.makedirs(os.path.join(out, "steps"), exist_ok=True)
    write_json_atomic(os.path.join(out, "steps", f"{step}.json"), result)


def _load_summaries(out: str) -> dict:
    found = {}
    for step in STEPS[1:4]:
        path = os.path.join(out, "steps", f"{step}.json")
        if os.path.exists(path):
            with open(path) as f:
                found[step] = json.load(f)
    return found


def run_step(step: str, cfg: CurationConfig, embedder=None):
    """One step with its settings from ``cfg``; returns the step's summary dict (or a path)."""
    from . import pipeline as P
    from .dedup import resolve_threshold

    out, e, prog = cfg.output.dir, cfg.embed, cfg.progress
    h, dd, knn = cfg.hash_dedup, cfg.dedup, knn_kwargs(cfg)
    # index, search and dedup must agree on the hash survivors (hash duplicates are verified too)
    verify_with = (cfg.input.paths, dd.verify_size, dd.verify_threshold) if dd.verify else None
    if step == "index":
        from .knn_steps import step_index

        res = step_index(out, h.enabled, h.max_distance, dd.k, resolve_threshold(dd.threshold, dd.verify),
                         dd.index, dd.nprobe, knn, cfg.input.eval_paths or None, e.batch_size,
                         e.num_workers, prog, verify_with=verify_with)
        if _retrieval(cfg) and os.path.exists(os.path.join(out, "steps", "decontaminate.npz")):
            # rerun after decontaminate (the pool/eval indexes are reused): the retrieval index
            from .knn_steps import step_retrieval_index

            P.embed_seeds(out, cfg.input.seed_paths, embedder, getattr(embedder, "transform", None),
                          e.batch_size, e.num_workers, prog)
            res.update(step_retrieval_index(out, cfg.rebalance.k, knn, prog))
        return res
    if step == "search":
        from .knn_steps import step_search

        return step_search(out, cfg.knn.task_index, cfg.knn.num_tasks, h.enabled, h.max_distance, knn, prog,
                           verify_with=verify_with)
    if step == "embed":
        return P.step_embed(cfg.input.paths, out, embedder, getattr(embedder, "transform", None),
                            cfg.descriptor, e.shard_size, e.batch_size, e.num_workers,
                            e.task_index, e.num_tasks, progress=prog, copy_model=cfg.dedup.model,
                            copy_image_size=cfg.dedup.image_size, device=e.device,
                            precision=e.precision)
    if step == "dedup":
        return P.step_dedup(out, h.max_distance, dd.k, dd.threshold, dd.index, dd.nprobe, prog,
                            h.enabled, sources=cfg.input.paths, verify=dd.verify,
                            verify_threshold=dd.verify_threshold, verify_size=dd.verify_size,
                            grouping=dd.grouping, knn=knn)
    if step == "decontaminate":
        return P.step_decontaminate(out, cfg.input.eval_paths or None, cfg.decontaminate.threshold,
                                    e.batch_size, e.num_workers, prog, knn=knn)
    if step == "rebalance":
        return P.step_rebalance(out, cfg.rebalance.mode, cfg.input.seed_paths or None, embedder,
                                getattr(embedder, "transform", None), e.batch_size, e.num_workers,
                                prog, kmeans_dir=kmeans_dir(cfg), knn=knn,
                                **rebalance_kwargs(cfg.rebalance))
    if step == "write":
        return P.step_write(cfg.input.paths, out, cfg.write.shard_size, progress=prog, extra={
            "params": _params(cfg), "steps": _load_summaries(out)})
    if step == "report":
        from .report import make_report

        return make_report(out, cfg.input.paths, _params(cfg), cfg.report.n_examples)
    raise ValueError(step)


def _retrieval(cfg: CurationConfig) -> bool:
    """Sample-based retrieval with seeds: its kNN runs sharded too (`curate index` after decontaminate)."""
    return cfg.rebalance.mode == "sample" and bool(cfg.input.seed_paths)


def _print_manifest(out: str) -> None:
    with open(os.path.join(out, "manifest.json")) as f:
        c = json.load(f)["counts"]
    parts = " + ".join(f"{c[s]} {s}" for s in c if s != "input")
    print(f"curated {out}: {c['input']} input = {parts}")
    print(f"shards: {os.path.join(out, 'shards')}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="curate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("run",) + STEPS + SHARDED + ("plan",),
                   help="all steps, or one step alone (plan: see `curate plan --help`)")
    p.add_argument("--config", default=None, help="YAML (e.g. configs/curation/default.yaml)")
    p.add_argument("overrides", nargs="*", help="key.sub=value, e.g. output.dir=OUT")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    setup_logging()
    if argv[:1] == ["plan"]:
        from .plan import main as plan_main

        return plan_main(argv[1:])
    args = build_parser().parse_intermixed_args(argv)
    try:
        cfg = load_config(CurationConfig, args.config, args.overrides)
        validate(cfg, args.command)
        # the model is needed to embed, and to embed seed images like the pool was
        needs_model = args.command in ("run", "embed") or (
            args.command == "rebalance" and bool(cfg.input.seed_paths)) or (
            args.command == "index" and _retrieval(cfg)
            and os.path.exists(os.path.join(cfg.output.dir, "steps", "decontaminate.npz")))
        embedder = _embedder(cfg) if needs_model else None
    except ConfigError as exc:
        exit_on_config_error(exc)
    out = cfg.output.dir
    _save_config(cfg, out, args.command)
    steps = STEPS if args.command == "run" else (args.command,)
    if args.command == "run" and not cfg.report.enabled:
        steps = STEPS[:-1]
    if embedder is not None:
        print(f"embedder: {embedder}", file=sys.stderr)
    for step in steps:
        try:
            result = run_step(step, cfg, embedder)
        except (FileNotFoundError, RuntimeError, ValueError) as exc:  # e.g. a step not run yet
            print(f"curate {step}: error: {exc}", file=sys.stderr)
            return 1
        if step == "embed" and embedder is not None:
            embedder.release()  # the index steps may want the GPU memory for faiss-gpu
        if step in STEPS[1:4] + SHARDED:
            _save_summary(out, step if step != "search" else f"search-{cfg.knn.task_index:05d}", result)
        if step == "report":
            print(f"report: {result}")
        elif step != "write":
            print(f"{step}: {json.dumps(result, default=str)}")
    if "write" in steps or (args.command == "report" and os.path.exists(
            os.path.join(out, "manifest.json"))):
        _print_manifest(out)
    return 0


def _save_config(cfg: CurationConfig, out: str, command: str) -> None:
    """The resolved config of the latest command (atomic; array tasks may race on it)."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "config.yaml")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"# resolved config of `curate {command}`\n{to_yaml(cfg)}")
    os.replace(tmp, path)


if __name__ == "__main__":
    raise SystemExit(main())
