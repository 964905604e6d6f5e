"""Gram anchoring bench (issue 11): the same CPU-scale DINOv3-style pretraining with and without Gram anchoring,
compared on the quality of their *patch* features. Everything on CPU, on real photos shipped in pip packages.

Runs (``dinopipe pretrain``, configs/pretrain/bench_quality.yaml with a DINOv3 backbone): ``vit_test_dinov3``
(patch 16, RoPE, 4 storage tokens) at 64 / 32 px crops on a pool of crops of the sample photos, same seed,
data and schedules; ``gram`` adds Gram anchoring: the Gram teacher is copied from the EMA teacher at 1/4 of the
run and refreshed every 1/4 (DINOv3 §4's cadence, squeezed), sees the global crops at 128 px (2x, as DINOv3) and
its 8x8 patch grid is resampled to the student's 4x4; weight 1. ``random`` is the untrained architecture.

Measure: dense patch-level kNN on labelled regions of real images. ``build_texture_set`` paints composites of
four real textures shipped with scikit-image (brick, grass, gravel, coffee) in 16-px-aligned rectangles, so
every 16-px patch has one known class. Frozen, L2-normalised patch tokens of the exported EMA teacher at 128 px
(8x8 grid); each val patch is classified by its k = 10 nearest train patches (cosine, weights exp(s / 0.07)):
patch accuracy and mIoU over the 4 classes. This asks what Gram anchoring is for -- do patch features keep
local, semantic similarity -- without a head that could compensate. A linear 1x1-conv probe (eval/seg.py,
mIoU at pixel level) is reported beside it.

Lines ``name: value``: ``dense_knn_acc_<model>``, ``dense_knn_miou_<model>``, ``linear_miou_<model>``,
``gram_minus_plain_dense_knn_acc``, ``gram_minus_plain_linear_miou``, ``step_time_ratio_gram_over_plain``.

What a CPU-scale run can and cannot show: it shows the mechanics at work (the anchor is copied, refreshed, its
loss is small after each copy and pulls the student's patch similarities back towards it) and the wall-time
cost of the extra high-resolution forward; it cannot show the effect DINOv3 reports, which is the recovery of
dense features that *degrade* after ~200k+ iterations of a ViT-7B (§4.1): a few hundred steps of a 4-block,
64-dim model are nowhere near that regime, so a difference of a few points either way here is not evidence
for or against Gram anchoring at scale.

    python bench/bench_gram.py                 # ~26 min on 2 shared cores at load ~12 (two 300-step runs + evals)
    python bench/bench_gram.py --steps 100     # a smoke run of the same pipeline
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # 2 shared cores: idle OpenMP threads must not spin

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import common as C  # noqa: E402
from bench_quality import PRETRAIN_CFG, last_losses, run_stage  # noqa: E402

EVAL_SIZE = 128  # 8x8 patches of 16 px; texture regions are aligned to 16 px
EPOCH_LENGTH = 50
DINOV3 = ["model.name=vit_test_dinov3", "model.img_size=64", "dino.koleo_loss_weight=0.1",
          "phases=[{name: base, fraction: 1.0, global_crops_size: 64, local_crops_size: 32, batch_size_per_gpu: 16,"
          " gram_crops_size: 128}]"]


def gram_overrides(steps: int) -> list[str]:
    q = steps // 4
    return ["gram.enabled=true", f"gram.first_step={q}", f"gram.refresh_every={q}", "gram.loss_weight=1.0"]


def patch_labels(masks: torch.Tensor, p: int) -> torch.Tensor:
    """(N, H, W) pixel masks -> (N, h*w) class of each patch (its centre pixel; regions are patch-aligned)."""
    return masks[:, p // 2::p, p // 2::p].flatten(1)


def miou(pred: torch.Tensor, target: torch.Tensor, n: int) -> float:
    ious = []
    for c in range(n):
        inter = ((pred == c) & (target == c)).sum().item()
        union = ((pred == c) | (target == c)).sum().item()
        if union:
            ious.append(inter / union)
    return sum(ious) / len(ious)


def dense_knn(f_tr, y_tr, f_va, y_va, n_classes: int, k: int = 10, t: float = 0.07) -> tuple[float, float]:
    """Patch kNN: (accuracy, mIoU) of val patches voted by their k most similar train patches."""
    a = F.normalize(f_tr.flatten(2).transpose(1, 2).reshape(-1, f_tr.shape[1]), dim=-1)  # (N_tr*hw, D)
    b = F.normalize(f_va.flatten(2).transpose(1, 2).reshape(-1, f_va.shape[1]), dim=-1)
    ya, yb = y_tr.reshape(-1), y_va.reshape(-1)
    sims, idx = (b @ a.T).topk(k, dim=1)
    votes = torch.zeros(len(b), n_classes).scatter_add_(1, ya[idx], (sims / t).exp())
    pred = votes.argmax(1)
    return float((pred == yb).float().mean()), miou(pred, yb, n_classes)


def evaluate(model, tex_train, tex_val, n_classes: int, probe_epochs: int) -> dict[str, float]:
    from dinopipe.eval.seg import extract_dense, seg_probe

    p = int(model.patch_size)
    f_tr, m_tr = extract_dense(model, tex_train, EVAL_SIZE)
    f_va, m_va = extract_dense(model, tex_val, EVAL_SIZE)
    acc, mi = dense_knn(f_tr, patch_labels(m_tr, p), f_va, patch_labels(m_va, p), n_classes)
    lin = seg_probe(f_tr, m_tr, f_va, m_va, n_classes, epochs=probe_epochs)["miou"]
    return {"dense_knn_acc": acc, "dense_knn_miou": mi, "linear_miou": lin}


def step_time(run_dir: Path) -> float:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    times = [r["step_time"] for r in rows if "step_time" in r][1:]  # the first includes worker start-up
    return sum(times) / max(len(times), 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300, help=f"pretraining steps per run (multiple of {EPOCH_LENGTH})")
    ap.add_argument("--pool", type=int, default=1200, help="pretraining pool size (crops of the sample photos)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--probe-epochs", type=int, default=50)
    ap.add_argument("--workdir", default="runs/bench_gram")
    args = ap.parse_args(argv)
    if args.steps % EPOCH_LENGTH or args.steps < 4 * EPOCH_LENGTH // 2:
        raise SystemExit(f"error: --steps must be a multiple of {EPOCH_LENGTH} and >= {2 * EPOCH_LENGTH}")
    work = Path(args.workdir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    C.setup(args.threads, args.seed)
    from dinopipe.data.samples import build_sample_pool
    from dinopipe.eval.dense_data import TEXTURE_CLASSES, build_texture_set, open_dense

    build_sample_pool(work, n_images=args.pool, copy_fraction=0.0, size=128, seed=args.seed, corrupt=False)
    tex = build_texture_set(work / "tex", n=48, size=EVAL_SIZE, cell=16, seed=args.seed + 1)
    train_set = open_dense(work / "tex", num_classes=len(TEXTURE_CLASSES))
    train_set.pairs, val_pairs = tex.pairs[:32], tex.pairs[32:]
    val_set = open_dense(work / "tex", num_classes=len(TEXTURE_CLASSES))
    val_set.pairs = val_pairs
    sched = [f"train.epochs={args.steps // EPOCH_LENGTH}", f"train.epoch_length={EPOCH_LENGTH}",
             f"data.paths=[{work / 'pool'}]", f"train.seed={args.seed}"]
    print(f"{args.steps} steps per run, pool {args.pool}, texture set 32 train / 16 val at {EVAL_SIZE} px")

    import dinopipe
    from dinopipe.models import create_model

    results, times = {}, {}
    torch.manual_seed(args.seed)
    results["random"] = evaluate(create_model("vit_test_dinov3", init_values=None), train_set, val_set,
                                 len(TEXTURE_CLASSES), args.probe_epochs)
    for name, extra in (("plain", []), ("gram", gram_overrides(args.steps))):
        run = work / name
        wall = run_stage("pretrain", PRETRAIN_CFG, run, sched + DINOV3 + extra)
        times[name] = step_time(run)
        print(f"{name}: {args.steps} steps in {wall:.0f} s ({times[name]:.3f} s/step), last {last_losses(run)}")
        results[name] = evaluate(dinopipe.load(run), train_set, val_set, len(TEXTURE_CLASSES), args.probe_epochs)
    for model, r in results.items():
        for key, v in r.items():
            print(f"{key}_{model}: {v:.4f}")
    for key in ("dense_knn_acc", "dense_knn_miou", "linear_miou"):
        print(f"gram_minus_plain_{key}: {results['gram'][key] - results['plain'][key]:+.4f}")
    print(f"step_time_ratio_gram_over_plain: {times['gram'] / times['plain']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
