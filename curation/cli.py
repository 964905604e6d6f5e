"""curate: the curation stage from the command line (also dinopipe curate ...).

    curate run --config configs/curation/default.yaml input.paths=[DIR] output.dir=OUT [k=v ...]
    curate embed|dedup|decontaminate|rebalance|write|report --config ... [k=v ...]
    curate index|search --config ... [knn.task_index=i knn.num_tasks=N]   (the sharded kNN)
    curate plan --pool 142M --dim 1024 --index ivf_pq --tasks 160 [--gpus 160]   (no config)
    curate simulate --n 1000000 --dim 384 --tasks 4 --work DIR   (the chain after embedding on a planted pool)
    torchrun|srun ... curate kmeans [--curate ...]   (distributed hierarchical k-means, curation.kmeans.dist)

Load config -> validate (config mistakes exit 2, before anything is written) -> save the resolved
config into output.dir -> run the step(s) -> print the manifest summary. Each step reads the
previous steps' files in output.dir, so a Slurm array can run embed and one dependent job
the rest (slurm/submit_curation.sh). The steps and their order live in one place,
curation.pipeline.run_steps; this module only parses, validates and prints. Every config key, its
default and what it does: dinopipe config --kind curation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from dinopipe.config import ConfigError, exit_on_config_error, load_config
from dinopipe.logs import setup_logging
from dinopipe.utils.exits import check_writable
from curation.core.layout import RunLayout

# .config and .pipeline import torch (~300 MB): imported where used, so that the task processes that
# `curate simulate` / `curate run` spawn (which import this module as their __main__) do not carry it


def _echo(step: str, result) -> None:
    if step == "report":
        print(f"report: {result}")
    elif step == "write":
        if isinstance(result, dict) and result.get("tasks"):
            print(f"write: tasks {json.dumps(result['tasks'])}")
    else:
        print(f"{step}: {json.dumps(result, default=str)}")
        if isinstance(result, dict) and result.get("selection"):
            print(f"{step}: {result['selection']}")


def _print_manifest(out: str) -> dict:
    with open(RunLayout(out).manifest) as f:
        c = json.load(f)["counts"]
    parts = " + ".join(f"{c[s]} {s}" for s in c if s != "input")
    print(f"curated {out}: {c['input']} input = {parts}")
    print(f"shards: {RunLayout(out).shards()}")
    return c


def _all_unreadable(counts: dict, paths: Sequence[str], out: str) -> bool:
    """Every input failed to decode (wrong files, a broken mount): say so and exit 2 rather than 0 with 0 kept;
    the manifest (which lists each reason) stays written."""
    if not counts.get("input") or counts.get("unreadable", 0) < counts["input"]:
        return False
    print(f"curate: error: input.paths: none of the {counts['input']} files in {', '.join(map(str, paths))} could "
          f"be read as an image (the reasons are in {RunLayout(out).manifest})", file=sys.stderr)
    return True


def _holds_an_image(folder: str) -> bool:
    """Whether the folder (or a folder below it) holds a file with an image extension; stops at the first."""
    from dinopipe.data.sources import IMAGE_EXTENSIONS, extension_of

    for _dirpath, _dirs, files in os.walk(folder):
        if any(extension_of(f) in IMAGE_EXTENSIONS for f in files):
            return True
    return False


def check_inputs(paths: Sequence[str]) -> None:
    """An input folder without a single image is a mistake (a wrong path, an unmounted disk): exit 2 naming it
    before anything is written, rather than an empty dataset later. Tar shards and file lists are read later."""
    for p in paths:
        if os.path.isdir(p) and not any(f.endswith(".tar") for f in os.listdir(p)) and not _holds_an_image(p):
            raise ConfigError(f"input.paths: no image in '{p}' (no .jpg/.png/... file below it, no .tar shard)")


def build_parser() -> argparse.ArgumentParser:
    from curation.pipeline import SHARDED, STEPS

    p = argparse.ArgumentParser(prog="curate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=("run",) + STEPS + SHARDED + ("plan",),
                   help="all steps, or one step alone (plan: see curate plan --help)")
    p.add_argument("--config", default=None, help="YAML (e.g. configs/curation/default.yaml)")
    p.add_argument("--progress", default=None, metavar="FILE",
                   help="append one JSON line per finished step to FILE: its wall time and each task it ran "
                        "(wall time, peak heap and peak RSS)")
    p.add_argument("overrides", nargs="*", help="key.sub=value, e.g. output.dir=OUT")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    setup_logging()
    from dinopipe.utils.exits import run_command  # one contract for every command: docs/exit-codes.md

    return run_command(f"curate {argv[0]}" if argv and not argv[0].startswith("-") else "curate", _main, argv)


def _main(argv: list[str]) -> int:
    if argv[:1] == ["plan"]:
        from curation.plan import main as plan_main

        return plan_main(argv[1:])
    if argv[:1] == ["simulate"]:
        from curation.simulate.run import main as simulate_main

        return simulate_main(argv[1:])
    if argv[:1] == ["kmeans"]:
        return _kmeans(argv[1:])
    from curation.config import CurationConfig, check_launcher, validate
    from curation.pipeline import StepError, build_embedder_for, needs_embedder, run_steps, steps_of

    from curation.core.remote_output import localize, publish

    args = build_parser().parse_intermixed_args(argv)
    try:
        cfg = load_config(CurationConfig, args.config, args.overrides)
        remote_out = localize(cfg)  # output.dir=s3://...: curate in a scratch folder, publish at the end
        validate(cfg, args.command)
        check_writable(cfg.output.dir, "output.dir")  # a file where the folder goes, a read-only disk: before work
        check_launcher(cfg, steps_of(args.command, cfg))  # tasks.launcher=srun: inside a big enough allocation
        if args.command in ("run", "embed"):
            check_inputs(cfg.input.paths)
        embedder = build_embedder_for(cfg) if needs_embedder(cfg, args.command) else None
    except ConfigError as exc:
        exit_on_config_error(exc)
    steps = steps_of(args.command, cfg)
    if embedder is not None:
        print(f"embedder: {embedder}", file=sys.stderr)
    try:
        run_steps(cfg, steps, embedder, args.command, echo=_echo, progress_log=args.progress)
    except StepError as exc:  # e.g. a step not run yet, an input that cannot be read: the user's to fix
        print(exc, file=sys.stderr)
        return 2
    out = cfg.output.dir
    if remote_out is not None:
        # A publish the store does not let finish raises StoreUnavailable (75; the local output stays for the
        # rerun to publish) or StoreRefused (2): run_command prints the one line.
        print(f"published {publish(out, remote_out)} files to {remote_out}", file=sys.stderr)
    if "write" in steps or (args.command == "report" and os.path.exists(RunLayout(out).manifest)):
        if _all_unreadable(_print_manifest(out), cfg.input.paths, out):
            return 2
    return 0


def _kmeans(argv: list[str]) -> int:
    """The distributed k-means under training's launcher (one process group setup, with the srun-step guard)."""
    from dinopipe.train.dist import LaunchError, end_rank, init_distributed

    from curation.kmeans.dist import main as kmeans_main

    try:
        init_distributed("auto")
    except LaunchError as exc:
        print(exc, file=sys.stderr)
        return 2
    ok = False
    try:
        code = kmeans_main(argv)
        ok = True
        return code
    finally:
        end_rank(ok, code if ok else None)


if __name__ == "__main__":
    raise SystemExit(main())
