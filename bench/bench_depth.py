"""Depth heads on scenes rendered from real pixels: DPT vs the linear-bins probe, a pretrained backbone vs its
random init, 3 seeds each, through the same path as `dinopipe eval depth` (``run_depth``).

Scenes (``dinopipe/eval/depth_scenes.py``): a pinhole camera over a textured ground plane (scikit-image's
brick / grass / gravel) with photo billboards standing at known depths before a photo wall; train scenes use the
left half of every source image, val scenes the right half. Each seed renders its own train and val sets and
seeds the head. Reported: the official metrics (dinov3 formulas) on val, mean and standard error over seeds,
and the difference DPT - linear in units of its standard error.

    python bench/bench_depth.py --teacher runs/quickstart/pretrain/export/teacher   # after `make quickstart`
    python bench/bench_depth.py --teacher T --picture docs/depth_bench.png          # + predictions beside truth

JSON in bench/results/depth.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dinopipe.config import load_config  # noqa: E402
from dinopipe.eval.depth import METRIC_KEYS  # noqa: E402
from dinopipe.eval.depth_run import DepthConfig, run_depth  # noqa: E402
from dinopipe.eval.depth_scenes import build_depth_scenes  # noqa: E402

SHOW = ("abs_rel", "rmse", "a1", "silog")


def _sets(root: Path, seed: int, n_train: int, n_val: int, size: int) -> tuple[Path, Path]:
    tr, va = root / f"s{seed}" / "train", root / f"s{seed}" / "val"
    if not tr.exists():
        build_depth_scenes(tr, n_train, size, seed=1000 + seed, half="left")
        build_depth_scenes(va, n_val, size, seed=2000 + seed, half="right")
    return tr, va


MOTORCYCLE = {"focal_px": 994.978, "baseline_m": 0.193001, "doffs_px": 31.086}  # skimage's docstring (1/4 scale)


def motorcycle_check(model_dir: Path) -> dict:
    """Middlebury's Motorcycle (scikit-image's ``stereo_motorcycle``): depth from the ground-truth disparity and the
    calibration, Z = f B / (d + doffs). Only the image's right half is scored (train scenes drew billboards from the
    left half of every photo, this one included). The prediction is aligned to the truth in scale and shift by least
    squares (dinov3's ``align_least_squares``), as for a model trained on other scenes its metric scale means
    nothing: what is left is the shape."""
    import torch.nn.functional as F
    from skimage import data

    import dinopipe
    from dinopipe.eval.depth import depth_metrics
    from dinopipe.eval.depth_data import image_tensor

    left, _, disp = data.stereo_motorcycle()
    w = left.shape[1] // 2
    img, disp = left[:, w:], disp[:, w:]
    gt = np.where(np.isfinite(disp), MOTORCYCLE["focal_px"] * MOTORCYCLE["baseline_m"]
                  / (np.nan_to_num(disp, posinf=0) + MOTORCYCLE["doffs_px"]), 0.0)
    gt = np.where(np.isfinite(disp), gt, 0.0).astype(np.float64)
    model = dinopipe.load(model_dir)
    p = int(model.patch)
    h, ww = 8 * p, int(round(8 * p * img.shape[1] / img.shape[0] / p)) * p
    from PIL import Image

    tmp = Path(tempfile.mkstemp(suffix=".png")[1])
    Image.fromarray(img).save(tmp)
    x = image_tensor(tmp, (h, ww))[None]
    tmp.unlink()
    with torch.no_grad():
        pred = F.interpolate(model(x), size=gt.shape, mode="bilinear", align_corners=False)[0, 0].double().numpy()
    valid = gt > 0
    A = np.stack([pred[valid], np.ones(valid.sum())], 1)
    scale, shift = np.linalg.lstsq(A, gt[valid], rcond=None)[0]
    aligned = np.maximum(pred * scale + shift, 1e-3)
    m = depth_metrics([aligned], [gt])
    return {k: m[k] for k in ("abs_rel", "a1", "rmse", "silog")}


def _mean_se(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", default=None, help="a pretrained backbone dinopipe.load reads")
    ap.add_argument("--summarize", default=None, help="only recompute and print the tables of a results JSON")
    ap.add_argument("--random", default="vit_test", help="the random-init model of the same architecture")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--heads", nargs="+", default=["linear", "dpt"])
    ap.add_argument("--train", type=int, default=32)
    ap.add_argument("--val", type=int, default=12)
    ap.add_argument("--size", type=int, default=112)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--dpt-features", type=int, default=32)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "depth.json"))
    ap.add_argument("--picture", default=None, help="PNG: val images, truth, linear and DPT predictions")
    args = ap.parse_args()
    if args.summarize:
        res = json.loads(Path(args.summarize).read_text())
        res["summary"], res["comparisons"] = summarize(res["rows"], res["settings"]["seeds"])
        Path(args.summarize).write_text(json.dumps(res, indent=2))  # the tables of the current summarize()
        print_tables(res["summary"], res["comparisons"])
        return 0
    if not args.teacher:
        ap.error("--teacher is required")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    rows = []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for seed in range(args.seeds):
            tr, va = _sets(root, seed, args.train, args.val, args.size)
            for bb_name, bb in (("pretrained", args.teacher), ("random", args.random))[:2 if args.random else 1]:
                for head in args.heads:
                    cfg = load_config(DepthConfig, None, [f"head={head}", f"epochs={args.epochs}", f"seed={seed}",
                                                          f"img_size={args.size}", "workers=0",
                                                          f"dpt_features={args.dpt_features}", "max_depth=20",
                                                          f"batch_size={args.batch_size}", f"lr={args.lr}"])
                    out = root / f"r_{seed}_{bb_name}_{head}"
                    t = time.time()
                    res = run_depth(cfg, bb, str(tr), str(va), out, torch.device("cpu"),
                                    save_predictions=bool(args.picture) and seed == 0, progress=False)
                    rows.append({"seed": seed, "backbone": bb_name, "head": head, "seconds": round(time.time() - t, 1),
                                 **{k: res[k] for k in METRIC_KEYS},
                                 "motorcycle": motorcycle_check(out / "model")})
                    print(f"seed {seed} {bb_name:10s} {head:6s} " + "  ".join(f"{k} {res[k]:.4f}" for k in SHOW)
                          + f"  ({rows[-1]['seconds']} s)  motorcycle (aligned) abs_rel "
                          + f"{rows[-1]['motorcycle']['abs_rel']:.4f} a1 {rows[-1]['motorcycle']['a1']:.4f}", flush=True)
                    if args.picture and seed == 0 and bb_name == "pretrained":
                        (root / f"pic_{head}").symlink_to(out / "predictions")
        if args.picture:
            _picture(root, va if args.seeds == 1 else root / "s0" / "val", Path(args.picture))
    summary, comparisons = summarize(rows, args.seeds)
    result = {"bench": "depth", "settings": vars(args), "rows": rows, "summary": summary,
              "comparisons": comparisons, "seconds": round(time.time() - t0, 1), "torch": torch.__version__,
              "device": "cpu"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print_tables(summary, comparisons)
    print(f"wrote {args.out} ({result['seconds']} s)")
    return 0


LOWER_BETTER = {k: k not in ("a1", "a2", "a3") for k in METRIC_KEYS}


def summarize(rows: list[dict], seeds: int) -> tuple[dict, dict]:
    """Mean and standard error over seeds per (backbone, head); paired per-seed differences (same scenes) for
    DPT - linear and pretrained - random, with how many standard errors the first is better by."""
    summary = {}
    for bb_name in ("pretrained", "random"):
        for head in ("linear", "dpt"):
            sel = [r for r in rows if r["backbone"] == bb_name and r["head"] == head]
            if sel:
                summary[f"{bb_name}/{head}"] = {k: _mean_se([r[k] for r in sel]) for k in METRIC_KEYS}
                if all("motorcycle" in r for r in sel):
                    summary[f"{bb_name}/{head}"]["motorcycle"] = {
                        k: _mean_se([r["motorcycle"][k] for r in sel]) for k in sel[0]["motorcycle"]}
    comparisons = {}
    for name, a, b in (("dpt_vs_linear/pretrained", "pretrained/dpt", "pretrained/linear"),
                       ("dpt_vs_linear/random", "random/dpt", "random/linear"),
                       ("pretrained_vs_random/linear", "pretrained/linear", "random/linear"),
                       ("pretrained_vs_random/dpt", "pretrained/dpt", "random/dpt")):
        if a not in summary or b not in summary:
            continue
        ka, kb = a.split("/"), b.split("/")
        comparisons[name] = {}
        for k in SHOW:
            diffs = [next(r[k] for r in rows if r["seed"] == s and [r["backbone"], r["head"]] == ka)
                     - next(r[k] for r in rows if r["seed"] == s and [r["backbone"], r["head"]] == kb)
                     for s in range(seeds)]
            m, se = _mean_se(diffs)
            better = -m if LOWER_BETTER[k] else m
            comparisons[name][k] = {"diff": m, "se": se, "n_se_better": better / se if se and se > 0 else None}
    return summary, comparisons


def print_tables(summary: dict, comparisons: dict) -> None:
    print("\n| backbone | head | " + " | ".join(SHOW) + " |\n|---|---|" + "---|" * len(SHOW))
    for key, s in summary.items():
        bb_name, head = key.split("/")
        print(f"| {bb_name} | {head} | " + " | ".join(f"{s[k][0]:.3f} ± {s[k][1]:.3f}" for k in SHOW) + " |")
    if all("motorcycle" in s for s in summary.values()):
        print("\n| motorcycle (right half, scale+shift aligned) | abs_rel | a1 |\n|---|---|---|")
        for key, s in summary.items():
            mc = s["motorcycle"]
            print(f"| {key} | {mc['abs_rel'][0]:.3f} ± {mc['abs_rel'][1]:.3f} | {mc['a1'][0]:.3f} ± {mc['a1'][1]:.3f} |")
    print("\n| comparison (first better by, in standard errors of the paired difference) | " + " | ".join(SHOW)
          + " |\n|---|" + "---|" * len(SHOW))
    for name, c in comparisons.items():
        print(f"| {name} | " + " | ".join(f"{c[k]['n_se_better']:+.1f}" if c[k]["n_se_better"] is not None
                                          else "-" for k in SHOW) + " |")


def _picture(root: Path, val: Path, out: Path, n: int = 4) -> None:
    """Rows: image, truth, linear, DPT (pretrained backbone, seed 0); inverse depth, one colour scale per column."""
    from PIL import Image

    from dinopipe.eval.depth_data import open_depth, read_depth_png

    data = open_depth(val)
    cols = []
    for (img, dep), name in list(zip(data.pairs, data.names))[:n]:
        gt = read_depth_png(dep)
        lo, hi = 1.0 / max(float(gt.max()), 1e-3), 1.0 / max(float(gt[gt > 0].min()), 1e-3)

        def color(d):  # inverse depth (near = bright yellow, far = dark blue), the truth's range for every row
            x = np.clip((1.0 / np.maximum(d, 1e-3) - lo) / (hi - lo), 0, 1)
            return (np.stack([x, x ** 0.7 * 0.9, 0.5 * (1 - x)], -1) * 255 * (d > 0)[..., None]).astype(np.uint8)

        tiles = [np.asarray(Image.open(img).convert("RGB")), color(gt)]
        tiles += [color(np.load(root / f"pic_{h}" / f"{name}.npy")) for h in ("linear", "dpt")]
        cols.append(np.concatenate(tiles, 0))
    out.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.concatenate(cols, 1)).save(out)
    print(f"picture: {out} (rows: image, truth, linear, DPT)")


if __name__ == "__main__":
    sys.exit(main())
