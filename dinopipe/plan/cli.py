"""``dinopipe plan``: the command line of the planner (the analytic model in ``analytic.py``, distillation configs in
``distill.py``, the traced dry run in ``trace.py``). Kept apart from the arithmetic so that the planner's modules
import each other one way only."""

from __future__ import annotations

from .analytic import plan
from .report import format_report


def main(argv=None) -> int:
    """dinopipe plan --config X.yaml --gpus N --gpu-mem-gb G [--gpu-tflops T --mfu M] [--trace] [key=value ...]

    Memory per GPU, FLOPs and step time of a pretraining config, on paper (--trace: the real step under fake
    tensors). Every config key, its default and what it does: dinopipe config --kind pretrain."""
    import argparse

    from ..config import ConfigError, exit_on_config_error, load_config
    from ..ssl.config import PretrainConfig
    from ..ssl.config_checks import validate
    from ..train.checks import check_backbone

    import dataclasses
    import inspect

    p = argparse.ArgumentParser(prog="dinopipe plan", description=inspect.cleandoc(main.__doc__ or ""),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="pretraining YAML (configs/pretrain/...)")
    p.add_argument("--gpus", type=int, required=True, help="total GPUs (FSDP2 shards over all of them)")
    p.add_argument("--gpu-mem-gb", type=float, required=True, help="memory per GPU in GiB (80 for an A100-80GB)")
    p.add_argument("--gpu-tflops", type=float, default=None, help="dense peak, e.g. 312 (A100 bf16), 989 (H100)")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation for the time estimate")
    p.add_argument("--margin", type=float, default=0.10, help="fragmentation / safety share (default 0.10)")
    p.add_argument("--overhead-gb", type=float, default=1.0, help="CUDA context + NCCL buffers, GiB")
    p.add_argument("--trace", action="store_true",
                   help="also run the real training step as rank 0 of --gpus ranks in this process (fake tensors, "
                        "fake process group) and print its peak memory and collectives beside the planner's figures")
    p.add_argument("--steps", type=int, default=2, help="--trace: real steps to run (2: the second has optimizer state)")
    p.add_argument("--phase", default=None, help="--trace: phase name (default: the first)")
    p.add_argument("--json", default=None, help="--trace: also write the figures to this JSON file")
    p.add_argument("--no-comm-debug", action="store_true",
                   help="--trace: leave torch's CommDebugMode out (its module tracking fails on torch 2.11; the "
                        "collective byte counter runs regardless)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    args = p.parse_args(argv)
    from .distill import is_distill_config

    check_args(args)
    if is_distill_config(args.config):  # students (ViT or timm:NAME) + teacher: parameters, state, FLOPs
        return _main_distill(args)
    try:
        try:
            cfg = load_config(PretrainConfig, args.config, args.overrides)
        except TypeError as exc:  # OmegaConf raises this for e.g. a `phases.0.x=` override into a list
            raise ConfigError(f"overrides {args.overrides}: {exc}") from None
        if abs(sum(ph.fraction for ph in cfg.phases) - 1.0) > 1e-6:
            raise ConfigError("phases: fractions must sum to 1")
        names = [ph.name for ph in cfg.phases]
        if args.phase is not None and args.phase not in names:  # before the planner or the trace runs
            raise ConfigError(f"--phase: no phase '{args.phase}' in {args.config} (phases: {', '.join(names)})")
        # the checks `dinopipe pretrain` runs on the config alone; planning needs no data.paths (none are read)
        validate(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, paths=cfg.data.paths or ["-"])))
        check_backbone(cfg)
        # a ValueError / KeyError from the planner is its own bug (exit 1), never "your mistake"
        r = plan(cfg, args.gpus, args.gpu_mem_gb, args.gpu_tflops, args.mfu, args.margin, args.overhead_gb)
    except ConfigError as exc:
        exit_on_config_error(exc)
    print(format_report(r))
    if args.trace:
        import json

        from .trace import trace

        t = trace(cfg, args.gpus, steps=args.steps, phase=args.phase, comm_debug=not args.no_comm_debug)
        print()
        print(t.report())
        if args.json:
            from ..utils.exits import writing

            with writing(args.json), open(args.json, "w") as f:
                json.dump({**dataclasses.asdict(t), "planner_over_trace": t.planner_ratio,
                           "comm_over_fp32": t.comm_ratio}, f, indent=1)
    return 0


def check_args(args) -> None:
    """The numbers of the command line and --json's folder, before the config is read: exit 2 naming the flag."""
    import os
    from pathlib import Path

    from ..config import ConfigError, exit_on_config_error

    bad = [(flag, got, want) for flag, got, ok, want in (
        ("--gpus", args.gpus, args.gpus >= 1, ">= 1"), ("--gpu-mem-gb", args.gpu_mem_gb, args.gpu_mem_gb > 0, "> 0"),
        ("--gpu-tflops", args.gpu_tflops, args.gpu_tflops is None or args.gpu_tflops > 0, "> 0"),
        ("--mfu", args.mfu, 0 < args.mfu <= 1, "in (0, 1]"), ("--margin", args.margin, 0 <= args.margin < 1, "in [0, 1)"),
        ("--overhead-gb", args.overhead_gb, args.overhead_gb >= 0, ">= 0"), ("--steps", args.steps, args.steps >= 1, ">= 1"),
    ) if not ok]
    try:
        if bad:
            flag, got, want = bad[0]
            raise ConfigError(f"{flag}: must be {want}, got {got}")
        if args.json is not None and not args.trace:
            raise ConfigError("--json: writes the traced figures; give --trace too")
        if args.json is not None:
            parent = Path(args.json).parent
            if Path(args.json).is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK):
                raise ConfigError(f"--json: cannot write '{args.json}' (its folder must exist and be writable)")
    except ConfigError as exc:
        exit_on_config_error(exc)


def _main_distill(args) -> int:
    import sys

    from ..config import ConfigError, exit_on_config_error, load_config
    from ..ssl.distill_config import DistillConfig
    from ..train.distill import check_students
    from .distill import format_distill_report, plan_distill

    if args.trace:
        print("error: --trace runs a pretraining step; a distillation config is planned on paper only", file=sys.stderr)
        return 2
    try:
        try:
            cfg = load_config(DistillConfig, args.config, args.overrides)
        except TypeError as exc:
            raise ConfigError(f"overrides {args.overrides}: {exc}") from None
        check_students(cfg)  # unknown timm names and crops below a CNN's stride: exit 2, as `dinopipe distill`
        r = plan_distill(cfg, args.gpus, args.gpu_mem_gb)  # a ValueError / KeyError here is a bug: exit 1
    except ConfigError as exc:  # e.g. teacher_model.path that names nothing
        exit_on_config_error(exc)
    print(format_distill_report(r))
    return 0


__all__ = ["main"]
