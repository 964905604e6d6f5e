"""SSL pretraining benches: the DINOv2 task (``SSLTask``: ViT-S/14 student + EMA teacher + DINO/iBOT heads,
losses, AdamW) on CPU, each pair measured in one run and printed as ratios.

    python bench/bench_pretrain.py                  # full run (~9 min on 2 loaded shared cores)
    python bench/bench_pretrain.py --quick          # smaller batches, fewer rounds, no bf16 run (~2-3 min)
    python bench/bench_pretrain.py --json out.json  # also write every raw number
    python bench/bench_pretrain.py --only fsdp      # any of fsdp,packed,ac

Model everywhere: ``vit_s14`` (fp32, drop path 0 so paired variants do the same math, SDPA attention) with
DINOv2's default heads: 65536 prototypes, hidden 2048, bottleneck 256, 3 layers, iBOT sharing the DINO head.
Batches are random crops through the real ``MultiCropCollator`` (iBOT masks drawn as in training); a train
step is the trainer's: zero_grad -> task forward/backward -> clip grad norm -> AdamW step -> teacher EMA.

Lines ``name: X.XX`` (goals from issue 4 where it gives one):
- ``fsdp2_world2_bytes_per_rank_over_single``: FSDP2 (``parallelize_task``: fully_shard per block and root)
  at world size 2 on gloo, launched with torchrun, vs one plain process: bytes of parameters (student +
  teacher) + gradients + AdamW state that a rank holds after one real step, counted as the local shards
  (``DTensor.to_local()``), largest rank over single. fp32 params (``param_dtype=fp32``). Goal <= 0.52.
  With bf16 params FSDP2 still keeps *fp32* sharded parameters (masters), grads and optimizer state and
  all-gathers bf16 copies only for compute, so the sharded bytes are the same (the full run measures it).
- ``packed_over_separate_throughput``: images/s of the train step with the student's crops in one packed
  ``forward_features_list([globals, locals], [masks, None])`` (what SSLTask does) over the same task whose
  student runs ``forward_features`` on the globals and on the locals separately (same weights, same math;
  the losses are checked equal). Median of paired rounds.
- ``ac_peak_memory_ratio`` / ``ac_time_ratio``: torch allocator peak above the live set, and step time, of
  the train step with activation checkpointing on every block (``ParallelConfig(activation_checkpointing=
  True)`` through ``parallelize_task`` with a single-process DistInfo) over without.

Time ratios use process CPU seconds by default (``--clock cpu``): the machines are 2 cores shared with other
jobs, and under that load a step's wall time varied 4x between identical rounds while its CPU time stayed
within ~10%, enough to flip a 5% effect. CPU time counts work, not how well it spreads over the 2 threads;
the wall-clock ratio is printed beside it (use ``--clock wall`` on a dedicated machine).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402
import torch  # noqa: E402

from dinopipe.config import load_config  # noqa: E402
from dinopipe.data.transforms import MultiCropCollator  # noqa: E402
from dinopipe.ssl.config import PretrainConfig  # noqa: E402
from dinopipe.ssl.param_groups import build_param_groups  # noqa: E402
from dinopipe.ssl.task import SSLTask  # noqa: E402
from dinopipe.train.dist import DistInfo  # noqa: E402
from dinopipe.train.clip import clip_grad_norm  # noqa: E402
from dinopipe.config import ParallelConfig  # noqa: E402
from dinopipe.ssl.ema import local_tensor  # noqa: E402
from dinopipe.train.run import parallelize_task  # noqa: E402

HERE = os.path.abspath(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
CONFIG = os.path.join(REPO, "configs", "pretrain", "quickstart.yaml")
ARCH, PATCH = "vit_s14", 14
VALUES = {"teacher_temp": 0.04, "momentum": 0.994}  # a mid-warm-up step's schedule values


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller, faster run for a smoke check")
    p.add_argument("--batch", type=int, default=None, help="images per step for packed/ac (default 8, --quick 4)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5, --quick 3)")
    p.add_argument("--prototypes", type=int, default=65536, help="DINO/iBOT head prototypes (DINOv2: 65536)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="clock of the time ratios (default cpu: process CPU seconds, steady on a shared machine; "
                        "wall on a dedicated one). Both are printed.")
    p.add_argument("--json", default=None, help="write all raw numbers to this file")
    p.add_argument("--only", default=None, help="comma list of: fsdp,packed,ac (default all)")
    # internal: one process of the FSDP memory comparison (fsdp under torchrun, or single)
    p.add_argument("--worker", choices=("fsdp", "single"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--param-dtype", default="fp32", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.batch = args.batch or (4 if args.quick else 8)
    args.repeats = args.repeats or (3 if args.quick else 5)
    return args


# -- building blocks -------------------------------------------------------------------------------------
def make_cfg(args, global_size: int, n_local: int) -> PretrainConfig:
    h = [f"n_prototypes={args.prototypes}", "hidden_dim=2048", "bottleneck_dim=256", "nlayers=3"]
    overrides = [f"model.name={ARCH}", f"model.img_size={global_size}", "model.drop_path_rate=0.0",
                 "model.attn_backend=sdpa", f"crops.local_crops_number={n_local}", "parallel.param_dtype=fp32",
                 "data.paths=[unused]", *(f"dino.head.{x}" for x in h), *(f"ibot.head.{x}" for x in h)]
    return load_config(PretrainConfig, CONFIG, overrides)


def make_task(cfg: PretrainConfig, all_reduce_fn=None) -> SSLTask:
    torch.manual_seed(0)  # same initial weights in every process and variant
    return SSLTask(cfg, all_reduce_fn=all_reduce_fn)


def make_batch(images: int, global_size: int, local_size: int, n_local: int, seed: int = 0) -> dict:
    """Random crops through the real collator (crop-major stacking, iBOT masks with p=0.5)."""
    g = torch.Generator().manual_seed(seed)
    samples = [{"global_crops": [torch.randn(3, global_size, global_size, generator=g) for _ in range(2)],
                "local_crops": [torch.randn(3, local_size, local_size, generator=g) for _ in range(n_local)]}
               for _ in range(images)]
    return MultiCropCollator(PATCH, mask_probability=0.5, seed=seed)(samples)


def make_optimizer(task: SSLTask, cfg: PretrainConfig) -> torch.optim.Optimizer:
    o = cfg.optim
    return torch.optim.AdamW(build_param_groups(task.student, o.layerwise_decay, o.patch_embed_lr_mult),
                             lr=1e-4, betas=(o.adamw_beta1, o.adamw_beta2))


def train_step(task: SSLTask, opt: torch.optim.Optimizer, batch: dict, clip: float):
    """The trainer's step (dinopipe/train/loop.py) minus logging and the finite check's all-reduce."""
    params = [p for p in task.trainable_parameters() if p.requires_grad]

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss, _ = task(batch, VALUES)
        loss.backward()
        clip_grad_norm(params, clip)
        opt.step()
        task.after_step(VALUES)
        return float(loss.detach())
    return step


def use_separate_forwards(task: SSLTask) -> None:
    """Make the student run each crop group through its own forward_features call (same math, unpacked)."""
    backbone = task.student["backbone"]
    packed = backbone.forward_features_list  # bound method of the class; the instance attribute shadows it

    def separate(x_list, masks_list=None):
        masks_list = list(masks_list) if masks_list is not None else [None] * len(x_list)
        return [packed([x], [m])[0] for x, m in zip(x_list, masks_list)]  # == backbone.forward_features(x, m)
    backbone.forward_features_list = separate


# -- 1. FSDP2 world 2 vs single process: bytes a rank holds ------------------------------------------------
def _nbytes(tensors) -> int:
    return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind the local shards (sees FSDP2's dim-0 padding and shared buffers)."""
    seen = {}
    for t in tensors:
        s = local_tensor(t).untyped_storage()
        seen[(s.data_ptr(), s.nbytes())] = s.nbytes()
    return sum(seen.values())


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _unsharded_left(model: torch.nn.Module) -> int:
    """Bytes of FSDP2 all-gather outputs (unsharded parameters) still allocated; 0 once all are resharded.
    Private FSDP2 attributes, so a cross-check only (-1 when they are not there)."""
    total = 0
    try:
        for m in model.modules():
            if hasattr(m, "_get_fsdp_state"):
                for group in m._get_fsdp_state()._fsdp_param_groups:
                    for fp in group.fsdp_params:
                        total += sum(t.untyped_storage().nbytes() for t in fp.all_gather_outputs)
    except AttributeError:
        return -1
    return total


def fsdp_worker(args) -> None:
    """One process: build the task, (FSDP2-)parallelize, one real step, count local bytes; rank 0 writes JSON."""
    import torch.distributed as dist

    from dinopipe.train.dist import all_reduce_sum_fn, destroy, init_distributed

    C.setup(1)
    rss0 = _status_kib("VmRSS") * 1024  # the interpreter with torch imported
    info = init_distributed("cpu") if args.worker == "fsdp" else DistInfo()
    cfg = make_cfg(args, 112, 2)
    task = make_task(cfg, all_reduce_sum_fn())
    parallelize_task(task, info, ParallelConfig(param_dtype=args.param_dtype))
    opt = make_optimizer(task, cfg)
    batch = make_batch(2, 112, 56, 2, seed=info.rank)  # per-rank batch; bytes do not depend on it
    t0 = time.perf_counter()
    loss = train_step(task, opt, batch, cfg.optim.clip_grad)()
    step_s = time.perf_counter() - t0
    student, teacher = list(task.student.parameters()), list(task.teacher.parameters())
    grads = [p.grad for p in student if p.grad is not None]
    optim = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    res = dict(rank=info.rank, param_dtype=args.param_dtype, loss=loss, step_s=step_s,
               params_student=_nbytes(student), params_teacher=_nbytes(teacher), grads=_nbytes(grads),
               optim=_nbytes(optim), buffers=_nbytes(task.buffers()),
               numel_student=sum(local_tensor(p).numel() for p in student),
               storage=_storage_bytes(student + teacher + grads + optim),
               param_dtypes=sorted({str(local_tensor(p).dtype) for p in student + teacher}),
               unsharded_left=_unsharded_left(task), rss=_status_kib("VmRSS") * 1024 - rss0,
               rss_peak=_status_kib("VmHWM") * 1024 - rss0)
    res["total"] = res["params_student"] + res["params_teacher"] + res["grads"] + res["optim"]
    ranks = [res]
    if info.distributed:
        ranks = [None] * info.world_size
        dist.all_gather_object(ranks, res)
    if info.is_main:
        with open(args.out, "w") as f:
            json.dump(ranks, f)
    destroy()


def _launch(args, kind: str, param_dtype: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res.json")
        worker = [HERE, "--worker", kind, "--out", out, "--param-dtype", param_dtype,
                  "--prototypes", str(args.prototypes)]
        cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *worker]
               if kind == "fsdp" else [sys.executable, *worker])
        # PROBE_ENV pins glibc's mmap threshold so freed buffers leave the RSS (see common.py)
        env = dict(os.environ, OMP_NUM_THREADS="1", **C.PROBE_ENV)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{kind} worker ({param_dtype}) failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                               f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        with open(out) as f:
            return json.load(f)


def bench_fsdp(args) -> dict:
    runs = {"single": _launch(args, "single", "fp32"), "fsdp_fp32": _launch(args, "fsdp", "fp32")}
    if not args.quick:
        runs["fsdp_bf16"] = _launch(args, "fsdp", "bf16")
    single = runs["single"][0]["total"]
    per_rank_max = max(r["total"] for r in runs["fsdp_fp32"])
    return dict(runs=runs, ratio=per_rank_max / single,
                storage_ratio=max(r["storage"] for r in runs["fsdp_fp32"]) / runs["single"][0]["storage"])


# -- timing -----------------------------------------------------------------------------------------------
def timed(fns: dict, args) -> dict:
    """Interleaved rounds with wall and process-CPU seconds per call (see --clock and common.py)."""
    cpu: dict = {}
    wall = C.interleaved_times(fns, args.repeats, cpu_times=cpu)
    return {"wall": wall, "cpu": cpu}


def ratio(t: dict, num: str, den: str, clock: str) -> float:
    return C.paired_ratio(t[clock][num], t[clock][den])


# -- 2. packed multi-crop student forward vs separate forwards -----------------------------------------
def backbone_step(backbone: torch.nn.Module, batch: dict):
    """Student backbone alone, fwd+bwd on all crops (the part of the step that packing changes)."""
    crops, masks = [batch["global_crops"], batch["local_crops"]], [batch["masks"], None]

    def run() -> None:
        backbone.zero_grad(set_to_none=True)
        outs = backbone.forward_features_list(crops, masks)
        sum(o["x_norm_clstoken"].square().mean() + o["x_norm_patchtokens"].square().mean() for o in outs).backward()
    return run


def bench_packed(args) -> dict:
    g, l, n_local = 112, 56, 4
    cfg = make_cfg(args, g, n_local)
    batch = make_batch(args.batch, g, l, n_local)
    packed = make_task(cfg)
    separate = copy.deepcopy(packed)
    use_separate_forwards(separate)
    with torch.no_grad():  # same math: the two losses agree before any step (drop path 0, same weights)
        lp, ls = (float(t(batch, VALUES)[0]) for t in (packed, separate))
    fns = {name: train_step(t, make_optimizer(t, cfg), batch, cfg.optim.clip_grad)
           for name, t in (("packed", packed), ("separate", separate))}
    # Each task step starts with zero_grad, so the backbone-only calls do not leak into it.
    fns.update({f"backbone_{name}": backbone_step(t.student["backbone"], batch)
                for name, t in (("packed", packed), ("separate", separate))})
    t = timed(fns, args)
    return dict(setting=f"{ARCH} B={args.batch}, 2x{g}px + {n_local}x{l}px", images=args.batch, times=t,
                loss_packed=lp, loss_separate=ls,
                ratio={c: ratio(t, "separate", "packed", c) for c in ("cpu", "wall")},
                backbone_ratio={c: ratio(t, "backbone_separate", "backbone_packed", c) for c in ("cpu", "wall")})


# -- 3. activation checkpointing: peak memory and time -----------------------------------------------------
def bench_ac(args) -> dict:
    # Full run: DINOv2's crop geometry (2 x 224 + 8 x 98), where activations outweigh the fixed state more.
    g, l, n_local = (112, 56, 4) if args.quick else (224, 98, 8)
    images = args.batch if args.quick else max(1, args.batch // 4)
    cfg = make_cfg(args, g, n_local)
    batch = make_batch(images, g, l, n_local)
    tasks, steps = {}, {}
    for name, ac in (("no_ac", False), ("ac", True)):
        tasks[name] = task = make_task(cfg)
        parallelize_task(task, DistInfo(), ParallelConfig(param_dtype="fp32", activation_checkpointing=ac))
        steps[name] = train_step(task, make_optimizer(task, cfg), batch, cfg.optim.clip_grad)
    t = timed(steps, args)  # its warm-up step creates the AdamW state before memory is measured
    peak = {name: C.torch_peak_bytes(step, before=lambda t=tasks[name]: t.student.zero_grad(set_to_none=True))
            for name, step in steps.items()}

    def forward_only(task):  # peak of the forward with autograd on: the activations it saves, plus transients
        return lambda: task(batch, VALUES)[0]
    fwd_peak = {name: C.torch_peak_bytes(forward_only(task)) for name, task in tasks.items()}
    grads = sum(p.numel() * p.element_size() for p in tasks["ac"].student.parameters())
    return dict(setting=f"{ARCH} B={images}, 2x{g}px + {n_local}x{l}px", times=t, peak=peak, fwd_peak=fwd_peak,
                grad_bytes=grads, memory_ratio=peak["ac"] / peak["no_ac"],
                time_ratio={c: ratio(t, "ac", "no_ac", c) for c in ("cpu", "wall")})


# -- report -------------------------------------------------------------------------------------------------
def _time_note(t: dict, name: str, images: int = 0) -> tuple[str, str]:
    w, c = C.median(t["wall"][name]), C.median(t["cpu"][name])
    rate = f"{images / w:.2f} img/s wall, {images / c:.2f} img per CPU-s; " if images else ""
    return C.fmt_s(w), f"{rate}CPU {C.fmt_s(c)}"


def _both(r: dict, clock: str) -> str:
    other = "wall" if clock == "cpu" else "cpu"
    return f"{clock} {r[clock]:.2f} (headline), {other} {r[other]:.2f}"


def report(args, res: dict) -> None:
    rows, lines = [], []
    mib, ck = C.fmt_bytes, args.clock
    if "fsdp" in res:
        f = res["fsdp"]
        for name, ranks in f["runs"].items():
            for r in ranks:
                who = name if name == "single" else f"{name} rank {r['rank']}"
                rows.append((f"state bytes, {who}", mib(r["total"]),
                             f"params S {mib(r['params_student'])} + T {mib(r['params_teacher'])}, grads "
                             f"{mib(r['grads'])}, AdamW {mib(r['optim'])}; storages {mib(r['storage'])}; "
                             f"{'/'.join(r['param_dtypes'])} shards; unsharded left {mib(r['unsharded_left'])}; "
                             f"RSS {mib(r['rss'])} (peak {mib(r['rss_peak'])}) above the bare interpreter"))
        rows.append(("storage ratio (incl. FSDP2 padding)", f"{f['storage_ratio']:.3f}", "cross-check"))
        lines.append(("fsdp2_world2_bytes_per_rank_over_single", f["ratio"], "<= 0.52"))
    if "packed" in res:
        p = res["packed"]
        for name in ("packed", "separate"):
            wall, note = _time_note(p["times"], name, p["images"])
            rows.append((f"train step, {name} student forward", wall,
                         f"{note}; {p['setting']}; loss {p['loss_' + name]:.5f}"))
        for name in ("packed", "separate"):
            rows.append((f"  student backbone fwd+bwd only, {name}", *_time_note(p["times"], f"backbone_{name}")))
        rows += [("packed/separate throughput, step", f"{p['ratio'][ck]:.2f}", _both(p["ratio"], ck)),
                 ("packed/separate throughput, backbone only", f"{p['backbone_ratio'][ck]:.2f}",
                  _both(p["backbone_ratio"], ck))]
        lines.append(("packed_over_separate_throughput", p["ratio"][ck], None))
    if "ac" in res:
        a = res["ac"]
        for name in ("no_ac", "ac"):
            wall, note = _time_note(a["times"], name)
            rows.append((f"train step, {name.replace('_', ' ')}", wall,
                         f"{note}; step peak {mib(a['peak'][name])}, forward peak {mib(a['fwd_peak'][name])}; "
                         f"{a['setting']}"))
        rows += [("  of which student grads", mib(a["grad_bytes"]), "allocated in every step"),
                 ("ac/no-ac step time", f"{a['time_ratio'][ck]:.2f}", _both(a["time_ratio"], ck))]
        lines += [("ac_peak_memory_ratio", a["memory_ratio"], None), ("ac_time_ratio", a["time_ratio"][ck], None)]
    C.print_table(f"SSLTask {ARCH} + heads ({args.prototypes} prototypes), fp32 cpu, "
                  f"{torch.get_num_threads()} threads (FSDP workers 1 each), "
                  f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '')}, median wall time of {args.repeats} "
                  f"interleaved rounds; ratios: median of paired rounds, {ck} clock", rows,
                  ("measurement", "value", "notes"))
    C.print_table("ratios", [(n, f"{v:.2f}", g or "-", "" if g is None else ("ok" if C.meets_goal(v, g) else "MISSED"))
                             for n, v, g in lines], ("name", "value", "goal", ""))
    print()
    for name, value, _ in lines:
        C.print_ratio(name, value)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        fsdp_worker(args)
        return 0
    C.setup(args.threads)
    only = set((args.only or "fsdp,packed,ac").split(","))
    unknown = only - {"fsdp", "packed", "ac"}
    if unknown:
        print(f"--only: unknown bench(es) {sorted(unknown)}; choose from fsdp, packed, ac", file=sys.stderr)
        return 2
    res = {}
    for name, fn in (("fsdp", bench_fsdp), ("packed", bench_packed), ("ac", bench_ac)):
        if name in only:
            t0 = time.perf_counter()
            res[name] = fn(args)
            res[name]["bench_s"] = time.perf_counter() - t0
            print(f"[{name}: {res[name]['bench_s']:.0f} s]", file=sys.stderr, flush=True)
    report(args, res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), results=res), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
