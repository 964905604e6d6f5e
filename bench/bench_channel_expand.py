"""Which RGB -> N-channel patch-embedding expansion to continue pretraining from (docs/multichannel.md)?

The release: an RGB vit_test pretrained here (default: bench_quality's teacher, ``python bench/bench_quality.py``
writes it). The new domain: 4-band tiles (R, G, B, grey as 16-bit TIFF; dinopipe/data/samples_nch.py) of random
views of the real photos, never noise. Measured: kNN top-1 (k = 20, 56 px) on a labelled 4-band instance-retrieval
set (class = source photo, gallery and queries are other views), for

  mean      every band gets the mean RGB kernel x 3/N            (model.expand_patch_embed=mean)
  rgb_map   R, G, B bands get W_R, W_G, W_B, grey the mean; x 3/N (model.expand_patch_embed=rgb_map, rgb_channels=[0,1,2])
  random    a 4-channel vit_test at random init (the floor)

at step 0 and after ``--steps`` of continued pretraining (``dinopipe pretrain``, the quickstart recipe at one
resolution, fresh heads, per-channel statistics from ``dinopipe channel-stats``) for each of ``--seeds``. The
release on the same views as RGB photos is printed as the reference. Prints ``name: value`` lines and a table.

    python bench/bench_channel_expand.py [--release DIR] [--steps 150] [--seeds 2] [--out runs/bench_channels]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

CHANNELS = 4
SIZE = 56
RECIPE = [  # the quickstart recipe at one resolution (configs/pretrain/quickstart.yaml), bench_quality's batch
    "model.name=vit_test", "model.img_size=56", "model.drop_path_rate=0.0", "model.attn_backend=sdpa",
    "crops.local_crops_number=4", "train.epoch_length=50", "train.log_every=25", "train.progress=false",
    "train.checkpoint_every=100000", "data.num_workers=1", "parallel.param_dtype=fp32",
    "teacher.warmup_teacher_temp_epochs=1",
    "phases=[{name: base, fraction: 1.0, global_crops_size: 56, local_crops_size: 28, batch_size_per_gpu: 32}]",
]


def make_data(out: Path, n_pool: int, n_gallery: int, n_queries: int) -> None:
    """4-band pool tiles, and the labelled eval views twice: 4-band TIFF and the same view as an RGB PNG."""
    from PIL import Image

    from dinopipe.data.samples import _random_view, real_photos
    from dinopipe.data.samples_nch import bands, build_multichannel_pool, encode_tile

    if (out / ".complete").is_file():
        return
    build_multichannel_pool(out / "pool", CHANNELS, n_pool, size=96, fmt="tiff16", seed=0)
    photos, rng = real_photos(), np.random.default_rng(1)
    for split, n in (("train", n_gallery), ("val", n_queries)):
        for name in sorted(photos):
            for kind in ("bands", "rgb"):
                (out / kind / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                view = _random_view(photos[name], rng, 112)
                (out / "bands" / split / name / f"{i:03d}.tif").write_bytes(encode_tile(bands(view, CHANNELS), "tiff16"))
                Image.fromarray(view).save(out / "rgb" / split / name / f"{i:03d}.png")
    (out / ".complete").write_text("ok\n")


@torch.no_grad()
def features(model, root: Path, channels: int, mean, std):
    from dinopipe.data.channels import decode_channels
    from dinopipe.data.transforms import eval_transform
    from dinopipe.eval.features import model_features

    tf = eval_transform(SIZE, mean=mean, std=std)
    classes = sorted(p.name for p in root.iterdir())
    xs, ys = [], []
    for c, name in enumerate(classes):
        for f in sorted((root / name).iterdir()):
            xs.append(tf(decode_channels(f.read_bytes(), channels)[0]))
            ys.append(c)
    model = model.eval()
    feats = torch.cat([model_features(model, torch.stack(xs[i:i + 128])) for i in range(0, len(xs), 128)])
    return feats, torch.tensor(ys)


def knn(model, data: Path, channels: int, mean, std) -> float:
    from dinopipe.eval.knn import knn_classify

    tr, ytr = features(model, data / "train", channels, mean, std)
    va, yva = features(model, data / "val", channels, mean, std)
    return knn_classify(tr, ytr, va, yva, ks=(20,))[20]["top1"]


def expanded(release: Path, mode: str):
    import dinopipe
    from dinopipe.models.channels import expand_patch_embed

    return expand_patch_embed(dinopipe.load(release), CHANNELS, mode, [0, 1, 2] if mode == "rgb_map" else None)


def pretrain(run: Path, release: Path, mode: str, seed: int, steps: int, stats: list[str]) -> float:
    if not (run / "export" / "teacher" / "model.safetensors").is_file():
        extra = ["model.expand_patch_embed=rgb_map", "model.rgb_channels=[0,1,2]"] if mode == "rgb_map" else []
        cmd = [sys.executable, "-m", "dinopipe.train.pretrain", "--config", str(REPO / "configs/pretrain/quickstart.yaml"),
               *RECIPE, f"data.paths=[{run.parent.parent / 'data' / 'pool'}]", f"train.output_dir={run}",
               f"train.epochs={max(1, steps // 50)}", f"train.seed={seed}", f"model.pretrained={release}", *stats, *extra]
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
        t = time.time()
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"pretrain {run} failed ({r.returncode}):\n{r.stderr[-3000:]}")
        print(f"# trained {run.name} in {time.time() - t:.0f} s", flush=True)
    return time.time()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--release", default=str(REPO / "runs/bench_quality/teacher/export/teacher"))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "runs/bench_channels"))
    p.add_argument("--pool", type=int, default=600)
    args = p.parse_args(argv)
    import dinopipe
    from dinopipe.data.channels import channel_stats
    from dinopipe.models import create_model
    from dinopipe.utils.norm import IMAGENET_MEAN, IMAGENET_STD

    release, out = Path(args.release), Path(args.out)
    if not (release / "model.safetensors").is_file():
        print(f"error: no release at {release}: run `python bench/bench_quality.py` first or pass --release",
              file=sys.stderr)
        return 2
    make_data(out / "data", args.pool, n_gallery=10, n_queries=6)
    pool_files = sorted((out / "data" / "pool").iterdir())[:256]
    mean, std, _, _ = channel_stats((f.read_bytes() for f in pool_files), CHANNELS)
    fmt = lambda v: "[" + ",".join(f"{x:.6g}" for x in v) + "]"  # noqa: E731
    stats = [f"data.channels={CHANNELS}", f"data.mean={fmt(mean)}", f"data.std={fmt(std)}"]
    print("# " + " ".join(stats))
    bands = out / "data" / "bands"
    res: dict = {"release_rgb_on_rgb_views": knn(dinopipe.load(release), out / "data" / "rgb", 3, IMAGENET_MEAN,
                                                 IMAGENET_STD)}
    torch.manual_seed(0)
    res["random_step0"] = knn(create_model("vit_test", img_size=SIZE, in_chans=CHANNELS, init_values=None), bands,
                              CHANNELS, mean, std)
    for mode in ("mean", "rgb_map"):
        res[f"{mode}_step0"] = knn(expanded(release, mode), bands, CHANNELS, mean, std)
        for seed in range(args.seeds):
            run = out / "runs" / f"{mode}_seed{seed}"
            pretrain(run, release, mode, seed, args.steps, stats)
            res[f"{mode}_step{args.steps}_seed{seed}"] = knn(dinopipe.load(run), bands, CHANNELS, mean, std)
    for k, v in res.items():
        print(f"{k}: {v:.3f}")
    print(f"\n| arm | step 0 | after {args.steps} steps (seeds 0..{args.seeds - 1}) | mean +- sd |\n|---|---|---|---|")
    for mode in ("mean", "rgb_map"):
        vals = [res[f"{mode}_step{args.steps}_seed{s}"] for s in range(args.seeds)]
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        print(f"| {mode} | {res[f'{mode}_step0']:.3f} | {', '.join(f'{v:.3f}' for v in vals)} | "
              f"{statistics.mean(vals):.3f} +- {sd:.3f} |")
    print(f"| random init | {res['random_step0']:.3f} | | |")
    print(f"| release on the RGB views (reference) | {res['release_rgb_on_rgb_views']:.3f} | | |")
    (out / "results.json").write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
