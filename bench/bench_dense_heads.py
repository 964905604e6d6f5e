"""Segmentation and detection heads on a plain ViT, on labels known exactly (issue 50).

Data (dinopipe.eval.paste_data): crops of three photos that ship with scikit-image (chelsea, coffee, astronaut),
cut out by random ellipses and pasted onto crops of real backgrounds (sklearn's china / flower, skimage's brick,
grass, gravel); train and val from disjoint halves of every source photo. Each seed builds its own sets, inits
its own heads and orders its own batches.

Segmentation: the linear probe (BN + 1x1 on the patch grid) against UperNet and Mask2Former on the ViTDet
pyramid, all on the same frozen backbone, scored by the same slide inference and confusion-matrix mIoU.
Reported: mean and standard error over seeds, and each pyramid head minus linear (paired by seed) in standard
errors. Detection: Faster R-CNN on the pyramid, COCO AP by pycocotools. With ``--trained PATH`` every row runs
on that backbone too (any file dinopipe.load reads; the docs name the one used), and the random rows on a random
net of its architecture: trained minus random per head, paired by seed. Mask2Former has its own epochs
(``--m2f-epochs``).

    python bench/bench_dense_heads.py [--seeds 8] [--trained runs/quickstart/distill/export/small] \
        [--out bench/results/dense_heads.json] [--picture docs/img/dense_heads.png]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dinopipe.eval.coco import open_coco  # noqa: E402
from dinopipe.eval.dense_data import open_dense  # noqa: E402
from dinopipe.eval.detect import train_detector  # noqa: E402
from dinopipe.eval.paste_data import OBJECTS, build_paste_sets  # noqa: E402
from dinopipe.eval.seg_train import predict_image, train_seg  # noqa: E402

SEG = {  # head: (lr, epochs flag, extra)
    "linear": (1e-2, "epochs", {}),
    "upernet": (1e-3, "epochs", {}),
    "m2f": (1e-3, "m2f_epochs", {"m2f": dict(num_queries=8, decoder_layers=3, encoder_layers=1,
                                               train_num_points=512)}),
}
RANDOM_LIKE = "random-like:"  # + a path: a randomly initialised net of that model's architecture


def _backbone(spec: str):
    from dinopipe.hub import load
    from dinopipe.models import random_init_like

    if spec.startswith(RANDOM_LIKE):  # what the pipeline's eval compares a student with (its own arch, seed 0)
        return random_init_like(load(spec[len(RANDOM_LIKE):], device="cpu"))
    torch.manual_seed(0)  # the registry name's random init is the same for every row
    return load(spec, device="cpu")


def mean_se(xs: list[float]) -> tuple[float, float]:
    a = np.asarray(xs, float)
    return float(a.mean()), float(a.std(ddof=1) / math.sqrt(len(a))) if len(a) > 1 else 0.0


def run_seeds(args, backbone_spec: str, work: Path) -> dict:
    rows: dict = {"seg": {h: [] for h in SEG}, "det": []}
    keep = {}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        paths = build_paste_sets(work / f"s{seed}", args.n_train, args.n_val, size=args.size, seed=100 * seed)
        tr, va = open_dense(paths["train"]), open_dense(paths["val"], num_classes=len(OBJECTS) + 1)
        for head, (lr, epochs, extra) in SEG.items():
            t0 = time.time()
            h, res = train_seg(_backbone(backbone_spec), head, tr, va, size=args.size, epochs=getattr(args, epochs),
                               lr=lr, batch_size=8, seed=seed, channels=args.channels, **extra)
            rows["seg"][head].append({"seed": seed, "miou": res["miou"], "per_class_iou": res["per_class_iou"],
                                      "seconds": round(time.time() - t0, 1)})
            print(f"{backbone_spec} seed {seed} {head:8s} mIoU {100 * res['miou']:.2f}  ({time.time() - t0:.0f} s)",
                  flush=True)
            if seed == args.first_seed:
                keep[head] = h
        if args.det_epochs:
            t0 = time.time()
            ctr, cva = open_coco(paths["train_json"]), open_coco(paths["val_json"])
            hd, res, preds = train_detector(_backbone(backbone_spec), "fasterrcnn", ctr, cva, img_size=args.size,
                                            epochs=args.det_epochs, lr=3e-4, batch_size=4, seed=seed,
                                            channels=args.channels)
            rows["det"].append({"seed": seed, **{k: res[k] for k in ("bbox_AP", "bbox_AP50", "bbox_AP75")},
                                "seconds": round(time.time() - t0, 1)})
            print(f"{backbone_spec} seed {seed} fasterrcnn AP50 {100 * res['bbox_AP50']:.2f}", flush=True)
            if seed == args.first_seed:
                keep["det_preds"] = preds
        if seed == args.first_seed:
            keep["paths"] = paths
        partial = Path(args.out).with_suffix(".partial.json")  # each finished seed survives an interrupted run
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({"backbone": backbone_spec, **_summarise(rows)}, indent=2))
    return _summarise(rows), keep


def _summarise(rows: dict) -> dict:
    out = {"seg": {}, "det": {}}
    lin = [r["miou"] for r in rows["seg"]["linear"]]
    for head, rs in rows["seg"].items():
        m, se = mean_se([r["miou"] for r in rs])
        entry = {"mIoU_mean": round(m, 4), "mIoU_se": round(se, 4), "runs": rs}
        if head != "linear":
            d_m, d_se = mean_se([r["miou"] - b for r, b in zip(rs, lin)])  # paired by seed: same data
            entry["minus_linear"] = {"mean": round(d_m, 4), "se": round(d_se, 4),
                                     "in_se": round(d_m / d_se, 1) if d_se > 0 else None}
        out["seg"][head] = entry
    if rows["det"]:
        for k in ("bbox_AP", "bbox_AP50", "bbox_AP75"):
            m, se = mean_se([r[k] for r in rows["det"]])
            out["det"][k] = {"mean": round(m, 4), "se": round(se, 4)}
        out["det"]["runs"] = rows["det"]
    return out


def trained_minus_random(trained: dict, random: dict) -> dict:
    """Per head (and detector AP50), the trained backbone minus its random init, paired by seed (same data)."""
    pairs = {h: ([r["miou"] for r in trained["seg"][h]["runs"]], [r["miou"] for r in random["seg"][h]["runs"]])
             for h in trained["seg"]}
    if trained["det"] and random["det"]:
        pairs["det_AP50"] = ([r["bbox_AP50"] for r in trained["det"]["runs"]],
                             [r["bbox_AP50"] for r in random["det"]["runs"]])
    out = {}
    for key, (a, b) in pairs.items():
        m, se = mean_se([x - y for x, y in zip(a, b)])
        out[key] = {"mean": round(m, 4), "se": round(se, 4), "in_se": round(m / se, 1) if se > 0 else None}
    return out


def picture(keep: dict, backbone_spec: str, size: int, path: Path) -> None:
    """Val images: the photo, the truth, each head's prediction; then Faster R-CNN boxes beside the true ones."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches as patches
    import matplotlib.pyplot as plt
    from PIL import Image

    va = open_dense(keep["paths"]["val"], num_classes=len(OBJECTS) + 1)
    heads = [h for h in SEG if h in keep]
    n = 3
    cols = 2 + len(heads) + ("det_preds" in keep)
    fig, axes = plt.subplots(n, cols, figsize=(2.2 * cols, 2.2 * n))
    bb = _backbone(backbone_spec)
    cmap = matplotlib.colors.ListedColormap(["#222222", "#e6194b", "#3cb44b", "#4363d8"])
    gt = open_coco(keep["paths"]["val_json"]) if "det_preds" in keep else None
    for i in range(n):
        img_p, mask_p = va.pairs[i]
        truth = np.asarray(Image.open(mask_p))
        panels = [("image", np.asarray(Image.open(img_p))), ("truth", truth)]
        panels += [(h, predict_image(bb, keep[h], img_p, size, truth.shape, torch.device("cpu")).numpy())
                   for h in heads]
        for j, (name, a) in enumerate(panels):
            ax = axes[i, j]
            ax.imshow(a, cmap=None if a.ndim == 3 else cmap, vmin=0, vmax=3, interpolation="nearest")
            ax.set_title(name if i == 0 else "", fontsize=9)
            ax.axis("off")
        if gt is not None:
            ax = axes[i, -1]
            ax.imshow(np.asarray(Image.open(img_p)))
            image_id = gt.image_ids[i]
            for a in gt.coco.imgToAnns[image_id]:
                x, y, w, h = a["bbox"]
                ax.add_patch(patches.Rectangle((x, y), w, h, fill=False, ec="white", lw=1.5))
            for r in keep["det_preds"]:
                if r["image_id"] == image_id and r["score"] >= 0.5:
                    x, y, w, h = r["bbox"]
                    ax.add_patch(patches.Rectangle((x, y), w, h, fill=False, ec="yellow", lw=1, ls="--"))
            ax.set_title("boxes: truth / pred" if i == 0 else "", fontsize=9)
            ax.axis("off")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    print(f"picture: {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0, help="run seeds first-seed .. first-seed + seeds - 1")
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--n-train", type=int, default=48)
    ap.add_argument("--n-val", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=12, help="epochs of the linear probe and UperNet")
    ap.add_argument("--m2f-epochs", type=int, default=24,
                    help="Mask2Former's epochs (a set-prediction head: it needs more steps than a per-pixel one)")
    ap.add_argument("--det-epochs", type=int, default=8, help="0: no detection rows")
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--random", default=None,
                    help="a registry name (random init); default: vit_test, or with --trained a random net of the "
                         "trained model's architecture (seed 0, as the pipeline's eval compares a student)")
    ap.add_argument("--trained", default=None, help="a trained backbone dinopipe.load reads (compared with --random)")
    ap.add_argument("--out", default=str(REPO / "bench/results/dense_heads.json"))
    ap.add_argument("--picture", default=None, help="PNG: predictions beside the truth (seed 0)")
    args = ap.parse_args()
    if args.random is None:
        args.random = RANDOM_LIKE + args.trained if args.trained else "vit_test"
    torch.set_num_threads(2)
    t0 = time.time()
    res = {"config": {k: v for k, v in vars(args).items() if k not in ("out", "picture")},
           "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in (("random", args.random), ("trained", args.trained)):
            if spec is None:
                continue
            res[name], keep = run_seeds(args, spec, Path(tmp) / name)
            if args.picture and name == ("trained" if args.trained else "random"):
                picture(keep, spec, args.size, Path(args.picture))
    if "random" in res and "trained" in res:
        res["trained_minus_random"] = trained_minus_random(res["trained"], res["random"])
    res["seconds"] = round(time.time() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    Path(args.out).with_suffix(".partial.json").unlink(missing_ok=True)
    for name in ("random", "trained"):
        if name in res:
            for head, e in res[name]["seg"].items():
                d = e.get("minus_linear")
                extra = f"  - linear {100 * d['mean']:+.2f} ({d['in_se']} se)" if d else ""
                print(f"{name:8s} {head:8s} mIoU {100 * e['mIoU_mean']:.2f} ± {100 * e['mIoU_se']:.2f}{extra}")
            if res[name]["det"]:
                e = res[name]["det"]
                print(f"{name:8s} fasterrcnn AP {100 * e['bbox_AP']['mean']:.2f} ± {100 * e['bbox_AP']['se']:.2f}  "
                      f"AP50 {100 * e['bbox_AP50']['mean']:.2f} ± {100 * e['bbox_AP50']['se']:.2f}")
    for key, d in res.get("trained_minus_random", {}).items():
        print(f"trained - random {key:10s} {100 * d['mean']:+.2f} ± {100 * d['se']:.2f} ({d['in_se']} se)")
    print(f"written {args.out} in {res['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
