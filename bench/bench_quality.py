"""Quality bench (issues 5, 14): does pretraining teach anything, and does distillation beat training from
scratch -- by more than the spread over seeds? Everything on CPU, on real photos shipped in pip packages.

Seeds (``--seeds``, default 3): the teacher is trained once (``--seed``); every student arm (distilled ssl,
distilled feature, scratch, and the random inits) is run once per seed s = seed, seed + 1, ... -- s sets the
student's init and the data order (``train.seed``). The eval sets are fixed (built from ``--seed``). Printed:
mean +- sd over seeds per arm and set, and each difference paired by seed (the distilled and scratch students
of one seed share init seed and data order) with its standard error sd(d) / sqrt(n). The standard error is over
training seeds only: the queries are the same for every arm, so it leaves out the sampling error of the eval
set itself (~0.02 at 640 / 797 queries), which paired differences largely share.

Models (kNN top-1 on frozen, L2-normalised CLS features, k = 10 and 20, T = 0.07 -- DINO's protocol):
  (a) ``random``     the student architecture (vit_test at embed 32, 1 head, depth 2, no LayerScale), random init
  (b) ``teacher``    a vit_test (embed 64, depth 4) pretrained with ``dinopipe pretrain`` (DINO + iBOT + KoLeo)
                     on a pool of crops of the photos (``build_sample_pool``) + the unlabelled digits train
                     split (see below); the exported EMA teacher
  (c) ``distilled_ssl``      the student distilled from (b) with ``dinopipe distill`` in ssl mode (DINOv2's
                             recipe: DINO + iBOT against the frozen teacher's heads)
      ``distilled_feature``  the same in feature mode (cosine to the teacher's CLS and patch tokens through
                             learned projections; the mode for released backbones without heads)
  (d) ``scratch``    the student pretrained with ``dinopipe pretrain``, same steps, batch, crops, lr, data
  plus ``random_teacher_arch``: (b)'s architecture at random init, the baseline (b) has to beat.

Eval sets (labelled image folders, class = sub-folder):
  photos   instance retrieval: class = source photo (the 32 of ``real_photos()``); gallery and queries are
           independent random resized crops (20-70 % of the side) with colour jitter and flips, drawn from
           different seeds (held-out views of the same pictures).
  digits   scikit-learn's 8x8 digits upscaled to 64 px, class = digit; a seeded 1000 / 797 split. The 1000
           train images join the pretraining / distillation pool *unlabelled* (as DINOv2's LVD-142M holds
           images retrieved for its eval sets' train splits); the 797 val images are never trained on.
           ``--no-pool-digits``: photo crops only, digits then measure out-of-domain transfer (measured: a
           teacher trained longer on the 32 photos gets *worse* on digits, 0.70 after 500 steps, 0.63 after
           1000, and its students inherit that).

Lines: ``knn_top1_<set>_<model>: mean ± sd`` (k = 20), ``<a>_minus_<b>_<set>: +d (se s, z se, per seed ...)``
for distilled_<mode> - scratch, teacher - random_teacher_arch, scratch - random; ``bench_wall_s`` and the load
average sampled after each stage (the cores are shared).
Goal (issue 14): each distilled arm beats scratch by more than 2 standard errors on both sets.

Recipe (configs/{pretrain,distill}/bench_quality.yaml), and why, from runs on this 2-core machine:
- no LayerScale (``init_values: null``): at 1e-5 every block starts as the identity, a random net gives all
  images the same CLS token (random-init kNN at chance, 0.03 on photos), the EMA teacher's targets are
  uniform and 600 steps left the DINO loss at ln(1024); the teacher reached 0.36 on photos. Without it: 0.45
  after 400 steps -- but random init is then no longer at chance (0.35: patch-embedding statistics).
- EMA momentum 0.95 -> 0.99 (teacher of the pretraining runs, students' EMA when distilling): at 0.99 -> 0.999
  a 200-step distilled student kept ~e^-1 of its random init and scored 0.31 on photos; 0.95 -> 0.99: 0.38.
- distillation teacher temperature 0.04, no warm-up: the young teacher's targets are nearly flat at 0.07.
- ssl-mode KoLeo 0.3 on the students' CLS (issue 14): the teacher's head targets hold less than its CLS (kNN 0.37 /
  0.57 against 0.49 / 0.77, printed as ``teacher_*_knn_top1_*``); at 0.1 the ssl students stop at their targets'
  level on digits (0.569 over 3 seeds, no better than scratch), at 0.3 they go past it (0.616).

    python bench/bench_quality.py                     # 3 seeds; wall time and load in the README
    python bench/bench_quality.py --quick --seeds 2   # a smoke run of the same pipeline, a few minutes
    python bench/bench_quality.py --reuse-teacher --seeds 5   # more seeds on the same teacher
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # 2 shared cores: idle OpenMP threads must not spin

import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

import common as C  # noqa: E402

PRETRAIN_CFG = REPO / "configs" / "pretrain" / "bench_quality.yaml"
DISTILL_CFG = REPO / "configs" / "distill" / "bench_quality.yaml"
EVAL_SIZE = 56  # the training crop size; every model is evaluated at it
EPOCH_LENGTH = 50  # steps per schedule 'epoch': the yaml's warm-ups (in epochs) scale with the run through this
# Steps and pool sizes. Full: one teacher (1000 steps) and 3 arms x --seeds students of 200 steps each (2800 steps
# at the default 3 seeds, ~25 min on 2 quiet cores); quick: the same pipeline, a few minutes.
RECIPES = {
    "full": dict(teacher_steps=1000, student_steps=200, pool=2400, gallery=20, queries=20),
    "quick": dict(teacher_steps=100, student_steps=50, pool=400, gallery=8, queries=4),
}
DISTILL_MODES = ("ssl", "feature")
MODELS = ["random", "random_teacher_arch", "teacher", *[f"distilled_{m}" for m in DISTILL_MODES], "scratch"]


def set_modes(modes: tuple[str, ...]) -> None:
    """Run (and report) only these distillation modes, e.g. ``--modes ssl`` when the cores are short."""
    global DISTILL_MODES, MODELS
    bad = [m for m in modes if m not in ("ssl", "feature")]
    if bad or not modes:
        raise SystemExit(f"error: --modes: expected a comma list of ssl, feature; got {','.join(modes)}")
    DISTILL_MODES = modes
    MODELS = ["random", "random_teacher_arch", "teacher", *[f"distilled_{m}" for m in modes], "scratch"]


# -- eval sets ------------------------------------------------------------------------------------------------
def _jittered_crop(arr: np.ndarray, rng: np.random.Generator, size: int) -> Image.Image:
    """A random square crop (20-70 % of the short side), flipped half the time, with brightness / contrast /
    saturation jitter: a new view of the same picture."""
    h, w = arr.shape[:2]
    side = int(min(h, w) * rng.uniform(0.2, 0.7))
    y, x = rng.integers(0, h - side + 1), rng.integers(0, w - side + 1)
    img = np.asarray(Image.fromarray(arr[y:y + side, x:x + side]).resize((size, size), Image.BICUBIC), np.float32)
    if rng.random() < 0.5:
        img = img[:, ::-1]
    grey = img.mean(axis=-1, keepdims=True)
    img = grey + (img - grey) * rng.uniform(0.6, 1.4)  # saturation
    img = img.mean() + (img - img.mean()) * rng.uniform(0.7, 1.3)  # contrast
    img = img * rng.uniform(0.7, 1.3) * rng.uniform(0.9, 1.1, size=3)  # brightness, colour cast
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def build_photo_set(root: Path, n_gallery: int, n_queries: int, seed: int, size: int = 64) -> dict:
    from dinopipe.data.samples import real_photos

    photos = real_photos()
    for split, n, s in (("train", n_gallery, seed + 1), ("val", n_queries, seed + 2)):
        rng = np.random.default_rng(s)  # queries come from another stream than the gallery
        for name in sorted(photos):
            d = root / split / name
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                _jittered_crop(photos[name], rng, size).save(d / f"{i:03d}.jpg", quality=95)
    return {"classes": len(photos), "train": n_gallery * len(photos), "val": n_queries * len(photos)}


def build_digits_set(root: Path, seed: int, n_train: int = 1000, size: int = 64) -> dict:
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.images))
    for j, i in enumerate(order):
        split = "train" if j < n_train else "val"
        d = root / split / str(int(digits.target[i]))
        d.mkdir(parents=True, exist_ok=True)
        img = Image.fromarray((digits.images[i] * (255 / 16)).astype(np.uint8)).resize((size, size), Image.BICUBIC)
        img.convert("RGB").save(d / f"{i:04d}.png")
    return {"classes": 10, "train": n_train, "val": len(order) - n_train}


def add_unlabelled(labelled_root: Path, out: Path) -> int:
    """Copy a labelled folder's images into one flat folder, names without the class: unlabelled pool images."""
    out.mkdir(parents=True, exist_ok=True)
    files = sorted(labelled_root.rglob("*.png"))
    for i, f in enumerate(files):
        shutil.copyfile(f, out / f"{i:05d}.png")
    return len(files)


# -- training (the real command-line entries, as a user runs them) ------------------------------------------------
def run_stage(stage: str, config: Path, run_dir: Path, overrides: list[str]) -> float:
    cmd = [sys.executable, "-m", f"dinopipe.train.{stage}", "--config", str(config),
           f"train.output_dir={run_dir}", *overrides]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    log = run_dir.with_suffix(".log")
    with open(log, "w") as f:
        rc = subprocess.call(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
    if rc != 0:
        tail = "".join(log.read_text().splitlines(True)[-30:])
        raise SystemExit(f"error: dinopipe {stage} exited {rc} (log {log}):\n{tail}")
    return time.perf_counter() - t0


def schedule_overrides(steps: int, pool: Path, seed: int) -> list[str]:
    if steps % EPOCH_LENGTH:
        raise SystemExit(f"error: steps must be a multiple of {EPOCH_LENGTH}, got {steps}")
    return [f"train.epochs={steps // EPOCH_LENGTH}", f"train.epoch_length={EPOCH_LENGTH}", f"data.paths=[{pool}]",
            f"train.seed={seed}"]


def _teacher_steps(run_dir: Path) -> int | None:
    """Steps of a finished teacher run (its export exists), from its saved config; None otherwise."""
    if not (run_dir / "export").is_dir() or not (run_dir / "config.yaml").is_file():
        return None
    from omegaconf import OmegaConf

    t = OmegaConf.load(run_dir / "config.yaml").train
    return int(t.epochs) * int(t.epoch_length)


def last_losses(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {k: round(v, 3) for k, v in rows[-1].items() if k.endswith("loss")} if rows else {}


# -- evaluation -----------------------------------------------------------------------------------------------
def evaluate(model, sets: dict[str, tuple]) -> dict[str, dict[int, float]]:
    from dinopipe.eval import extract_features, knn_classify

    out = {}
    for name, (train, val) in sets.items():
        kw = dict(img_size=EVAL_SIZE, batch_size=64, num_workers=0, device="cpu")
        ft, fv = extract_features(model, train, **kw), extract_features(model, val, **kw)
        res = knn_classify(ft.feats, ft.labels, fv.feats, fv.labels, ks=(10, 20), temperature=0.07,
                           num_classes=len(train.classes))
        out[name] = {k: r["top1"] for k, r in res.items()}
    return out


def student_spec():
    """The student's ModelConfig, from the distillation config: (a) and (d) are built from the same spec."""
    from dinopipe.config import load_config
    from dinopipe.ssl.distill_config import DistillConfig

    students = load_config(DistillConfig, str(DISTILL_CFG), []).students
    if len(students) != 1:
        raise SystemExit(f"error: {DISTILL_CFG} must name exactly one student, got {len(students)}")
    return students[0].model


def load_models(work: Path, seed: int) -> dict:
    """The arms of one seed: random inits drawn with ``seed``, the shared teacher, this seed's students."""
    import torch

    from dinopipe import load
    from dinopipe.models import build_vit, create_model

    spec = student_spec()
    torch.manual_seed(seed)
    random_student = create_model(spec.name, **spec.create_kwargs()).eval()
    teacher = load(work / "teacher")
    torch.manual_seed(seed)
    random_teacher = build_vit(**teacher.arch_config()).eval()
    runs = work / f"seed{seed}"
    return {"random": random_student, "random_teacher_arch": random_teacher, "teacher": teacher,
            **{f"distilled_{m}": load(runs / f"distill_{m}" / "export" / "student") for m in DISTILL_MODES},
            "scratch": load(runs / "scratch")}


def mean_sd(xs: list[float]) -> tuple[float, float]:
    m = float(np.mean(xs))
    return m, float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0


def report(accs: dict[int, dict], sets: list[str]) -> dict[str, float]:
    """Means +- sd over seeds per arm and set (k = 20), and each difference paired by seed with its standard
    error sd(d) / sqrt(n): the distilled and scratch students of one seed share the init seed and data order."""
    seeds = sorted(accs)
    n = len(seeds)
    rows = []
    for m in MODELS:
        cells = []
        for s in sets:
            mu, sd = mean_sd([accs[i][m][s][20] for i in seeds])
            cells.append(f"{mu:.3f} ± {sd:.3f}")
        rows.append((m, *cells))
    C.print_table(f"kNN top-1, k=20 (frozen CLS, T=0.07): mean ± sd over {n} seed(s) {seeds}"
                  + " (the teacher is shared: its sd is 0)", rows, ("model", *sets))
    lines: dict[str, float] = {}
    print()
    for s in sets:
        for m in MODELS:
            mu, sd = mean_sd([accs[i][m][s][20] for i in seeds])
            lines[f"knn_top1_{s}_{m}"] = mu
            print(f"knn_top1_{s}_{m}: {mu:.3f} ± {sd:.3f}")
    pairs = [(f"distilled_{m}", "scratch") for m in DISTILL_MODES] + [("teacher", "random_teacher_arch"),
                                                                       ("scratch", "random")]
    goals = []
    for a, b in pairs:
        for s in sets:
            d = [accs[i][a][s][20] - accs[i][b][s][20] for i in seeds]
            mu, sd = mean_sd(d)
            se = sd / np.sqrt(n) if n > 1 else float("nan")
            z = mu / se if se > 0 else float("inf") if mu > 0 else float("-inf")
            key = f"{a}_minus_{b}_{s}"
            lines[key], lines[key + "_se"] = mu, se
            print(f"{key}: {mu:+.3f} (se {se:.3f}, {z:+.1f} se, per seed {' '.join(f'{x:+.3f}' for x in d)})")
            if b == "scratch":
                goals.append((f"{a} - scratch ({s}) > 2 se", "met" if z > 2 else "NOT met"))
    C.print_table("goals (issue 14): distilled beats scratch by more than 2 standard errors over seeds", goals)
    return lines


def teacher_targets(work: Path, sets: dict[str, tuple], n_centre: int = 680) -> dict[str, dict[str, float]]:
    """How much of the teacher survives in the ssl-mode targets: kNN top-1 (k = 20) on the teacher's CLS, and on
    its DINO-head target distributions -- softmax((logits - centre) / T) at the distillation config's teacher
    temperature, the centre the mean logit over ``n_centre`` pool images (what the EMA centre converges to),
    and without centring. A student that reproduced the targets exactly would carry only what they carry."""
    import random

    import torch
    import torch.nn.functional as F

    from dinopipe.config import load_config
    from dinopipe.eval import extract_features, knn_classify
    from dinopipe.eval.features import eval_transform
    from dinopipe.hub import load, load_heads
    from dinopipe.ssl.base import build_head
    from dinopipe.ssl.distill_config import DistillConfig

    cfg = load_config(DistillConfig, str(DISTILL_CFG), [f"teacher_model.path={work / 'teacher'}"])
    path = cfg.teacher_model.path
    backbone = load(path, num_heads=cfg.teacher_model.num_heads)
    head = build_head(state_dict=load_heads(path)["dino_head"]).eval()
    temp = cfg.teacher.teacher_temp
    files = sorted(str(f) for f in (work / "pool").rglob("*") if f.suffix in (".jpg", ".png"))
    random.Random(0).shuffle(files)
    tf = eval_transform(EVAL_SIZE)
    with torch.no_grad():
        centre = head(backbone.eval()(torch.stack([tf(Image.open(f).convert("RGB")) for f in files[:n_centre]])))
        centre = centre.mean(0, keepdim=True)
    out = {}
    for name, (train, val) in sets.items():
        kw = dict(img_size=EVAL_SIZE, batch_size=64, num_workers=0, device="cpu", normalize=False)
        ft, fv = extract_features(backbone, train, **kw), extract_features(backbone, val, **kw)

        n_classes = len(train.classes)

        def knn(a, b, yt=ft.labels, yv=fv.labels, nc=n_classes):
            return knn_classify(F.normalize(a, dim=-1), yt, F.normalize(b, dim=-1), yv, ks=(20,),
                                temperature=0.07, num_classes=nc)[20]["top1"]

        with torch.no_grad():
            lt, lv = head(ft.feats), head(fv.feats)
        out[name] = {"cls": knn(ft.feats, fv.feats),
                     "targets": knn(F.softmax((lt - centre) / temp, -1), F.softmax((lv - centre) / temp, -1)),
                     "targets_uncentred": knn(F.softmax(lt / temp, -1), F.softmax(lv / temp, -1))}
        for k, v in out[name].items():
            print(f"teacher_{k}_knn_top1_{name}: {v:.3f}")
    return out


def train_seed(work: Path, pool_dir: Path, teacher_dir: Path, steps: int, seed: int) -> dict[str, float]:
    """The three trained arms of one seed: ssl- and feature-distilled students and the scratch student."""
    times: dict[str, float] = {}
    runs = work / f"seed{seed}"
    runs.mkdir(parents=True, exist_ok=True)
    spec = student_spec()
    student_model = [f"model.name={spec.name}"] + [f"model.{k}={'null' if v is None else v}"
                                                   for k, v in spec.create_kwargs().items()]
    for mode in DISTILL_MODES:
        run = runs / f"distill_{mode}"
        if (run / "export" / "student").is_dir():
            print(f"  seed {seed} (c) distilled ({mode}): kept from an earlier run")
            continue
        times[f"distill_{mode}"] = run_stage("distill", DISTILL_CFG, run,
                                             schedule_overrides(steps, pool_dir, seed)
                                             + [f"teacher_model.path={teacher_dir}", f"mode={mode}"]
                                             + (["dino.koleo_loss_weight=0"] if mode == "feature" else []))
        print(f"  seed {seed} (c) distilled ({mode}): {steps} steps in {times[f'distill_{mode}']:.0f} s, "
              f"last {last_losses(run)}, load {os.getloadavg()[0]:.1f}", flush=True)
    if (runs / "scratch" / "export").is_dir():
        print(f"  seed {seed} (d) scratch: kept from an earlier run")
        return times
    times["scratch"] = run_stage("pretrain", PRETRAIN_CFG, runs / "scratch",
                                 schedule_overrides(steps, pool_dir, seed) + student_model)
    print(f"  seed {seed} (d) scratch: {steps} steps in {times['scratch']:.0f} s, last {last_losses(runs / 'scratch')}, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    return times


def build_and_train(args, r: dict, work: Path, seeds: list[int], reuse: bool, loads: list[float]) -> dict[str, float]:
    """Pool, eval sets, the teacher (once) and every seed's students; returns seconds per stage."""
    t0 = time.perf_counter()
    from dinopipe.data.samples import build_sample_pool

    pool = build_sample_pool(work, n_images=r["pool"], copy_fraction=0.0, size=128, seed=args.seed, corrupt=False)
    photos = build_photo_set(work / "photos", r["gallery"], r["queries"], seed=args.seed + 100)
    digits = build_digits_set(work / "digits", seed=args.seed)
    n_digits = 0
    if args.pool_digits:  # the unlabelled digits *train* split joins the pool (the val split is never trained on)
        n_digits = add_unlabelled(work / "digits" / "train", work / "pool" / "digits_train_unlabelled")
    times = {"data": time.perf_counter() - t0}
    print(f"pretraining pool: {r['pool']} crops of {pool['photos']} photos + {n_digits} unlabelled digits; "
          f"photos eval: {photos}; digits: {digits}")

    pool_dir, teacher_dir = work / "pool", work / "teacher"
    if reuse:
        print(f"(b) teacher: reusing {teacher_dir} ({r['teacher_steps']} steps, trained by an earlier run)")
    else:
        times["teacher"] = run_stage("pretrain", PRETRAIN_CFG, teacher_dir,
                                     schedule_overrides(r["teacher_steps"], pool_dir, args.seed))
        print(f"(b) teacher: {r['teacher_steps']} steps in {times['teacher']:.0f} s, last {last_losses(teacher_dir)}")
    loads.append(os.getloadavg()[0])
    for seed in seeds:
        for k, v in train_seed(work, pool_dir, teacher_dir, r["student_steps"], seed).items():
            times[k] = times.get(k, 0.0) + v
        loads.append(os.getloadavg()[0])
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run of the same pipeline (~5 min)")
    p.add_argument("--workdir", default=None, help="where data and runs go (default runs/bench_quality[_quick]); "
                                                   "wiped at the start")
    p.add_argument("--teacher-steps", type=int, default=None, help=f"multiple of {EPOCH_LENGTH}")
    p.add_argument("--student-steps", type=int, default=None, help="distilled and scratch student steps")
    p.add_argument("--seed", type=int, default=0, help="first seed; also the seed of the teacher and the eval sets")
    p.add_argument("--seeds", type=int, default=3, help="student seeds (init and data order): seed, seed+1, ...")
    p.add_argument("--pool", type=int, default=None, help="photo crops in the training pool")
    p.add_argument("--no-pool-digits", dest="pool_digits", action="store_false",
                   help="pretrain and distil on the photo crops only (default: + the unlabelled digits train split)")
    p.add_argument("--reuse-teacher", action="store_true",
                   help="keep the work dir's trained teacher when it has the requested steps (same seed/config "
                        "assumed); everything else is rebuilt")
    p.add_argument("--modes", default="ssl,feature", help="distillation arms to run: ssl, feature or both")
    p.add_argument("--keep-runs", action="store_true",
                   help="keep the work dir's finished student runs and train only the missing arms (e.g. a second "
                        "--modes after a first run with fewer); implies --reuse-teacher")
    p.add_argument("--eval-only", action="store_true",
                   help="evaluate the runs an earlier invocation with the same --workdir/--seed/--seeds left")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="also write every number to this file")
    args = p.parse_args(argv)
    set_modes(tuple(args.modes.split(",")))
    if args.seeds < 1:
        raise SystemExit(f"error: --seeds must be >= 1, got {args.seeds}")
    r = dict(RECIPES["quick" if args.quick else "full"])
    for key in ("teacher_steps", "student_steps", "pool"):
        r[key] = getattr(args, key) or r[key]
    work = Path(args.workdir or REPO / "runs" / ("bench_quality_quick" if args.quick else "bench_quality")).resolve()
    teacher_dir = work / "teacher"
    reuse = (args.reuse_teacher or args.keep_runs) and _teacher_steps(teacher_dir) == r["teacher_steps"]
    keep = {"teacher", "teacher.log"} | ({f"seed{s}" for s in range(args.seed, args.seed + args.seeds)}
                                         if args.keep_runs else set())
    for child in (work.iterdir() if work.exists() and not args.eval_only else []):  # all but what is reused
        if not (reuse and child.name in keep):
            shutil.rmtree(child) if child.is_dir() else child.unlink()
    work.mkdir(parents=True, exist_ok=True)
    C.setup(args.threads, args.seed)
    seeds = list(range(args.seed, args.seed + args.seeds))
    print(f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, {args.threads} threads, work dir {work}")
    print(f"recipe: {r}, student seeds {seeds}; load average at start {os.getloadavg()[0]:.1f}")
    times: dict[str, float] = {}
    loads = [os.getloadavg()[0]]
    t_start = time.perf_counter()

    if not args.eval_only:
        times.update(build_and_train(args, r, work, seeds, reuse, loads))

    t0 = time.perf_counter()
    from dinopipe.eval import open_labelled

    sets = {}
    for name in ("photos", "digits"):
        train = open_labelled(work / name / "train")
        sets[name] = (train, open_labelled(work / name / "val", classes=train.classes))
    accs = {}
    for seed in seeds:
        models = load_models(work, seed)
        accs[seed] = {m: evaluate(models[m], sets) for m in MODELS}
    times["eval"] = time.perf_counter() - t0
    loads.append(os.getloadavg()[0])
    lines = report(accs, list(sets))
    print("\nssl-mode targets of the teacher (T = distill teacher_temp), kNN top-1 k=20:")
    targets = teacher_targets(work, sets)
    wall = time.perf_counter() - t_start
    C.print_table("wall time (student stages summed over seeds)",
                  [(k, f"{v:.0f} s") for k, v in times.items()] + [("total wall", f"{wall:.0f} s")])
    print(f"\nbench_wall_s: {wall:.0f}\nload_average_1min (start, after teacher, after each seed, end): "
          + " ".join(f"{x:.1f}" for x in loads))
    if args.json:
        Path(args.json).write_text(json.dumps({"recipe": r, "seeds": seeds, "knn_top1": accs, "lines": lines,
                                               "seconds": times, "wall_s": wall, "teacher_targets": targets,
                                               "load_average": loads}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
