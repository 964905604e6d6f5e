"""``make gpu-bench``: dinopipe's training step vs the official DINOv2 training step on the same GPU.

Cases (in this order; the budget may cut the tail): ViT-S/14 b=64, ViT-L/14 b=32, ViT-B/14 b=64, ViT-S/14 b=128;
the recipe's 2x224 + 8x98 crops, bf16, W = 1 (a 1-rank NCCL group, as ``gpu-check``'s task check).

- dinopipe: the task check's config (``gpu_check_train._task_config``) at each size, ``parallel.compile=true``,
  built and stepped as the trainer does (``build_sharded_task``, ``task.build_optimizer``, ``plan.trace._step``:
  zero_grad, forward + backward, per-module clip, AdamW, EMA) on ``plan.trace.synthetic_batch``.
- official: ``SSLMetaArch`` from ``ssl_default_config.yaml`` set to the same model, heads and crops, FSDP1-wrapped
  by its own ``prepare_for_distributed_training``, stepped as ``dinov2/train/train.py``'s loop body (schedules
  applied, forward_backward, per-module clip, AdamW foreach, EMA, the losses' ``.item()``), eager (the
  official code does not compile), bf16 params without grad scaler (``--official-precision recipe``: its fp16 +
  ShardedGradScaler). The shims it needs on today's torch are listed in the JSON (bench/official_dinov2.py).

Reported per side: images/s (median step of the second half of the steps, each step synchronised), the first
step's seconds (compilation), peak ``max_memory_allocated``, MFU = dinopipe.plan's FLOPs per step (the same
model and crops for both) / step time / a bf16 GEMM measured in this run. Both batches are resident on the
device before timing (the step alone). Prints ``name: ratio`` lines (dinopipe / official images/s) and writes
``OUT/gpu_bench.json`` after every case.

Then (``--no-e2e`` skips it) the first case end to end (bench/gpu_bench_e2e.py): JPEG tar shards of real photos
-> dinopipe's training loader with the machine's cores -> the same step; its images/s over the bare step's.

``--cpu``: the smoke (vit_test, b=4, tiny heads, gloo, no compile, 2 steps) through every code path.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import traceback
from functools import partial
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

CASES = [("vit_s14", 64), ("vit_l14", 32), ("vit_b14", 64), ("vit_s14", 128)]


def log(*a) -> None:
    print(*a, flush=True)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _cleanup(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
    torch._dynamo.reset()  # each case compiles afresh: no recompile limit carried across models


def _on_device(batch: dict, dev: torch.device) -> dict:
    """The batch resident on the device before timing, for both sides (their ``.cuda()`` / ``.to()`` in the
    step are then no-ops): the step alone; the input path is the end-to-end case's and bench_input's."""
    return {k: v.to(dev) if torch.is_tensor(v) else v for k, v in batch.items()}


def _time_steps(step, dev: torch.device, n: int, deadline: float) -> dict:
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        step()
        _sync(dev)
        times.append(time.perf_counter() - t0)
        log(f"    step {i}: {times[-1]:.3f} s")
        if i >= 3 and time.monotonic() > deadline:  # over budget: keep what is measured
            break
    steady = times[len(times) // 2:] if len(times) > 1 else times
    res = {"steps": len(times), "first_step_s": times[0], "step_s": float(np.median(steady)),
           "step_s_min": float(min(steady))}
    if dev.type == "cuda":
        res["peak_memory_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    return res


def build_dinopipe(dcfg, info) -> tuple:
    """(task, optimizer, schedule values) as the trainer builds them (train/run.py)."""
    from dinopipe.ssl.param_groups import build_param_groups
    from dinopipe.ssl.task import SSLTask
    from dinopipe.train.builders import build_schedules
    from dinopipe.train.run import build_sharded_task

    o = dcfg.optim
    task = build_sharded_task(SSLTask, dcfg, info, dcfg.parallel)
    opt = task.build_optimizer(partial(build_param_groups, lr_decay_rate=o.layerwise_decay,
                                       patch_embed_lr_mult=o.patch_embed_lr_mult, decay_tokens=o.decay_tokens),
                               betas=(o.adamw_beta1, o.adamw_beta2))
    sched = build_schedules(dcfg, 1)
    it = min(len(v) for v in sched.values()) // 10
    return task, opt, {k: float(v[it]) for k, v in sched.items()}


def dinopipe_step(task, opt, batch, values, clip: float) -> None:
    from dinopipe.plan.trace import _step

    _step(task, opt, [batch], values, clip)


def run_dinopipe(dcfg, info, dev, n, deadline) -> dict:
    from dinopipe.plan.trace import synthetic_batch

    from torch._dynamo.utils import counters

    counters.clear()  # dynamo's graphs and breaks of this case only
    task, opt, values = build_dinopipe(dcfg, info)
    batch = _on_device(synthetic_batch(dcfg, dcfg.phases[0], task.data_patch_size), dev)
    res = _time_steps(lambda: dinopipe_step(task, opt, batch, values, dcfg.optim.clip_grad), dev, n, deadline)
    res.update(compile=bool(dcfg.parallel.compile), param_dtype=str(dcfg.parallel.param_dtype),
               dynamo_graphs=int(counters["stats"]["unique_graphs"]),
               graph_breaks=int(sum(counters["graph_break"].values())))
    return res


def run_official(train_mod, dcfg, model, b, dev, n, deadline, precision, cpu) -> dict:
    import official_dinov2 as off

    cfg = off.official_config(dcfg, model, b, precision)
    if cpu:  # tiny heads as the dinopipe smoke's
        for k in ("dino", "ibot"):
            cfg[k].head_n_prototypes, cfg[k].head_hidden_dim, cfg[k].head_bottleneck_dim = 128, 64, 32
    dtype = torch.bfloat16 if precision == "bf16" else torch.half
    batch = _on_device(off.official_batch(cfg, b, dtype), dev)
    with off.cpu_step_shims(cpu):
        st = off.OfficialStep(train_mod, cfg, dev, batch)
        res = _time_steps(st.step, dev, n, deadline)
    res.update(compile=False, param_dtype=cfg.compute_precision.student.backbone.mixed_precision.param_dtype,
               grad_scaler=bool(cfg.compute_precision.grad_scaler), loss=st.loss,
               arch=cfg.student.arch, drop_path_rate=cfg.student.drop_path_rate)
    del st, batch
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="CPU smoke: vit_test, b=4, gloo, no compile, 2 steps")
    ap.add_argument("--out", default="gpu-bench")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip what would start after this")
    ap.add_argument("--steps", type=int, default=None, help="steps per side (default 16; --cpu 2)")
    ap.add_argument("--cases", default=None, help="e.g. vit_s14:64,vit_l14:32 (default: all four)")
    ap.add_argument("--official-src", default=str(REPO / ".official" / "dinov2"))
    ap.add_argument("--official-precision", choices=["bf16", "recipe"], default="bf16")
    ap.add_argument("--skip-official", action="store_true")
    ap.add_argument("--no-e2e", action="store_true", help="skip the end-to-end case (JPEG shards -> loader -> step)")
    ap.add_argument("--e2e-workers", type=int, default=None, help="data workers (default: cores - 1; --cpu 1)")
    ap.add_argument("--no-fp16-extra", action="store_true",
                    help="skip the last row: the first case's official step in the recipe's fp16 + grad scaler")
    args = ap.parse_args(argv)
    t_start = time.monotonic()
    end = t_start + args.budget_s
    cpu = args.cpu or not torch.cuda.is_available()
    dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
    n = args.steps or (2 if cpu else 16)
    cases = CASES if not args.cases else [(c.split(":")[0], int(c.split(":")[1])) for c in args.cases.split(",")]
    if cpu:
        cases = [("vit_test", 4)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from dinopipe import plan as planner
    from dinopipe.app.gpu_check_train import _one_rank_group, _task_config, bf16_gemm_tflops
    from dinopipe.train.parallel import configure_device_math

    report: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
                    "torch": torch.__version__, "python": platform.python_version(), "steps": n,
                    "budget_s": args.budget_s, "official_precision": args.official_precision, "cases": {},
                    "ratios": {}}
    src = Path(args.official_src)
    commit = src / "COMMIT"
    report["official_commit"] = commit.read_text().strip() if commit.is_file() else None

    def save() -> None:
        report["elapsed_s"] = time.monotonic() - t_start
        (out / "gpu_bench.json").write_text(json.dumps(report, indent=1, default=str))

    configure_device_math(dev)  # TF32 for the fp32 leftovers: dinopipe's trainer and dinov2's train.py alike
    info, created = _one_rank_group(dev)
    if dev.type == "cuda":
        report["gemm_bf16_tflops"] = bf16_gemm_tflops(dev)
        log(f"bf16 GEMM: {report['gemm_bf16_tflops']:.0f} TFLOP/s on {report['device']}")
    train_mod = None
    if args.skip_official:
        report["official"] = "skipped (--skip-official)"
    else:
        try:
            import official_dinov2 as off

            train_mod = off.import_official(src, cpu=cpu)
            report["official_shims"] = off.SHIMS
            log(f"official dinov2 from {src} ({report['official_commit']}); shims: {off.SHIMS}")
        except Exception as exc:
            report["official"] = f"not importable: {type(exc).__name__}: {exc}"
            log(report["official"])
    save()
    def run_side(name: str, case: dict, side: str, fn, b: int, flops: float) -> None:
        if time.monotonic() > end - (5 if cpu else 30):
            case[side] = {"skipped": f"budget ({args.budget_s:.0f} s) spent"}
            log(f"{name} {side}: skipped (budget)")
            return
        log(f"{name} {side}: ...")
        try:
            r = fn()
            r["images_per_s"] = b / r["step_s"]
            r["achieved_tflops"] = flops / r["step_s"] / 1e12
            if "gemm_bf16_tflops" in report:
                r["mfu_vs_measured_gemm"] = r["achieved_tflops"] / report["gemm_bf16_tflops"]
            case[side] = r
            log(f"{name} {side}: {r['images_per_s']:.1f} images/s, step {r['step_s'] * 1e3:.1f} ms, "
                f"first step {r.get('first_step_s', float('nan')):.1f} s, MFU {r.get('mfu_vs_measured_gemm', float('nan')):.3f}, "
                f"peak {r.get('peak_memory_gib', float('nan')):.2f} GiB"
                + (f", {r['dynamo_graphs']} graphs / {r['graph_breaks']} breaks" if "dynamo_graphs" in r else ""))
        except Exception as exc:
            case[side] = {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-4000:]}
            log(f"{name} {side}: FAILED {type(exc).__name__}: {exc}")
            traceback.print_exc()
        finally:
            _cleanup(dev)
            save()

    def ratio(name: str, case: dict, key: str, other: str) -> None:
        d, o = case.get("dinopipe", {}), case.get(other, {})
        if "images_per_s" in d and "images_per_s" in o:
            report["ratios"][key] = d["images_per_s"] / o["images_per_s"]

    def run_e2e_case(model_b) -> None:
        import tempfile

        import gpu_bench_e2e as e2e

        model, b = model_b
        name = f"{model}_b{b}"
        case = report["cases"].setdefault(name, {"model": model, "batch": b})
        workers = args.e2e_workers if args.e2e_workers is not None else (1 if cpu else max(1, e2e.cores() - 1))
        dcfg = _task_config(cpu, compile_=not cpu, model=model, batch=b)
        arch, heads = planner.describe(dcfg)
        flops = planner.step_flops(dcfg, arch, heads, dcfg.phases[0], b)["model"]
        modes = ["cpu", "gpu"] if hasattr(dcfg.data, "augment_on") else ["cpu"]
        if len(modes) == 1:
            case["e2e_gpu_augmentation"] = "not measured: this build has no data.augment_on (issue 29, part 2)"
        for mode in modes:
            dcfg = _task_config(cpu, compile_=not cpu, model=model, batch=b)
            if hasattr(dcfg.data, "augment_on"):
                dcfg.data.augment_on = mode
            side = f"dinopipe_e2e_jpeg_{mode}_aug"
            with tempfile.TemporaryDirectory(prefix="gpu_bench_e2e_") as tmp:
                run_side(name, case, side, lambda: e2e.run_e2e(
                    dcfg, info, dev, lambda c: build_dinopipe(c, info),
                    lambda t, o, batch, v: dinopipe_step(t, o, batch, v, dcfg.optim.clip_grad),
                    Path(tmp), workers, n, end, lambda: _sync(dev)), b, flops)
            e, d = case.get(side, {}), case.get("dinopipe", {})
            if "images_per_s" in e and "images_per_s" in d:
                report["ratios"][f"{name}_e2e_{mode}_aug_over_bare_step"] = e["images_per_s"] / d["images_per_s"]
        save()

    try:
        for i, (model, b) in enumerate(cases + cases[:1]):
            extra = i == len(cases)  # last: the first case's official step once more, in the recipe's fp16
            if extra and (train_mod is None or args.official_precision == "recipe" or args.no_fp16_extra):
                break
            name = f"{model}_b{b}"
            case: dict = report["cases"].setdefault(name, {"model": model, "batch": b})
            dcfg = _task_config(cpu, compile_=not cpu, model=model, batch=b)
            arch, heads = planner.describe(dcfg)
            flops = planner.step_flops(dcfg, arch, heads, dcfg.phases[0], b)["model"]
            case["model_tflop_per_step"] = flops / 1e12
            if extra:
                run_side(name, case, "official_fp16_recipe",
                         lambda: run_official(train_mod, dcfg, model, b, dev, n, end, "recipe", cpu), b, flops)
                ratio(name, case, f"{name}_vs_official_fp16_recipe", "official_fp16_recipe")
                continue
            run_side(name, case, "dinopipe", lambda: run_dinopipe(dcfg, info, dev, n, end), b, flops)
            if train_mod is not None:
                run_side(name, case, "official", lambda: run_official(train_mod, dcfg, model, b, dev, n, end,
                                                                      args.official_precision, cpu), b, flops)
            ratio(name, case, name, "official")
            save()
        if not args.no_e2e:
            run_e2e_case(cases[0])
    finally:
        if created:
            dist.destroy_process_group()
    log("--- dinopipe / official images/s (same device, same model and crops) ---")
    for name, case in report["cases"].items():
        if name in report["ratios"]:
            log(f"{name}: {report['ratios'][name]:.2f}")
        else:
            log(f"{name}: n/a ({', '.join(s for s in ('dinopipe', 'official') if 'images_per_s' not in case.get(s, {}))}"
                " not measured)")
        for extra in ("_vs_official_fp16_recipe", "_e2e_cpu_aug_over_bare_step", "_e2e_gpu_aug_over_bare_step"):
            if name + extra in report["ratios"]:
                log(f"{name}{extra}: {report['ratios'][name + extra]:.2f}")
        e = case.get("dinopipe_e2e_jpeg_cpu_aug", {})
        if "loader_only_images_per_s" in e:
            log(f"{name} loader alone: {e['loader_only_images_per_s']:.0f} images/s with {e['workers']} workers "
                f"({e['loader_only_images_per_s_per_core']:.1f} per core)"
                + (f", {e['loader_only_4_workers_images_per_s']:.0f} with 4" if "loader_only_4_workers_images_per_s" in e
                   else ""))
    save()
    log(f"wrote {out / 'gpu_bench.json'} in {time.monotonic() - t_start:.0f} s")
    ok = all("images_per_s" in c.get("dinopipe", {}) or "skipped" in c.get("dinopipe", {})
             for c in report["cases"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
