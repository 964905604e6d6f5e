"""Where a training step's GPU time goes, as *kernel time only*, grouped by the CPU estimate's categories
(dinopipe/plan/gpu_cost.py: gemm, attention, copy/cast/cat, index, elementwise, reduce/norm, optimizer, comm, and
``fused`` for inductor's Triton kernels): torch.profiler over 3 steps after warm-up, each CUDA kernel charged to
the aten op that launched it (``FunctionEvent.kernels``), never annotation ranges (a ``record_function`` range
such as the optimizer's step spans host time and idle gaps, not kernel time).

Cases (``--cases``; default ViT-S/14 b=64 dinopipe compiled, eager, the official step; then ViT-L/14 b=32 the
same): dinopipe as ``make gpu-bench`` builds and steps it (bench/gpu_bench.py), the official ``SSLMetaArch`` step
(bench/official_dinov2.py, xformers when importable). Per case: wall ms per step, kernel ms per step, the GPU's
busy share, kernels per step, and per category ms / kernels; ``OUT/profile.json`` is written after every case
and one ``OUT/<case>.txt`` table of the top kernels. Without CUDA (the smoke): vit_test b=4 on the CPU, CPU time
per aten op (self time), same grouping.

    python3 bench/gpu_profile_step.py OUT [--cases vit_s14:64:compile,vit_s14:64:eager,vit_s14:64:official] [--budget-s 170]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import gpu_bench as gb  # noqa: E402
from dinopipe.plan.gpu_cost import category  # noqa: E402

DEFAULT = ("vit_s14:64:compile,vit_s14:64:eager,vit_s14:64:official,vit_l14:32:compile,vit_l14:32:eager,"
           "vit_l14:32:official")


def op_category(name: str) -> str:
    """The estimate's category of a profiler event name (``aten::mm``, ``c10d::allreduce_``, ``triton_...``)."""
    if name.startswith("triton_") or "inductor" in name or "CompiledFunction" in name:
        return "fused"
    ns, _, op = name.rpartition("::")
    if ns in ("c10d", "_c10d_functional") or "nccl" in name.lower():
        return "comm"
    return category(op.split(".")[0], ns or "aten")


def group_kernels(prof, steps: int, cuda: bool) -> dict:
    """Per category: ms and kernels per step (CUDA: kernel durations charged to their launching op; CPU: the
    ops' self CPU time)."""
    cats: dict[str, dict] = defaultdict(lambda: {"ms": 0.0, "kernels": 0.0})
    top: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if cuda:
            ks = getattr(e, "kernels", None) or []
            for k in ks:
                c = cats[op_category(e.name)]
                c["ms"] += k.duration / 1e3 / steps
                c["kernels"] += 1 / steps
                top[f"{e.name} -> {k.name[:60]}"] += k.duration / 1e3 / steps
        elif e.name.startswith("aten::") and e.self_cpu_time_total > 0:
            c = cats[op_category(e.name)]
            c["ms"] += e.self_cpu_time_total / 1e3 / steps
            c["kernels"] += 1 / steps
            top[e.name] += e.self_cpu_time_total / 1e3 / steps
    return {"categories": {k: {"ms": round(v["ms"], 3), "kernels": round(v["kernels"], 1)} for k, v in cats.items()},
            "kernel_ms": round(sum(v["ms"] for v in cats.values()), 3),
            "kernels": round(sum(v["kernels"] for v in cats.values()), 1),
            "top": sorted(((k, round(v, 3)) for k, v in top.items()), key=lambda kv: -kv[1])[:15]}


def build(model: str, b: int, kind: str, cpu: bool, dev, info):
    """A zero-argument step for the case."""
    from dinopipe.app.gpu_check_train import _task_config
    from dinopipe.plan.trace import synthetic_batch

    dcfg = _task_config(cpu, compile_=kind == "compile" and not cpu, model=model, batch=b)
    if kind == "official":
        import official_dinov2 as off

        train_mod = off.import_official(REPO / ".official" / "dinov2", cpu=cpu)
        cfg = off.official_config(dcfg, model, b, "bf16")
        if cpu:
            for k in ("dino", "ibot"):
                cfg[k].head_n_prototypes, cfg[k].head_hidden_dim, cfg[k].head_bottleneck_dim = 128, 64, 32
        batch = gb._on_device(off.official_batch(cfg, b, torch.bfloat16), dev)
        with off.cpu_step_shims(cpu):
            st = off.OfficialStep(train_mod, cfg, dev, batch)

        def step():
            with off.cpu_step_shims(cpu):
                st.step()
        return step, {"xformers": off.SHIMS.get("xformers")}
    task, opt, values = gb.build_dinopipe(dcfg, info)
    batch = gb._on_device(synthetic_batch(dcfg, dcfg.phases[0], task.data_patch_size), dev)
    return (lambda: gb.dinopipe_step(task, opt, batch, values, dcfg.optim.clip_grad)), {}


def profile_case(step, dev, cpu: bool, warmup: int, steps: int = 3) -> dict:
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    gb._sync(dev)
    first = time.perf_counter() - t0
    acts = [ProfilerActivity.CPU] + ([] if cpu else [ProfilerActivity.CUDA])
    with profile(activities=acts) as prof:
        t1 = time.perf_counter()
        for _ in range(steps):
            step()
        gb._sync(dev)
        wall = (time.perf_counter() - t1) / steps
    r = group_kernels(prof, steps, cuda=not cpu)
    r.update(wall_ms=round(wall * 1e3, 2), warmup_s=round(first, 1),
             busy=round(r["kernel_ms"] / (wall * 1e3), 3) if not cpu else None)
    r["table"] = prof.key_averages().table(sort_by="self_cpu_time_total" if cpu else "self_cuda_time_total",
                                           row_limit=30, max_name_column_width=70)
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default="gpu-profile")
    ap.add_argument("--cases", default=DEFAULT, help="model:batch:{compile,eager,official},...")
    ap.add_argument("--budget-s", type=float, default=170.0, help="no case starts after this")
    ap.add_argument("--cpu", action="store_true", help="the CPU smoke even where CUDA is present")
    args = ap.parse_args(argv)
    cpu = args.cpu or not torch.cuda.is_available()
    dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
    try:
        cases = [(m, int(b), k) for m, b, k in (c.split(":") for c in args.cases.split(","))]
    except ValueError:
        print(f"error: --cases wants model:batch:kind[,...], got {args.cases!r}", file=sys.stderr)
        return 2
    if any(k not in ("compile", "eager", "official") for _, _, k in cases):
        print("error: a case's kind is compile, eager or official", file=sys.stderr)
        return 2
    if cpu:  # the smoke: every kind once, tiny
        cases = [("vit_test", 4, k) for k in dict.fromkeys(k for _, _, k in cases)]
    from dinopipe.app.gpu_check_train import _one_rank_group
    from dinopipe.train.parallel import configure_device_math

    configure_device_math(dev)
    info, _ = _one_rank_group(dev)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": "cpu" if cpu else torch.cuda.get_device_name(dev), "torch": torch.__version__,
              "what": "kernel time per step by the CPU estimate's categories (CPU smoke: self CPU time)", "cases": {}}
    end = time.monotonic() + args.budget_s
    for model, b, kind in cases:
        name = f"{model}_b{b}_{kind}"
        if time.monotonic() > end:
            report["cases"][name] = "skipped (budget)"
            continue
        try:
            step, extra = build(model, b, kind, cpu, dev, info)
            r = profile_case(step, dev, cpu, warmup=1 if cpu else 5)
            (out / f"{name}.txt").write_text(r.pop("table"))
            r.update(extra)
            report["cases"][name] = r
            cats = ", ".join(f"{k} {v['ms']:.1f}" for k, v in sorted(r["categories"].items(), key=lambda kv: -kv[1]["ms"]))
            print(f"{name}: wall {r['wall_ms']:.1f} ms/step, kernels {r['kernel_ms']:.1f} ms in {r['kernels']:.0f} "
                  f"(busy {r['busy']}), warm-up {r['warmup_s']} s; {cats}", flush=True)
        except Exception as exc:  # noqa: BLE001 -- a failing case is recorded, the rest run
            report["cases"][name] = {"error": f"{type(exc).__name__}: {exc}"[:1500]}
            print(f"{name}: FAILED {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc()
        step = None
        gb._cleanup(dev)
        (out / "profile.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
