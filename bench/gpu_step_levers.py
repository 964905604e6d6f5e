"""Where a ViT-S/14 b=64 training step's time goes on one GPU: the step ``make gpu-bench`` times, with one part
changed at a time, each timed in the same run (median of the second half of ``--steps`` synchronised steps) and
profiled (sum of GPU kernel time per step over 3 steps: the GPU's busy share of the wall step). Variants:

- ``fsdp``: as gpu-bench (a 1-rank NCCL group: FSDP2 mixed precision), eager or compiled;
- ``single``: one plain process (no process group: ``parallelize`` uses autocast, no FSDP2), eager or compiled;
- ``-noopt`` / ``-noema`` / ``-noclip``: the optimizer step / EMA / gradient clipping left out (their cost);
- ``-dp0``: no stochastic depth (drop_path_rate 0: the subsets' gather / index_add and the smaller branches);
- ``-stockopt``: torch's AdamW on the DTensors instead of the trainer's ShardLocalAdamW (ssl/adamw.py).

Then the official step (bench/official_dinov2.py) once, for the same machine. Prints one line per variant and
writes ``OUT/levers.json``. For deciding what to change next; the published figures are gpu_bench.py's.

    python3 bench/gpu_step_levers.py OUT [--variants fsdp-eager,single-eager,...] [--budget-s 240]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import gpu_bench as gb  # noqa: E402

DEFAULT = ("fsdp-eager,fsdp-eager-stockopt,fsdp-eager-noopt,fsdp-eager-noema,fsdp-eager-noclip,fsdp-eager-dp0,single-eager,"
           "single-eager-dp0,official,single-compile,fsdp-compile")


def _step(task, opt, batch, values, clip, skip: set) -> None:
    opt.zero_grad(set_to_none=True)
    loss, _ = task(batch, values)
    loss.backward()
    if "noclip" not in skip:
        for group in task.clip_groups():
            params = [p for p in group if p.grad is not None]
            if params and clip > 0:
                torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
    if "noopt" not in skip:
        opt.step()
    if "noema" not in skip:
        task.after_step(values)


def _measure(step, dev, n: int, cpu: bool) -> dict:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        gb._sync(dev)
        times.append(time.perf_counter() - t0)
    steady = sorted(times[n // 2:])
    wall = steady[len(steady) // 2]
    acts = [ProfilerActivity.CPU] + ([] if cpu else [ProfilerActivity.CUDA])
    with profile(activities=acts) as prof:
        for _ in range(3):
            step()
        gb._sync(dev)
    evs = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in evs) / 3 / 1e6
    top = sorted(evs, key=lambda e: -e.self_device_time_total)[:8]
    return {"first_step_s": times[0], "step_s": wall, "gpu_kernel_s": gpu, "busy": gpu / wall,
            "kernels_per_step": sum(e.count for e in evs if e.device_type.name == "CUDA") / 3 if not cpu else None,
            "top": [(e.key[:60], round(e.self_device_time_total / 3 / 1e3, 2)) for e in top]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--variants", default=DEFAULT)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--model", default="vit_s14")
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args(argv)
    end = time.monotonic() + args.budget_s
    cpu = not torch.cuda.is_available()
    dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
    model, b = ("vit_test", 4) if cpu else (args.model, args.batch)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from dinopipe.app.gpu_check_train import _one_rank_group, _task_config
    from dinopipe.plan.trace import synthetic_batch
    from dinopipe.train.dist import DistInfo
    from dinopipe.train.parallel import configure_device_math

    configure_device_math(dev)
    fsdp_info, _ = _one_rank_group(dev)
    single_info = DistInfo(rank=0, world_size=1, device=dev, backend=None)
    report: dict = {"device": torch.cuda.get_device_name(dev) if not cpu else "cpu", "torch": torch.__version__,
                    "model": model, "batch": b, "variants": {}}
    for v in args.variants.split(","):
        if time.monotonic() > end:
            report["variants"][v] = "skipped (budget)"
            continue
        t0 = time.monotonic()
        try:
            if v == "official":
                import official_dinov2 as off

                train_mod = off.import_official(REPO / ".official" / "dinov2", cpu=cpu)
                dcfg = _task_config(cpu, compile_=False, model=model, batch=b)
                cfg = off.official_config(dcfg, model, b, "bf16")
                if cpu:
                    for k in ("dino", "ibot"):
                        cfg[k].head_n_prototypes, cfg[k].head_hidden_dim, cfg[k].head_bottleneck_dim = 128, 64, 32
                batch = gb._on_device(off.official_batch(cfg, b, torch.bfloat16), dev)
                with off.cpu_step_shims(cpu):
                    st = off.OfficialStep(train_mod, cfg, dev, batch)
                    r = _measure(st.step, dev, args.steps, cpu)
                del st, batch
            else:
                parts = v.split("-")
                kind, comp, skip = parts[0], parts[1] == "compile", set(parts[2:])
                dcfg = _task_config(cpu, compile_=comp and not cpu, model=model, batch=b)
                if "dp0" in skip:
                    dcfg.model.drop_path_rate = 0.0
                info = fsdp_info if kind == "fsdp" else single_info
                import dinopipe.ssl.base as base
                from dinopipe.ssl.adamw import ShardLocalAdamW

                base.ShardLocalAdamW = torch.optim.AdamW if "stockopt" in skip else ShardLocalAdamW
                task, opt, values = gb.build_dinopipe(dcfg, info)
                batch = gb._on_device(synthetic_batch(dcfg, dcfg.phases[0], task.data_patch_size), dev)
                r = _measure(lambda: _step(task, opt, batch, values, dcfg.optim.clip_grad, skip), dev, args.steps, cpu)
                del task, opt, batch
            r["images_per_s"] = b / r["step_s"]
            r["wall_s"] = time.monotonic() - t0
            report["variants"][v] = r
            print(f"{v:24s} {r['images_per_s']:7.1f} img/s  step {r['step_s']*1e3:6.1f} ms  GPU {r['gpu_kernel_s']*1e3:6.1f} ms"
                  f"  busy {r['busy']:.2f}  kernels {r['kernels_per_step']}  first {r['first_step_s']:.1f} s  "
                  f"({r['wall_s']:.0f} s)", flush=True)
            print("    top:", r["top"], flush=True)
        except Exception as exc:  # noqa: BLE001
            report["variants"][v] = {"error": f"{type(exc).__name__}: {exc}"[:1500]}
            print(f"{v}: FAILED {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc()
        gb._cleanup(dev)
        (out / "levers.json").write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
