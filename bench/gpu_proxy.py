"""``make gpu-proxy``: the GPU cost of dinopipe's training step and of the official DINOv2 step, estimated on a CPU.

Both steps run for real on fake tensors (no storage, no compute) at the sizes ``make gpu-bench`` times --
ViT-S/14 b=64 and ViT-L/14 b=32, 2x224 + 8x98 crops, bf16, one rank -- under dinopipe.plan.gpu_cost's
``CostRecorder``, which records every aten op's FLOPs, bytes and kernels; each op is then costed on the H100,
H200 and A100 datasheets (plan/gpu_cost.py says how and what it cannot see).

- dinopipe: ``plan.trace`` (the trainer's ``build_task`` on meta, ``parallelize_task`` over a fake one-rank
  process group -- at one rank FSDP2's mixed precision without FSDP2, train/mirror.py --, the loop's step order),
  AdamW fused as on CUDA (``ssl.base.adamw_impl``);
- official: ``SSLMetaArch`` (``make official-src``; bench/official_dinov2.py's config and shims) built on meta,
  materialised on fake tensors, FSDP1-wrapped by its own ``prepare_for_distributed_training``, stepped as its
  ``train.py`` loop body (schedules, forward_backward, per-module clip, AdamW with foreach as on CUDA, EMA).

The second of two steps is recorded (the first creates the optimizer state). The figures are the roofline sums, an
estimate, not a calibrated time: the four steps timed on a GPU (:data:`MEASURED`) mix a compiled dinopipe with an
eager official step and older code, so no like-for-like fit exists (a fit on them ran every error in dinopipe's
favour); they are printed first, as measured. Writes ``bench/results/gpu_proxy.json``; ``--render`` writes the
tables of docs/gpu.md and README.md from that JSON (between their markers).

    python bench/gpu_proxy.py [--out bench/results/gpu_proxy.json] [--cases vit_s14:64,vit_l14:32] [--small]
    python bench/gpu_proxy.py --render [--json bench/results/gpu_proxy.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402

from dinopipe.plan import gpu_cost as gc  # noqa: E402

OUT = REPO / "bench" / "results" / "gpu_proxy.json"
OFFICIAL = REPO / ".official" / "dinov2"
# Every training step timed on a GPU so far (docs/gpu.md, "Measured"), images/s: (gpu, model, b, code, images/s, note);
# shown beside the estimate, never fitted to it (not like-for-like: modes and code versions differ)
MEASURED = [
    ("H200", "vit_s14", 64, "dinopipe", 441.0, "2026-11-27, compiled, main after issue 29's step changes"),
    ("H200", "vit_s14", 64, "official", 526.0, "2026-11-27, eager, no xformers"),
    ("H200", "vit_l14", 32, "dinopipe", 100.0, "2026-11-27, compiled, code BEFORE issue 29's step changes"),
    ("H200", "vit_l14", 32, "official", 144.0, "2026-11-27, eager, no xformers"),
]
CONDITIONS_W = ("eager step, rank 0 of {w} on one node (fake process group): dinopipe FSDP2 as shipped, the official "
                "FSDP1 (SHARD_GRAD_OP); collectives on NVLink (450 GB/s a direction, 80%), bounds: comm exposed (sum) or "
                "overlapped (max); the official attends per crop group with SDPA (no xformers); bf16")
CONDITIONS = ("eager step, one rank: dinopipe without FSDP (train/mirror.py), the official FSDP1 at world size 1; "
              "the official attends per crop group with SDPA (no xformers); bf16; H100/H200/A100 datasheet rooflines")


def record_dinopipe(model: str, b: int, small: bool = False, world: int = 1) -> tuple[list, dict]:
    """dinopipe's real step under the recorder; (ops, extra figures)."""
    from dinopipe.app.gpu_check_train import _task_config
    from dinopipe.plan.trace import trace
    from dinopipe.ssl import base

    cfg = _task_config(small, False, model=model, batch=b)
    saved = base.adamw_impl
    base.adamw_impl = lambda device: {"fused": True}  # what the trainer picks on CUDA (the fake device is cpu)
    rec = gc.CostRecorder()
    try:
        res = trace(cfg, world, steps=2, comm_debug=False, recorder=rec)
    finally:
        base.adamw_impl = saved
    return rec.ops, {"peak_gib": res.peak_bytes / 2**30}


def record_official(model: str, b: int, small: bool = False, src: Path = OFFICIAL, world: int = 1,
                    prepare=None, recorder_hook=None) -> tuple[list, dict]:
    """The official SSLMetaArch step under the recorder; (ops, extra figures)."""
    import torch.distributed as dist

    import official_dinov2 as off
    from dinopipe.app.gpu_check_train import _task_config
    from dinopipe.utils import torch_compat as compat

    dist.init_process_group("fake", store=compat.fake_store(), rank=0, world_size=world)
    try:
        train_mod = off.import_official(src, cpu=True)
        from dinov2.train.ssl_meta_arch import SSLMetaArch

        if world > 1:
            _official_reshard_shim()

        dcfg = _task_config(small, False, model=model, batch=b)
        cfg = off.official_config(dcfg, model, b, "bf16")
        if small:
            for k in ("dino", "ibot"):
                cfg[k].head_n_prototypes, cfg[k].head_hidden_dim, cfg[k].head_bottleneck_dim = 128, 64, 32
        batch = off.official_batch(cfg, b, torch.bfloat16)
        with torch.device("meta"):
            m = SSLMetaArch(cfg)
        fake = compat.fake_tensor_mode(allow_non_fake_inputs=True)
        rec = gc.CostRecorder()
        if recorder_hook is not None:  # bench/gpu_proxy_compiled.py: its compiled regions report into the recorder
            recorder_hook(rec)
        # peak memory: torch's MemTracker registers grad hooks on every parameter and FSDP1's frozen teacher
        # refuses them, so the official side's traced peak is not available here (gpu-bench measures both)
        peak = None
        with off.cpu_step_shims(True), fake:
            m.to_empty(device="cpu")  # materialised without values (its init_weights reads them)
            if prepare is not None:
                prepare(m)
            m.prepare_for_distributed_training()
            m.train()
            opt = train_mod.build_optimizer(cfg, m.get_params_groups())
            for g in opt.param_groups:
                g["foreach"] = True  # torch's AdamW default on CUDA tensors (the fake device is cpu)
            fb = {k: fake.from_tensor(v) if torch.is_tensor(v) else v for k, v in batch.items()}
            with rec:
                for k in range(2):
                    rec.active = k == 1
                    train_mod.apply_optim_scheduler(opt, 1e-4, 0.04, 1e-4)
                    opt.zero_grad(set_to_none=True)
                    m.forward_backward(fb, teacher_temp=0.07)
                    for v in m.student.values():
                        v.clip_grad_norm_(cfg.optim.clip_grad)
                    opt.step()
                    m.update_teacher(0.994)
        return rec.ops, {"peak_gib": peak, "shims": dict(off.SHIMS)}
    finally:
        dist.destroy_process_group()


def _official_reshard_shim() -> None:
    """The official ``free_if_fsdp`` reads FSDP1's ``_handles`` (torch 2.0); torch >= 2.1 keeps one ``_handle``.
    Sharded (W > 1) only: the teacher's unsharded parameters freed after its forward, as the official code means."""
    import dinov2.fsdp as ofsdp
    from torch.distributed.fsdp._runtime_utils import _reshard

    def free_if_fsdp(x):
        if ofsdp.is_sharded_fsdp(x) and x._handle is not None:
            try:
                _reshard(x, x._handle, True)
            except AssertionError:  # not unsharded at this point (nothing to free)
                pass
    ofsdp.free_if_fsdp = free_if_fsdp


def case_summary(ops: list, extra: dict, world: int = 1) -> dict:
    out = {g: gc.summarise(ops, gpu, world) for g, gpu in gc.GPUS.items()}
    out["top_h200"] = gc.top_ops(ops, gc.GPUS["H200"])
    out.update(extra)
    return out


def derive(cases: dict) -> None:
    """Per case and GPU: the ratios dinopipe / official of the roofline (speed), kernels and bytes."""
    for c in cases.values():
        c["ratio"] = {}
        for g in gc.GPUS:
            d, o = c["dinopipe"][g]["total"], c["official"][g]["total"]
            c["ratio"][g] = {"roofline": o["ms"] / d["ms"], "kernels": d["kernels"] / o["kernels"],
                             "bytes": d["gb"] / o["gb"]}
            if "ms_overlapped" in d:  # W > 1: comm hidden behind compute
                c["ratio"][g]["roofline_overlapped"] = o["ms_overlapped"] / d["ms_overlapped"]


def print_case(name: str, c: dict) -> None:
    print(f"== {name} (H200 datasheet; roofline ms / kernels / GFLOP / GB, dinopipe | official)")
    dc, oc = c["dinopipe"]["H200"]["categories"], c["official"]["H200"]["categories"]
    for cat in gc.CATEGORIES:
        d, o = dc[cat], oc[cat]
        print(f"  {cat:14s} {d['ms']:7.2f} {d['kernels']:5d} {d['gflop']:8.0f} {d['gb']:6.1f} | "
              f"{o['ms']:7.2f} {o['kernels']:5d} {o['gflop']:8.0f} {o['gb']:6.1f}")
    for g in gc.GPUS:
        d, o, r = c["dinopipe"][g]["total"], c["official"][g]["total"], c["ratio"][g]
        line = (f"  {g}: roofline {d['ms']:.1f} vs {o['ms']:.1f} ms (speed ratio {r['roofline']:.2f}), kernels "
                f"{d['kernels']} vs {o['kernels']} ({r['kernels']:.2f}), GB {d['gb']:.1f} vs {o['gb']:.1f} "
                f"({r['bytes']:.2f}), MFU {d['mfu']:.1%} vs {o['mfu']:.1%}")
        if "ms_overlapped" in d:
            line += (f"; W={d['world']}: compute {d['compute_ms']:.1f} vs {o['compute_ms']:.1f} ms, comm "
                     f"{c['dinopipe'][g]['categories']['comm']['ms']:.1f} vs {c['official'][g]['categories']['comm']['ms']:.1f}"
                     f" ms, overlapped ratio {r['roofline_overlapped']:.2f}")
        print(line)
    print(f"  traced peak GiB: dinopipe {c['dinopipe'].get('peak_gib') or float('nan'):.2f}, official "
          f"{c['official'].get('peak_gib') or float('nan'):.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--cases", default="vit_s14:64,vit_l14:32")
    ap.add_argument("--small", action="store_true", help="vit_test, b=4, tiny heads (the smoke)")
    ap.add_argument("--official", default=str(OFFICIAL), help="the official source (make official-src)")
    ap.add_argument("--world", type=int, default=1,
                    help="ranks of one node (fake process group): dinopipe FSDP2 as shipped, the official FSDP1")
    ap.add_argument("--render", action="store_true", help="write docs/gpu.md and README.md tables from --json")
    ap.add_argument("--json", default=str(OUT))
    args = ap.parse_args(argv)
    if args.render:
        sys.path.insert(0, str(Path(__file__).resolve().parent / "tools"))  # the renderers live in bench/tools/
        import gpu_proxy_tables

        return gpu_proxy_tables.render(Path(args.json))
    src = Path(args.official)
    if not (src / "dinov2").is_dir():
        print(f"error: no official dinov2 source at {src}: run `make official-src` first", file=sys.stderr)
        return 2
    try:
        cases_arg = [(m, int(b)) for m, b in (c.split(":") for c in args.cases.split(","))]
    except ValueError:
        print(f"error: --cases wants model:batch[,model:batch], got {args.cases!r}", file=sys.stderr)
        return 2
    if args.small:
        cases_arg = [("vit_test", 4)]
    warnings.filterwarnings("ignore")
    cases: dict = {}
    for model, b in cases_arg:
        t0 = time.perf_counter()
        name = f"{model}_b{b}"
        d_ops, d_extra = record_dinopipe(model, b, args.small, args.world)
        o_ops, o_extra = record_official(model, b, args.small, src, args.world)
        cases[name] = {"dinopipe": case_summary(d_ops, d_extra, args.world),
                       "official": case_summary(o_ops, o_extra, args.world),
                       "trace_s": round(time.perf_counter() - t0, 1)}
    derive(cases)
    for name, c in cases.items():
        print_case(name, c)
    report = {"torch": torch.__version__, "gpus": {k: vars(v) for k, v in gc.GPUS.items()}, "eff": gc.EFF,
              "floor_us": gc.FLOOR_S * 1e6, "measured": [dict(zip(("gpu", "model", "b", "code", "images_per_s", "note"),
                                                                   m)) for m in MEASURED],
              "conditions": CONDITIONS if args.world == 1 else CONDITIONS_W.format(w=args.world),
              "world": args.world, "cases": cases}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
