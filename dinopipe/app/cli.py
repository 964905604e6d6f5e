"""dinopipe command line. Stage commands read one config (YAML + key=value overrides); errors in it
exit with code 2 before any work starts (exit codes: docs/exit-codes.md).

    dinopipe models                                   list registry variants
    dinopipe export --model PATH --format timm --out DIR
    dinopipe export --model PATH --format onnx|pt2 --out FILE.onnx|FILE.pt2   deployable graph
    dinopipe config --kind pretrain                   every key of a config kind, its default, what it does
    dinopipe config --kind pretrain --config X.yaml k=v   check a config and print it resolved
    dinopipe pipeline --config configs/pipeline/quickstart.yaml   curate -> pretrain -> distill -> eval
    dinopipe pretrain --config configs/pretrain/X.yaml [key=value ...]
    dinopipe distill --config configs/distill/X.yaml [key=value ...]
    dinopipe plan --config X.yaml --gpus N --gpu-mem-gb G [--gpu-tflops T --mfu M] [--trace] [key=value ...]
    dinopipe curate ...                               same as the curate command
    dinopipe eval knn|linear|seg --model PATH --train SRC --val SRC [--out results.json]
    dinopipe slurm submit --config configs/slurm/X.yaml [--dry-run] [key=value | STAGE:key=value ...]
    dinopipe gpu-check [--out gpu-check] [--cpu]      GPU acceptance check (report.json; exit 1 on failure)
    dinopipe channel-stats PATH... --channels N [--sample 512]   per-channel mean/std as config keys
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, Sequence

from ..config import ConfigError, ModelConfig, exit_on_config_error, format_reference, load_config, to_yaml
from ..logs import setup_logging



def _schema(kind: str) -> type:
    """The config dataclass of each kind `dinopipe config --kind` knows (imported only when asked for)."""
    if kind == "pretrain":
        from ..ssl.config import PretrainConfig as schema
    elif kind == "distill":
        from ..ssl.distill_config import DistillConfig as schema
    elif kind == "curation":
        from curation.config import CurationConfig as schema
    elif kind == "pipeline":
        from .pipeline import PipelineConfig as schema
    elif kind == "slurm":
        from .slurm import SlurmConfig as schema
    elif kind == "depth":
        from ..eval.depth_run import DepthConfig as schema
    elif kind == "seg":
        from ..eval.head_configs import SegHeadsConfig as schema
    elif kind == "detect":
        from ..eval.head_configs import DetectConfig as schema
    else:
        schema = ModelConfig
    return schema


# Config kinds `dinopipe config --kind` knows: the stage commands and the model section.
SCHEMAS: dict[str, Callable[[], type]] = {k: (lambda k=k: _schema(k))
                                          for k in ("pretrain", "distill", "curation", "pipeline", "slurm", "model", "depth",
                                                    "seg", "detect")}


def _cmd_models(args: argparse.Namespace) -> int:
    from ..models import list_models, model_defaults

    for name in list_models():
        d = model_defaults(name)
        print(f"{name:16s} dim={d['embed_dim']:<5d} depth={d['depth']:<3d} heads={d['num_heads']:<3d} "
              f"patch={d['patch_size']} registers={d['num_register_tokens']} ffn={d['ffn']}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from ..export import export
    from ..hub import CheckpointError, load

    if args.image_size is not None and args.format not in ("onnx", "pt2"):
        print(f"error: --image-size only applies to --format onnx | pt2 (weights in the '{args.format}' "
              f"layout have no input size); drop it", file=sys.stderr)
        return 2
    from ..utils.exits import check_writable

    check_writable(args.out, "--out")  # before the model is read: a file where the folder goes, a read-only disk
    try:
        model = load(args.model, num_heads=args.num_heads, which=args.which)
    except (CheckpointError, OSError) as exc:  # nothing there, or nothing dinopipe can read: the user's to fix
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from ..utils.exits import writing

    try:
        with writing(args.out):  # a full disk or a read-only folder: exit 2 naming --out, not a bug
            if args.format in ("onnx", "pt2"):  # deployable graphs (dinopipe/export/onnx.py), not weight layouts
                from ..export.onnx import export_onnx, export_program

                out = (export_onnx if args.format == "onnx" else export_program)(model, args.out, args.image_size)
            else:
                out = export(model, args.format, args.out)
    except ValueError as exc:  # e.g. a layout that cannot hold this architecture: choose another format
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _cmd_channel_stats(args: argparse.Namespace) -> int:
    import numpy as np

    from ..data.channels import channel_stats
    from ..data.loader import list_pool

    if not 1 <= args.channels <= 16 or args.sample < 1:
        print(f"error: need --channels in 1-16 and --sample >= 1, got {args.channels} and {args.sample}",
              file=sys.stderr)
        return 2
    try:
        refs, read = list_pool(args.paths)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    pick = np.sort(np.random.default_rng(args.seed).permutation(len(refs))[:args.sample])
    try:
        mean, std, used, skipped = channel_stats((read(refs[i]) for i in pick), args.channels)
    except ValueError as exc:
        print(f"error: {exc} (is --channels right?)", file=sys.stderr)
        return 2

    def fmt(v: list) -> str:
        return "[" + ",".join(f"{x:.6g}" for x in v) + "]"  # no spaces: one shell word

    print(f"# {used} of {len(refs)} images sampled (seed {args.seed}); {skipped} unreadable or not "
          f"{args.channels}-channel", file=sys.stderr)
    print(f"data.channels={args.channels} data.mean={fmt(mean)} data.std={fmt(std)}")
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    if args.kind not in SCHEMAS:
        print(f"error: unknown --kind '{args.kind}'; choose from {sorted(SCHEMAS)}", file=sys.stderr)
        return 2
    schema = SCHEMAS[args.kind]()
    if args.config is None and not args.overrides:  # the reference: every key, its default, what it does
        print(f"# dinopipe config --kind {args.kind}: every key (KEY = DEFAULT  what it does); set them in the YAML "
              f"or as KEY=VALUE on the command line")
        print(format_reference(schema), end="")
        return 0
    try:
        cfg = load_config(schema, args.config, args.overrides)
    except ConfigError as exc:
        exit_on_config_error(exc)
    print(to_yaml(cfg), end="")
    return 0


def _stage(name: str) -> Callable[[Sequence[str]], int]:
    """Stage commands parse their own arguments (a config file plus key=value overrides)."""

    def run(argv: Sequence[str]) -> int:
        if name == "curate":
            from curation.cli import main as stage_main
        elif name == "pretrain":
            from ..train.pretrain import main as stage_main
        elif name == "plan":
            from ..plan import main as stage_main
        elif name == "distill":
            from ..train.distill import main as stage_main
        elif name == "pipeline":
            from .pipeline import main as stage_main
        elif name == "eval":
            from ..eval.cli import main as stage_main
        elif name == "slurm":
            from .slurm import main as stage_main
        elif name == "gpu-check":
            from .gpu_check import main as stage_main
        return stage_main(list(argv))

    return run


STAGES = ("curate", "pretrain", "distill", "eval", "plan", "pipeline", "slurm", "gpu-check")
_STAGE_HELP = {"eval": "kNN / linear / segmentation probe of a frozen backbone "
                       "(knn|linear|seg --model PATH --train SRC --val SRC)",
               "slurm": "submit curate -> pretrain -> distill to Slurm (submit --config configs/slurm/X.yaml [--dry-run])",
               "gpu-check": "GPU acceptance check, JSON report, non-zero exit on failure ([--out DIR] [--cpu])"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dinopipe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for stage in STAGES:  # listed for --help; main() hands their arguments over untouched
        sub.add_parser(stage, help=_STAGE_HELP.get(stage, f"run the {stage} stage (--config FILE key=value ...)"),
                       add_help=False)

    sub.add_parser("models", help="list the built-in backbones (registry variants)",
                   description="List the backbones dinopipe can build by name (model.name=NAME in a config, or "
                   "dinopipe.load('NAME') for a randomly initialised one): width, depth, heads, patch size, "
                   "register tokens and feed-forward layer of each.").set_defaults(func=_cmd_models)

    e = sub.add_parser("export", help="export a backbone for timm / HF transformers / DINOv2 / DINOv3 / "
                       "plain safetensors, or as an ONNX / torch.export graph")
    e.add_argument("--model", required=True, help="anything dinopipe.load accepts")
    e.add_argument("--format", required=True,
                   choices=["timm", "hf", "dinov2", "dinov3", "safetensors", "dinopipe", "onnx", "pt2"],
                   help="weight layouts, or deployable graphs: onnx (onnxruntime) | pt2 (torch.export program)")
    e.add_argument("--out", required=True, help="output folder (or .pth file for --format dinov2 / dinov3)")
    e.add_argument("--which", default=None,
                   help="backbone of a run: teacher (default) | student, or a distillation student's name")
    e.add_argument("--image-size", type=int, default=None,
                   help="onnx / pt2: example size traced (any multiple of the patch size runs; default 4 patches)")
    e.add_argument("--num-heads", type=int, default=None, help="only for foreign files with non-64-dim heads")
    e.set_defaults(func=_cmd_export)

    cs = sub.add_parser("channel-stats", help="per-channel mean / std of a pool sample, printed as config keys",
                        description="Read a random sample of the pool (folders, file lists, .tar shards; npy / "
                        "TIFF tiles of any bit depth) with N channels and print data.channels, data.mean and "
                        "data.std as key=value overrides to paste into a config (docs/multichannel.md).")
    cs.add_argument("paths", nargs="+", help="image folders, file lists or shard paths")
    cs.add_argument("--channels", type=int, required=True, help="channels per image (1-16)")
    cs.add_argument("--sample", type=int, default=512, help="images read (a seeded random sample)")
    cs.add_argument("--seed", type=int, default=0)
    cs.set_defaults(func=_cmd_channel_stats)

    c = sub.add_parser("config", help="list every config key with its default and what it does, or check a "
                       "config file and print it resolved",
                       description="Without --config or overrides: every key of that kind of config, with its "
                       "default and a one-line description. With them: the config checked and printed resolved.")
    c.add_argument("--kind", default="model", choices=sorted(SCHEMAS),
                   help="pretrain | distill | curation | pipeline | slurm | model | depth | seg | detect (default: model)")
    c.add_argument("--config", default=None, help="a YAML file of that kind to check and print resolved")
    c.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    c.set_defaults(func=_cmd_config)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    setup_logging()
    from ..utils.exits import run_command  # one contract for every command: docs/exit-codes.md

    if argv and argv[0] in STAGES:
        return run_command(f"dinopipe {argv[0]}", _stage(argv[0]), argv[1:])
    args = build_parser().parse_args(argv)
    return run_command(f"dinopipe {args.command}", args.func, args)


if __name__ == "__main__":
    raise SystemExit(main())
