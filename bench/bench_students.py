"""Students of other architectures next to a ViT student: one feature-distillation run of a pretrained teacher
into a ViT (the quality bench's 32-wide, 2-block student), a ConvNeXt (timm:convnext_atto) and a ResNet
(timm:resnet10t), all at once; kNN top-1 (k = 20, T = 0.07) of each exported student against a random init of
its own architecture, on the quality bench's two labelled sets (photos: instance retrieval; digits).

    python bench/bench_students.py --work runs/bench_quality [--steps 150] [--seeds 0 1]

``--work`` is a folder bench_quality.py filled (teacher/, pool/, photos/, digits/); the students are written to
``--out`` (default runs/bench_students). Lines: ``knn_top1_<set>_<student>_<distilled|random>_<eval px>: mean ±
sd`` over seeds and ``<student>_gain_<set>_<eval px>: +d`` (distilled - random). Measures, asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

CONFIG = REPO / "configs" / "distill" / "quickstart.yaml"
STUDENTS = {
    "vit": "{name: vit_test, embed_dim: 32, num_heads: 1, depth: 2, img_size: 56, attn_backend: sdpa, init_values: null}",
    "convnext": "{name: 'timm:convnext_atto', img_size: 56}",
    "resnet": "{name: 'timm:resnet10t', img_size: 56}",
}
EPOCH_LENGTH = 50
EVAL_SIZES = (56,)  # the quality bench's training crop and eval size (its teacher was pretrained at 56 px)


def distill(work: Path, run: Path, steps: int, seed: int) -> float:
    students = "students=[" + ", ".join(f"{{name: {n}, model: {m}}}" for n, m in STUDENTS.items()) + "]"
    cmd = [sys.executable, "-m", "dinopipe.train.distill", "--config", str(CONFIG), "mode=feature",
           f"teacher_model.path={work / 'teacher'}", f"data.paths=[{work / 'pool'}]", f"train.output_dir={run}",
           students, f"train.epochs={steps // EPOCH_LENGTH}", f"train.epoch_length={EPOCH_LENGTH}",
           f"train.seed={seed}", "train.progress=false", "train.log_every=25", "data.num_workers=1",
           "phases=[{name: base, fraction: 1.0, global_crops_size: 56, local_crops_size: 28, batch_size_per_gpu: 32}]",
           "crops.local_crops_number=0"]  # 28 px local crops are below a CNN's stride of 32
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    with open(run.with_suffix(".log"), "w") as f:
        rc = subprocess.call(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    if rc != 0:
        raise SystemExit(f"error: distill exited {rc}; see {run.with_suffix('.log')}")
    return time.perf_counter() - t0


def knn(model, sets: dict, size: int) -> dict[str, float]:
    from dinopipe.eval import extract_features, knn_classify

    out = {}
    for name, (train, val) in sets.items():
        kw = dict(img_size=size, batch_size=64, num_workers=0, device="cpu")
        ft, fv = extract_features(model, train, **kw), extract_features(model, val, **kw)
        res = knn_classify(ft.feats, ft.labels, fv.feats, fv.labels, ks=(20,), temperature=0.07,
                           num_classes=len(train.classes))
        out[name] = res[20]["top1"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=REPO / "runs" / "bench_quality")
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "bench_students")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = ap.parse_args(argv)
    if args.steps % EPOCH_LENGTH or not (args.work / "teacher" / "export").is_dir():
        raise SystemExit(f"error: --steps must be a multiple of {EPOCH_LENGTH} and --work must hold a finished "
                         f"teacher run (python bench/bench_quality.py first)")
    import torch

    from dinopipe import load
    from dinopipe.eval import open_labelled
    from dinopipe.models import build_vit

    sets = {}
    for name in ("photos", "digits"):
        train = open_labelled(str(args.work / name / "train"))
        sets[name] = (train, open_labelled(str(args.work / name / "val"), classes=train.classes))
    args.out.mkdir(parents=True, exist_ok=True)
    acc: dict[str, list[float]] = {}
    teacher = load(args.work / "teacher")
    for size in EVAL_SIZES:
        for s, v in knn(teacher, sets, size).items():
            acc.setdefault(f"knn_top1_{s}_teacher_{size}", []).append(v)
    for seed in args.seeds:
        run = args.out / f"seed{seed}"
        if not (run / "export").is_dir():
            secs = distill(args.work, run, args.steps, seed)
            print(f"seed {seed}: {args.steps} steps, 3 students, {secs:.0f} s")
        for name in STUDENTS:
            model = load(run, which=name)
            torch.manual_seed(seed)
            random = build_vit(**model.arch_config()).eval()
            for arm, m in (("distilled", model), ("random", random)):
                for size in EVAL_SIZES:
                    for s, v in knn(m, sets, size).items():
                        acc.setdefault(f"knn_top1_{s}_{name}_{arm}_{size}", []).append(v)
    lines = {}
    for key, xs in acc.items():
        mu = sum(xs) / len(xs)
        sd = (sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0
        lines[key] = mu
        print(f"{key}: {mu:.3f} ± {sd:.3f}  (seeds {args.seeds}: {', '.join(f'{x:.3f}' for x in xs)})")
    for name in STUDENTS:
        for s in sets:
            for size in EVAL_SIZES:
                d = lines[f"knn_top1_{s}_{name}_distilled_{size}"] - lines[f"knn_top1_{s}_{name}_random_{size}"]
                print(f"{name}_gain_{s}_{size}: {d:+.3f}")
    (args.out / "results.json").write_text(json.dumps(acc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
