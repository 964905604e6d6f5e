"""Continued-pretraining bench (issue 23): does the head warm-up keep what a release knows while it adapts to a
new domain, where fresh heads at the same learning rate wreck it, and what keeps the rest? CPU, offline, seeds.

The release: ``--release DIR`` (a run / export trained here, e.g. bench/bench_quality.py's 1,000-step teacher,
the one docs/pretrain.md's table uses: crops of the 32 sample photos + the unlabelled digits train split), or by
default a vit_test pretrained here by ``dinopipe pretrain`` (configs/pretrain/bench_quality.yaml) on crops of the
sample photos only (``--release-steps``, default 600). The new domain (``--domain scans``, default): grey 'scans'
the release never saw -- shaded relief of a real elevation model cut into 16 regions and the 4 quadrants of a real
MRI slice, both shipped with matplotlib (:func:`shifted_sources`); 1,000 unlabelled views of them are the
continuation pool. ``--domain digits``: the older bench's (scikit-learn's digits, in bench_quality's pool).

Arms (each ``--steps`` steps from the release's backbone, configs/pretrain/vit_test_continue.yaml, the release's
recipe; per seed s: the heads' init and the data order), at each learning rate of ``--lrs`` (base lr; the peak
is base x sqrt(32 / 1024)):
  (a) ``fresh``   fresh heads, backbone and heads on one schedule, as ``model.pretrained`` does today. At the
                  recipe lr (the first of --lrs) with its one-epoch lr warm-up; at a higher lr without warm-up
                  (the issue's calibration: 0.02 without warm-up took the quickstart teacher from 0.508 to 0.402).
  (b) ``warmup``  the same lr schedule, plus the head warm-up: ``train.head_warmup_steps`` steps of heads only
                  against the frozen release, then the backbone's lr ramped from 0 over ``optim.backbone_warmup_steps``.
  (c) ``keep``    (b) with the backbone's lr a fraction of the heads' (``optim.backbone_lr_mult``, --backbone-lr-mult).
  (d) ``replay``  (b) with ``--replay`` images of the release's own pool next to the new pool in data.paths.
Measured: kNN top-1 (k = 20, T = 0.07, frozen L2-normalised CLS of the EMA teacher, 56 px) on the release's own
eval set (``photos``: instance retrieval over the 32 photos, 640 queries, as bench/bench_quality.py) and on the
new domain's (``scans``: 20-region instance retrieval, 500 gallery / 400 queries), at step 0 (the release) and at
every ``--every`` steps (the DCP checkpoints, read with dinopipe.load). Printed: mean ± sd over seeds of each arm
and point, the change from the release per seed, and its mean ± SE.
Goal (issue 23): (b)/(c)/(d) lose <= 0.01 on photos and gain on the new domain, where (a) is shown to lose.

    nice python bench/bench_continue.py --release runs/bench_quality/teacher --seeds 3 \
        --arms fresh,warmup,keep,replay          # the docs' table: 2 lrs x 4 arms x 3 seeds x 100 steps
    python bench/bench_continue.py --eval-only --release runs/bench_quality/teacher --arms ...  # re-evaluate
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # 2 shared cores: idle OpenMP threads must not spin

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

import common as C  # noqa: E402
import bench_quality as Q  # noqa: E402  (eval sets, the stage runner, kNN evaluation)

CONTINUE_CFG = REPO / "configs" / "pretrain" / "vit_test_continue.yaml"
EPOCH_LENGTH = Q.EPOCH_LENGTH
SETS = ["photos", "scans"]  # the release's eval set, the new domain's (--domain digits: the older bench's)
ARMS = ("fresh", "warmup", "keep", "replay")


def shifted_sources() -> dict[str, np.ndarray]:
    """The new domain's pictures, none of them in the release's pool (dinopipe.data.samples.real_photos: photos,
    skimage's retina / cell / immunohistochemistry / hubble) nor in digits: shaded relief of a real elevation model
    (matplotlib's Jacksboro fault DEM, 344 x 403, through matplotlib.colors.LightSource) cut into a 4 x 4 grid of
    regions, and the four quadrants of a real MRI slice (matplotlib's s1045.ima, 256 x 256, 16 bit): 20 grey
    'scans', shipped with matplotlib, offline. Class = region, as the photos' instance retrieval."""
    import gzip

    import matplotlib.cbook as cbook
    from matplotlib.colors import LightSource

    dem = np.load(cbook.get_sample_data("jacksboro_fault_dem.npz", asfileobj=False))["elevation"].astype(np.float64)
    relief = LightSource(azdeg=315, altdeg=45).hillshade(dem, vert_exag=0.05, dx=30.0, dy=30.0)
    relief = (np.clip(relief, 0, 1) * 255).astype(np.uint8)
    with open(cbook.get_sample_data("s1045.ima.gz", asfileobj=False), "rb") as fh:
        raw = gzip.decompress(fh.read()) if fh.peek(2)[:2] == b"\x1f\x8b" else fh.read()
    mri = np.frombuffer(raw, np.uint16).reshape(256, 256).astype(np.float64)
    mri = (255 * mri / np.percentile(mri, 99.5)).clip(0, 255).astype(np.uint8)
    out = {}
    h, w = relief.shape
    for i in range(4):
        for j in range(4):
            out[f"relief_{i}{j}"] = relief[i * h // 4:(i + 1) * h // 4, j * w // 4:(j + 1) * w // 4]
    for i in range(2):
        for j in range(2):
            out[f"mri_{i}{j}"] = mri[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
    return {k: np.ascontiguousarray(np.stack([v] * 3, axis=-1)) for k, v in out.items()}


def build_shifted_set(root: Path, pool: Path, n_gallery: int, n_queries: int, n_pool: int, seed: int,
                      size: int = 64) -> dict:
    """Labelled gallery / queries of the 20 scans (Q._jittered_crop views, as the photos' eval set) and an
    unlabelled continuation pool of other views of them (three separate random streams)."""
    src = shifted_sources()
    names = sorted(src)
    for split, n, s in (("train", n_gallery, seed + 1), ("val", n_queries, seed + 2)):
        rng = np.random.default_rng(s)
        for name in names:
            d = root / split / name
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                Q._jittered_crop(src[name], rng, size).save(d / f"{i:03d}.png")
    pool.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed + 3)
    for i in range(n_pool):
        Q._jittered_crop(src[names[i % len(names)]], rng, size).save(pool / f"{i:05d}.png")
    return {"classes": len(names), "train": n_gallery * len(names), "val": n_queries * len(names), "pool": n_pool}


def release(args, work: Path) -> tuple[Path, float]:
    """(the release's run dir or export, seconds spent training it)."""
    if args.release:
        path = Path(args.release).resolve()
        print(f"release: {path} (given)")
        return path, 0.0
    from dinopipe.data.samples import build_sample_pool

    run = work / "release"
    if (args.reuse_release or args.keep_runs) and (run / "export").is_dir():
        print(f"release: {run} (kept from an earlier run)")
        return run, 0.0
    pool = build_sample_pool(work, n_images=args.release_pool, copy_fraction=0.0, size=128, seed=args.seed,
                             corrupt=False)
    secs = Q.run_stage("pretrain", Q.PRETRAIN_CFG, run,
                       Q.schedule_overrides(args.release_steps, work / "pool", args.seed))
    print(f"release: {args.release_steps} steps on {args.release_pool} crops of {pool['photos']} photos in {secs:.0f} s, "
          f"last {Q.last_losses(run)}", flush=True)
    return run, secs


def arm_overrides(arm: str, lr: float, args, first_lr: float) -> list[str]:
    """(a) fresh heads on one schedule; (b) the same schedule with the head warm-up; (c) keep: (b) with the
    backbone's lr a fraction of the heads' (optim.backbone_lr_mult); (d) replay: (b) on the new pool plus images of
    the release's pool (data.paths takes both). The recipe lr keeps the one-epoch lr warm-up; a higher lr runs
    without it (where fresh heads hurt most)."""
    out = [f"optim.base_lr={lr}", f"optim.warmup_epochs={1 if lr == first_lr else 0}", "model.pretrained_heads=null"]
    if arm == "fresh":
        return out + ["train.head_warmup_steps=0", "optim.backbone_warmup_steps=0", "optim.backbone_lr_mult=1.0"]
    out += [f"train.head_warmup_steps={args.head_warmup}", f"optim.backbone_warmup_steps={args.backbone_warmup}"]
    return out + [f"optim.backbone_lr_mult={args.backbone_lr_mult if arm == 'keep' else 1.0}"]


def run_arm(work: Path, rel: Path, pool: list[Path], arm: str, lr: float, seed: int, args, first_lr: float) -> float:
    if arm != "replay":
        pool = pool[:1]
    run = work / f"{arm}_lr{lr:g}" / f"seed{seed}"
    if (run / "export").is_dir():
        return 0.0
    if run.exists():
        shutil.rmtree(run)
    run.parent.mkdir(parents=True, exist_ok=True)
    overrides = [f"train.epochs={args.steps // EPOCH_LENGTH}", f"train.epoch_length={EPOCH_LENGTH}",
                 f"data.paths=[{','.join(map(str, pool))}]", f"train.seed={seed}", f"model.pretrained={rel}",
                 f"train.checkpoint_every={args.every}", "train.keep_last=100",
                 *arm_overrides(arm, lr, args, first_lr)]
    secs = Q.run_stage("pretrain", CONTINUE_CFG, run, overrides)
    print(f"  {arm} lr {lr:g} seed {seed}: {args.steps} steps in {secs:.0f} s, last {Q.last_losses(run)}, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    return secs


def evaluate_runs(work: Path, rel: Path, arms: list[tuple[str, float]], seeds: list[int], points: list[int]):
    """{'release': {set: acc}, (arm, lr): {seed: {step: {set: acc}}}} -- kNN top-1 at k = 20."""
    from dinopipe import load
    from dinopipe.eval import open_labelled

    sets = {}
    for name in SETS:
        train = open_labelled(work / name / "train")
        sets[name] = (train, open_labelled(work / name / "val", classes=train.classes))

    def acc(model) -> dict[str, float]:
        return {s: r[20] for s, r in Q.evaluate(model, sets).items()}

    released = load(rel)
    heads = released.arch_config()["num_heads"]  # the runs' configs name a pretrained file, not the architecture
    out: dict = {"release": acc(released)}
    for arm, lr in arms:
        out[(arm, lr)] = {}
        for seed in seeds:
            run = work / f"{arm}_lr{lr:g}" / f"seed{seed}"
            out[(arm, lr)][seed] = {step: acc(load(run / "checkpoints" / f"step_{step:08d}", num_heads=heads)) for step in points}
    return out


def warmup_step_cost(rel: Path, pool: Path, rounds: int = 15) -> float:
    """Compute time of a head warm-up step (no backbone backward or update) over a full step, in this process on
    one batch of 32 (forward, backward, AdamW, EMA; no data loading): median of interleaved per-round ratios."""
    import glob
    from functools import partial

    from PIL import Image

    from dinopipe import hub
    from dinopipe.config import load_config
    from dinopipe.data.transforms import MultiCropAugmentation, MultiCropCollator
    from dinopipe.ssl.config import PretrainConfig
    from dinopipe.ssl.param_groups import build_param_groups
    from dinopipe.ssl.task import SSLTask
    from dinopipe.train.builders import build_schedules

    cfg = load_config(PretrainConfig, str(CONTINUE_CFG), [f"model.pretrained={rel}", "model.pretrained_heads=null",
                                                          f"data.paths=[{pool}]"])
    ph = cfg.phases[0]
    aug = MultiCropAugmentation(global_size=ph.global_crops_size, local_size=ph.local_crops_size,
                                n_local=cfg.crops.local_crops_number)
    files = sorted(glob.glob(str(pool / "*.png")))[:ph.batch_size_per_gpu]
    batch = MultiCropCollator(14, mask_probability=0.5)([aug(Image.open(f).convert("RGB"), seed=i)
                                                         for i, f in enumerate(files)])
    task = SSLTask(cfg, load_backbone=hub.load, load_heads=hub.load_heads)
    opt = task.build_optimizer(partial(build_param_groups, lr_decay_rate=cfg.optim.layerwise_decay))
    sched = build_schedules(cfg)
    frozen_step, full_step = 0, len(sched["lr"]) - 1

    def step(i: int) -> float:
        values = {k: float(v[i]) for k, v in sched.items()}
        t = time.perf_counter()
        opt.zero_grad()
        loss, _ = task(batch, values)
        loss.backward()
        opt.step()
        task.after_step(values)
        return time.perf_counter() - t

    for i in (frozen_step, full_step):  # warm caches
        step(i)
    ratios = [step(frozen_step) / step(full_step) for _ in range(rounds)]
    return float(sorted(ratios)[len(ratios) // 2])


def report(accs: dict, arms: list[tuple[str, float]], seeds: list[int], points: list[int], args) -> dict:
    rel = accs["release"]
    rows, lines = [], {}
    for s in SETS:
        lines[f"knn_top1_{s}_release"] = rel[s]
        print(f"knn_top1_{s}_release: {rel[s]:.3f}")
    for arm, lr in arms:
        for step in points:
            cells = []
            for s in SETS:
                mu, sd = Q.mean_sd([accs[(arm, lr)][seed][step][s] for seed in seeds])
                key = f"{arm}_lr{lr:g}_step{step}_{s}"
                lines[f"knn_top1_{key}"], lines[f"knn_top1_{key}_sd"] = mu, sd
                cells.append(f"{mu:.3f} ± {sd:.3f} ({mu - rel[s]:+.3f})")
            rows.append((arm, f"{lr:g}", str(step), *cells))
    C.print_table(f"kNN top-1, k=20, mean ± sd over seeds {seeds} (change from the release: photos {rel['photos']:.3f}, "
                  f"{SETS[1]} {rel[SETS[1]]:.3f})", rows, ("arm", "base lr", "step", *SETS))
    print()
    goals = []
    end = points[-1]
    for arm, lr in arms:
        for s in SETS:
            d = [accs[(arm, lr)][seed][end][s] - rel[s] for seed in seeds]
            mu, sd = Q.mean_sd(d)
            se = sd / len(d) ** 0.5
            lines[f"{arm}_lr{lr:g}_minus_release_{s}"] = mu
            lines[f"{arm}_lr{lr:g}_minus_release_{s}_se"] = se
            lines[f"{arm}_lr{lr:g}_minus_release_{s}_per_seed"] = d
            print(f"{arm}_lr{lr:g}_minus_release_{s}: {mu:+.3f} ± {se:.3f} SE (sd {sd:.3f}; per seed "
                  f"{' '.join(f'{x:+.3f}' for x in d)})")
        keep = lines[f"{arm}_lr{lr:g}_minus_release_photos"]
        gain = lines[f"{arm}_lr{lr:g}_minus_release_{SETS[1]}"]
        if arm != "fresh":
            goals.append((f"({'-abcd'[ARMS.index(arm) + 1]}) {arm} lr {lr:g}: photos >= -0.01 and {SETS[1]} > 0",
                          f"{'met' if keep >= -0.01 and gain > 0 else 'NOT met'} ({keep:+.3f}, {gain:+.3f})"))
        else:
            goals.append((f"(a) fresh lr {lr:g}: photos lost", f"{'yes' if keep < -0.01 else 'no'} ({keep:+.3f})"))
    C.print_table(f"goals (issue 23) at step {end}", goals)
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=None, help="data and runs (default runs/bench_continue); wiped at the start "
                                                   "except a kept release (--reuse-release)")
    p.add_argument("--release", default=None, help="a run dir / export to continue from (default: train one)")
    p.add_argument("--reuse-release", action="store_true", help="keep the work dir's trained release")
    p.add_argument("--release-steps", type=int, default=600, help=f"multiple of {EPOCH_LENGTH}")
    p.add_argument("--release-pool", type=int, default=2400, help="photo crops in the release's pool")
    p.add_argument("--steps", type=int, default=100, help=f"continuation steps per arm, a multiple of {EPOCH_LENGTH}")
    p.add_argument("--every", type=int, default=50, help="evaluate every this many steps (checkpoints)")
    p.add_argument("--lrs", default="0.005,0.02", help="base lrs; the first is the recipe's (with its lr warm-up)")
    p.add_argument("--head-warmup", type=int, default=30, help="(b): steps of heads only")
    p.add_argument("--backbone-warmup", type=int, default=30, help="(b): steps of the backbone's lr ramp")
    p.add_argument("--backbone-lr-mult", type=float, default=0.2, help="(c) keep: (b) + optim.backbone_lr_mult")
    p.add_argument("--arms", default=",".join(ARMS[:3]), help=f"of {','.join(ARMS)}")
    p.add_argument("--domain", default="scans", choices=("scans", "digits"),
                   help="the new domain: scans (shaded relief + MRI, unseen by the release) or digits (the older "
                        "bench's: in bench_quality's teacher pool)")
    p.add_argument("--gallery", type=int, default=25, help="scans: gallery views per region")
    p.add_argument("--queries", type=int, default=20, help="scans: query views per region")
    p.add_argument("--pool", type=int, default=1000, help="scans: unlabelled views in the continuation pool")
    p.add_argument("--replay", type=int, default=1000, help="(d) replay: this many images of the release's pool "
                                                            "(--replay-pool, a random sample) next to the new pool")
    p.add_argument("--replay-pool", default=str(REPO / "runs" / "bench_quality" / "pool"))
    p.add_argument("--step-cost", action="store_true", help="also time a warm-up step against a full one")
    p.add_argument("--seed", type=int, default=0, help="first seed; also the release's and the eval sets'")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--keep-runs", action="store_true", help="keep everything an earlier call left and train only "
                                                            "what is missing (e.g. more --seeds); implies --reuse-release")
    p.add_argument("--eval-only", action="store_true", help="evaluate the runs an earlier call left")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="also write every number to this file")
    args = p.parse_args(argv)
    if args.steps % EPOCH_LENGTH or args.steps % args.every or args.seeds < 1:
        raise SystemExit(f"error: --steps must be a multiple of {EPOCH_LENGTH} and of --every; --seeds >= 1")
    lrs = [float(x) for x in args.lrs.split(",")]
    SETS[1] = args.domain
    arms = [(arm, lr) for lr in lrs for arm in args.arms.split(",")]
    seeds = list(range(args.seed, args.seed + args.seeds))
    points = list(range(args.every, args.steps + 1, args.every))
    work = Path(args.workdir or REPO / "runs" / "bench_continue").resolve()
    if work.exists() and not args.eval_only:
        for child in work.iterdir():
            if not args.keep_runs and not (args.reuse_release and child.name in ("release", "release.log", "pool")):
                shutil.rmtree(child) if child.is_dir() else child.unlink()
    work.mkdir(parents=True, exist_ok=True)
    C.setup(args.threads, args.seed)
    print(f"work dir {work}; arms {arms}; seeds {seeds}; {args.steps} steps, eval at {points}; "
          f"load average at start {os.getloadavg()[0]:.1f}", flush=True)
    t_start = time.perf_counter()
    times: dict[str, float] = {}
    if args.eval_only:
        rel = Path(args.release).resolve() if args.release else work / "release"
    else:
        photos = Q.build_photo_set(work / "photos", 20, 20, seed=args.seed + 100)
        new = SETS[1]
        pool = work / f"{new}_pool"
        if new == "digits":
            n = Q.build_digits_set(work / "digits", seed=args.seed)
            n["pool"] = Q.add_unlabelled(work / "digits" / "train", pool)
        else:
            n = build_shifted_set(work / new, pool, args.gallery, args.queries, args.pool, seed=args.seed)
        pools = [pool]
        if "replay" in args.arms:  # images of the release's own pool mixed in (data.paths takes several sources)
            replay = work / "replay"
            src = sorted(Path(args.replay_pool).glob("*.jpg"))
            if len(src) < args.replay:
                raise SystemExit(f"error: --replay-pool {args.replay_pool} has {len(src)} images, fewer than --replay")
            replay.mkdir(exist_ok=True)
            for i in np.random.default_rng(args.seed).choice(len(src), args.replay, replace=False):
                shutil.copyfile(src[i], replay / src[i].name)
            pools.append(replay)
        print(f"photos eval: {photos}; {new}: {n}; replay: {args.replay} images", flush=True)
        rel, times["release"] = release(args, work)
        first = lrs[0]
        for seed in seeds:
            for arm, lr in arms:
                times[f"{arm}_lr{lr:g}"] = times.get(f"{arm}_lr{lr:g}", 0.0) + run_arm(work, rel, pools, arm, lr, seed,
                                                                                     args, first)
    t0 = time.perf_counter()
    accs = evaluate_runs(work, rel, arms, seeds, points)
    times["eval"] = time.perf_counter() - t0
    lines = report(accs, arms, seeds, points, args)
    lines["head_warmup_step_time_ratio"] = (warmup_step_cost(rel, work / f"{SETS[1]}_pool")
                                            if args.step_cost else float("nan"))
    print(f"head_warmup_step_time_ratio: {lines['head_warmup_step_time_ratio']:.2f} (compute of a warm-up step over a "
          f"full step, one batch, no data loading; load {os.getloadavg()[0]:.1f})")
    wall = time.perf_counter() - t_start
    C.print_table("wall time (arms summed over seeds)", [(k, f"{v:.0f} s") for k, v in times.items()]
                  + [("total wall", f"{wall:.0f} s")])
    print(f"\nbench_wall_s: {wall:.0f}\nload_average_1min_end: {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"lines": lines, "times": times, "wall_s": wall,
                                               "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
