"""dinopipe eval knn|linear|seg|detect --model PATH --train SRC --val SRC [--out results.json]

SRC is a folder of class sub-folders or webdataset .tar shards with a label per sample (see
dinopipe.eval.data). PATH is anything dinopipe.load accepts. Results are printed as a table and, with
--out, written as JSON. For seg SRC is a dense set, images/X.jpg + masks/X.png (class indices,
255 = ignore; see dinopipe.eval.dense_data), and the head linear on frozen patch tokens or a feature pyramid into
UperNet / Mask2Former (mIoU). For detect SRC is a COCO JSON (dinopipe.eval.coco; mAP by pycocotools).
Exit codes (docs/exit-codes.md): 0 done, 2 a mistake in the arguments, the data or the model file (one line),
1 a bug to report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from ..logs import setup_logging
from .data import LabelError, LabelledImages, open_labelled


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="dinopipe export/run dir, DINOv2 .pth, timm file, registry name")
    p.add_argument("--train", required=True, help="labelled training images (class folders or .tar shards)")
    p.add_argument("--val", required=True, help="labelled validation images")
    p.add_argument("--out", default=None, help="write results here as JSON")
    p.add_argument("--img-size", type=int, default=None, help="centre-crop size (default: the model's img_size)")
    p.add_argument("--avgpool", action="store_true", help="concatenate the average patch token to the CLS token")
    p.add_argument("--batch-size", type=int, default=64, help="images per forward")
    p.add_argument("--workers", type=int, default=4, help="DataLoader workers decoding images")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--num-heads", type=int, default=None, help="only for foreign files with non-64-dim heads")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dinopipe eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="task", required=True)
    k = sub.add_parser("knn", help="weighted kNN on L2-normalised frozen features (DINO protocol)")
    _common(k)
    k.add_argument("--k", type=int, nargs="+", default=[10, 20], help="numbers of neighbours")
    k.add_argument("--temperature", type=float, default=0.07, help="vote weight exp(sim / T)")
    lin = sub.add_parser("linear", help="linear probe on frozen features, lr sweep selected on a held-out split")
    _common(lin)
    lin.add_argument("--lrs", type=float, nargs="+", default=None, help="learning rates to sweep")
    lin.add_argument("--wds", type=float, nargs="+", default=[0.0], help="weight decays to sweep")
    lin.add_argument("--epochs", type=int, default=50)
    lin.add_argument("--probe-batch-size", type=int, default=512, help="features per optimiser step")
    lin.add_argument("--holdout", type=float, default=0.1, help="fraction of train held out to pick lr/wd")
    lin.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    lin.add_argument("--no-refit", action="store_true",
                     help="report the sweep's head instead of retraining on all train")
    seg = sub.add_parser("seg", help="linear segmentation probe on frozen patch tokens (mIoU), images/ + masks/")
    seg.add_argument("--model", required=True, help="dinopipe export/run dir, DINOv2 .pth, timm file, registry name")
    seg.add_argument("--train", required=True, help="dense set: images/X.jpg + masks/X.png (class indices)")
    seg.add_argument("--val", required=True, help="dense set for mIoU")
    seg.add_argument("--out", default=None, help="a folder: OUT/metrics.json (+ OUT/predictions/X.png); "
                     "a name ending in .json: the results as that one file")
    seg.add_argument("--img-size", type=int, default=None, help="square resize (default: the model's img_size)")
    seg.add_argument("--epochs", type=int, default=100)
    seg.add_argument("--lr", type=float, default=1e-2, help="AdamW learning rate of the linear head")
    seg.add_argument("--no-bn", action="store_true", help="linear layer only (no BatchNorm before it)")
    seg.add_argument("--batch-size", type=int, default=16, help="images per forward / probe step")
    seg.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    seg.add_argument("--num-heads", type=int, default=None, help="only for foreign files with non-64-dim heads")
    seg.add_argument("--head", choices=["linear", "upernet", "m2f"], default="linear",
                     help="linear probe, or a feature pyramid into UperNet / Mask2Former (docs/eval.md)")
    seg.add_argument("--save-predictions", action="store_true", help="OUT/predictions/X.png (class indices)")
    seg.add_argument("--backbone-lr", type=float, default=0.0, help="tune the backbone at this lr (0: frozen)")
    seg.add_argument("--channels", type=int, default=256, help="pyramid / decoder width of upernet and m2f")
    seg.add_argument("--config", default=None, help="the pyramid heads' path: YAML of the keys beyond these flags "
                     "(dinopipe config --kind seg)")
    seg.add_argument("overrides", nargs="*", help="key=value overrides of those keys (e.g. m2f.num_queries=50)")
    det = sub.add_parser("detect", help="a ViTDet pyramid into torchvision's Faster R-CNN / Mask R-CNN / FCOS, "
                                        "COCO JSON in, COCO mAP out (pycocotools)")
    det.add_argument("--model", required=True, help="dinopipe export/run dir, DINOv2 .pth, timm file, registry name")
    det.add_argument("--train", required=True, help="COCO instances JSON (file_name relative to its folder)")
    det.add_argument("--val", required=True, help="COCO instances JSON scored with pycocotools")
    det.add_argument("--out", required=True, help="folder: OUT/predictions.json (COCO results), OUT/metrics.json")
    det.add_argument("--head", choices=["fasterrcnn", "maskrcnn", "fcos"], default="fasterrcnn")
    det.add_argument("--images", default=None, help="folder file_name is relative to (default: the JSON's)")
    det.add_argument("--img-size", type=int, default=None, help="shorter image side (default: the model's img_size)")
    det.add_argument("--epochs", type=int, default=12)
    det.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate of the pyramid and detector")
    det.add_argument("--backbone-lr", type=float, default=0.0, help="tune the backbone at this lr (0: frozen)")
    det.add_argument("--channels", type=int, default=256, help="pyramid width")
    det.add_argument("--batch-size", type=int, default=4, help="images per step")
    det.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    det.add_argument("--num-heads", type=int, default=None, help="only for foreign files with non-64-dim heads")
    det.add_argument("--config", default=None, help="YAML of the keys beyond these flags (dinopipe config --kind "
                     "detect)")
    det.add_argument("overrides", nargs="*", help="key=value overrides of those keys (e.g. train.weight_decay=0.05)")
    _depth_parser(sub)
    return p


def _print_detect(res: dict) -> None:
    for k, v in res.items():
        if k.startswith(("bbox_", "segm_")):
            print(f"{k:>12} {'-' if v is None else f'{100 * v:.2f}'}")


def _depth_parser(sub) -> None:
    """`eval depth` (issue 50): a depth head (linear bins / DPT) on the backbone; flags override --config's keys."""
    d = sub.add_parser("depth", help="train + evaluate a depth head (linear bins or DPT), images/ + depth/")
    d.add_argument("--model", required=True, help="dinopipe export/run dir, DINOv2 .pth, timm file, registry name")
    d.add_argument("--train", required=True, help="depth set: images/X.jpg + depth/X.png (uint16 mm, 0 = invalid)")
    d.add_argument("--val", required=True, help="depth set for the metrics")
    d.add_argument("--out", required=True, help="output folder: metrics.json, model/, run/, predictions/")
    d.add_argument("--head", choices=["linear", "dpt"], default=None, help="default: linear (or the config's)")
    d.add_argument("--config", default=None, help="YAML of DepthConfig keys (dinopipe config --kind depth)")
    d.add_argument("--save-predictions", action="store_true", help="OUT/predictions/X.npy, float32 metres")
    d.add_argument("--epochs", type=int, default=None)
    d.add_argument("--lr", type=float, default=None, help="AdamW peak learning rate of the head")
    d.add_argument("--backbone-lr", type=float, default=None, help="0 = frozen backbone (default)")
    d.add_argument("--img-size", type=int, default=None, help="square size (default: the model's img_size)")
    d.add_argument("--batch-size", type=int, default=None)
    d.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    d.add_argument("--num-heads", type=int, default=None, help="only for foreign files with non-64-dim heads")
    d.add_argument("overrides", nargs="*", help="key=value DepthConfig overrides (e.g. flip_tta=true)")


def _print_seg(res: dict) -> None:
    print(f"{'class':>6} {'IoU %':>8}")
    for c, v in enumerate(res["per_class_iou"]):
        print(f"{c:>6} {'-' if v is None else f'{100 * v:8.2f}':>8}")
    print(f"mIoU {100 * res['miou']:.2f} %  pixel acc {100 * res['pixel_acc']:.2f} %")


def run_seg(args: argparse.Namespace) -> dict:
    from ..hub import load
    from .dense_data import open_dense
    from ..utils.device import pick_device
    from .seg import extract_dense, seg_probe

    train = open_dense(args.train)  # data problems surface before the model is loaded
    val = open_dense(args.val, num_classes=train.num_classes)
    device = pick_device(args.device, key="--device")
    model = load(args.model, device=device, num_heads=args.num_heads)
    size = args.img_size or int(model.patch_embed.img_size[0])
    if size % int(model.patch_size) and not _seg_heads_path(args):  # the pyramid path resamples to its grid
        raise LabelError(f"--img-size {size} is not a multiple of the model's patch size {model.patch_size}")
    if _seg_heads_path(args):  # pyramid heads, a folder --out or saved predictions (dinopipe.eval.seg_train)
        from .seg_train import run_seg_heads

        desc = {"source": train.source, "images": len(train), "classes": train.num_classes}
        return {"task": "seg", "model": str(args.model), "device": str(device), "feature": f"{args.head} head",
                "img_size": size, "train": desc, "val": {**desc, "source": val.source, "images": len(val)},
                "seg": run_seg_heads(args, train, val, model, device, size, getattr(args, "head_cfg", None))}
    t0 = time.time()
    f_train, m_train = extract_dense(model, train, size, args.batch_size, device)
    f_val, m_val = extract_dense(model, val, size, args.batch_size, device)
    top = int(m_val[m_val != 255].max()) if (m_val != 255).any() else 0
    if top >= train.num_classes:
        raise LabelError(f"--val masks hold class {top}, but --train masks only classes 0..{train.num_classes - 1}")
    desc = lambda d: {"source": d.source, "images": len(d), "classes": train.num_classes}  # noqa: E731
    out = {"task": "seg", "model": str(args.model), "device": str(device), "feature": "patch tokens",
           "img_size": size, "train": desc(train), "val": desc(val),
           "feature_seconds": round(time.time() - t0, 2)}
    out["seg"] = seg_probe(f_train, m_train, f_val, m_val, train.num_classes, epochs=args.epochs, lr=args.lr,
                           batch_size=args.batch_size, bn=not args.no_bn, device=device)
    return out


def _seg_heads_path(args: argparse.Namespace) -> bool:
    return args.task == "seg" and (args.head != "linear" or args.save_predictions or args.backbone_lr > 0
                                   or bool(args.out and not str(args.out).endswith(".json")))


def _describe(d: LabelledImages, unreadable: int) -> dict:
    return {"source": d.source, "images": len(d), "unreadable": unreadable, "classes": len(d.classes)}


def _print_knn(res: dict) -> None:
    print(f"{'k':>5} {'top1 %':>8} {'top5 %':>8}")
    for k, r in res.items():
        print(f"{k:>5} {100 * r['top1']:8.2f} {100 * r['top5']:8.2f}")


def _print_linear(res: dict) -> None:
    print(f"{'lr':>10} {'wd':>10} {'holdout top1 %':>15}")
    for r in res["sweep"]:
        mark = " *" if (r["lr"], r["wd"]) == (res["best"]["lr"], res["best"]["wd"]) else ""
        print(f"{r['lr']:10.3g} {r['wd']:10.3g} {100 * r['holdout_top1']:15.2f}{mark}")
    print(f"val (lr={res['best']['lr']:.3g}, wd={res['best']['wd']:.3g}): top1 {100 * res['val']['top1']:.2f} %"
          f"  top5 {100 * res['val']['top5']:.2f} %")


def run(args: argparse.Namespace) -> dict:
    import torch

    from ..hub import load
    from ..utils.device import pick_device
    from .features import extract_features, model_crop_size
    from .knn import knn_classify
    from .linear import linear_probe

    train = open_labelled(args.train)  # data problems surface before the model is loaded
    val = open_labelled(args.val, classes=train.classes)
    if args.task == "linear":  # too few images per class for the held-out split: before any feature
        from .linear import holdout_split

        holdout_split(torch.as_tensor(train.labels), args.holdout)
    device = pick_device(args.device, key="--device")
    model = load(args.model, device=device, num_heads=args.num_heads)
    t0 = time.time()
    kw = dict(img_size=args.img_size, batch_size=args.batch_size, num_workers=args.workers, device=device,
              avgpool=args.avgpool, normalize=args.task == "knn")
    f_train, f_val = extract_features(model, train, **kw), extract_features(model, val, **kw)
    for flag, d, f in (("--train", train, f_train), ("--val", val, f_val)):
        if len(d) and f.unreadable >= len(d):  # a broken mount or files that are not images: not a result
            raise LabelError(f"{flag}: none of the {len(d)} images in {d.source} could be read as an image")
    out = {
        "task": args.task, "model": str(args.model), "device": str(device),
        "feature": "cls+avgpool" if args.avgpool else "cls",
        "img_size": model_crop_size(model, args.img_size),
        "train": _describe(train, f_train.unreadable), "val": _describe(val, f_val.unreadable),
        "feature_seconds": round(time.time() - t0, 2),
    }
    n_cls = len(train.classes)
    if args.task == "knn":
        res = knn_classify(f_train.feats, f_train.labels, f_val.feats, f_val.labels, ks=args.k,
                           temperature=args.temperature, num_classes=n_cls, device=device)
        out["temperature"] = args.temperature
        out["knn"] = {str(k): v for k, v in res.items()}
    else:
        torch.manual_seed(0)
        out["linear"] = linear_probe(
            f_train.feats, f_train.labels, f_val.feats, f_val.labels, lrs=args.lrs, wds=args.wds,
            epochs=args.epochs, batch_size=args.probe_batch_size, holdout=args.holdout, optimizer=args.optimizer,
            refit=not args.no_refit, device=device, num_classes=n_cls)
    return out


def check_args(args: argparse.Namespace) -> None:
    """Counts, sizes and rates that cannot work, and an --out that cannot be written: ConfigError naming the flag,
    before any image is read."""
    from ..config import ConfigError

    def need(ok: bool, flag: str, what: str, got) -> None:
        if not ok:
            raise ConfigError(f"{flag}: must be {what}, got {got}")

    need(args.batch_size >= 1, "--batch-size", ">= 1", args.batch_size)
    if hasattr(args, "epochs"):  # linear, seg
        need(args.epochs >= 1, "--epochs", ">= 1", args.epochs)
    need(args.img_size is None or args.img_size >= 1, "--img-size", ">= 1", args.img_size)
    need(getattr(args, "workers", 0) >= 0, "--workers", ">= 0", getattr(args, "workers", None))
    if args.task == "knn":
        need(min(args.k) >= 1, "--k", ">= 1 each", args.k)
        need(args.temperature > 0, "--temperature", "> 0", args.temperature)
    elif args.task == "linear":
        need(args.probe_batch_size >= 1, "--probe-batch-size", ">= 1", args.probe_batch_size)
        need(0 < args.holdout < 1, "--holdout", "in (0, 1)", args.holdout)
        need(args.lrs is None or min(args.lrs) > 0, "--lrs", "> 0 each", args.lrs)
        need(min(args.wds) >= 0, "--wds", ">= 0 each", args.wds)
    else:
        need(args.lr > 0, "--lr", "> 0", args.lr)
    if args.task == "detect":
        need(args.lr > 0, "--lr", "> 0", args.lr)
        need(args.backbone_lr >= 0, "--backbone-lr", ">= 0", args.backbone_lr)
        need(args.channels >= 8, "--channels", ">= 8", args.channels)
        need(args.head != "fcos" or args.channels % 32 == 0, "--channels", "a multiple of 32 with fcos", args.channels)
        if Path(args.out).exists() and not Path(args.out).is_dir():
            raise ConfigError(f"--out: '{args.out}' is a file; give a folder")
        return
    if args.task == "seg":
        need(args.backbone_lr >= 0, "--backbone-lr", ">= 0", args.backbone_lr)
        need(args.channels >= 8, "--channels", ">= 8", args.channels)
        need(args.head != "m2f" or args.channels % 32 == 0, "--channels", "a multiple of 32 with m2f", args.channels)
        need(not args.save_predictions or bool(args.out), "--save-predictions", "given with --out", None)
        need(not (args.save_predictions and str(args.out).endswith(".json")), "--out",
             "a folder with --save-predictions", args.out)
    if args.out:
        out = Path(args.out)
        if out.is_dir() and not _seg_heads_path(args):
            raise ConfigError(f"--out: '{out}' is a folder; give a file name (results.json)")
        parent = next((q for q in (out.parent, *out.parent.parents) if q.exists()), Path("."))
        if not parent.is_dir() or not os.access(parent, os.W_OK):
            raise ConfigError(f"--out: cannot write '{out}' ('{parent}' is not a writable folder)")


def _head_config(args: argparse.Namespace):
    """The SegHeadsConfig / DetectConfig of ``--config`` and key=value (None for the other tasks)."""
    if args.task not in ("seg", "detect"):
        return None
    from ..config import ConfigError, load_config
    from .head_configs import DetectConfig, SegHeadsConfig, check_fit_config

    given = args.config is not None or bool(args.overrides)
    if args.task == "seg" and given and not _seg_heads_path(args):
        raise ConfigError("--config / key=value: settings of the pyramid heads' path (--head upernet|m2f, or --out "
                          "FOLDER); the linear probe's --out NAME.json path takes flags only")
    cfg = load_config(SegHeadsConfig if args.task == "seg" else DetectConfig, args.config, args.overrides)
    check_fit_config(cfg)
    return cfg


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    from ..utils.exits import run_command

    return run_command(f"dinopipe eval {args.task}", _main, args)


def _main(args: argparse.Namespace) -> int:
    from ..hub import CheckpointError
    from ..utils.exits import writing

    if args.task == "depth":
        from .depth_run import main_depth

        return main_depth(args)
    check_args(args)
    args.head_cfg = _head_config(args)  # --config / key=value of seg's heads path and detect: exit 2 before any work
    try:
        if args.task == "detect":
            from .detect import run_detect

            out = run_detect(args, args.head_cfg)
            if out.get("exit"):  # preempted: checkpointed in OUT/run, the same command resumes
                return int(out["exit"])
            _print_detect(out["detect"])
            print(f"results written to {Path(args.out) / 'metrics.json'} and predictions.json")
            return 0
        out = run_seg(args) if args.task == "seg" else run(args)
        if args.task == "seg" and out["seg"].get("exit"):  # a pyramid head preempted: the same command resumes
            return int(out["seg"]["exit"])
    except (LabelError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except CheckpointError as exc:
        print(f"error: cannot load --model: {exc}", file=sys.stderr)
        return 2  # a checkpoint dinopipe cannot read: the user's file (docs/exit-codes.md)
    print(f"{args.task}: {out['train']['images']} train / {out['val']['images']} val images, "
          f"{out['train']['classes']} classes, feature {out['feature']} at {out['img_size']} px")
    {"knn": _print_knn, "linear": _print_linear, "seg": _print_seg}[args.task](out[args.task])
    if args.out and _seg_heads_path(args):
        print(f"results written to {Path(args.out) / 'metrics.json'}")
    elif args.out:
        with writing(args.out):  # a full disk or a folder made read-only meanwhile: exit 2 naming it
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(out, indent=2))
        print(f"results written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
