"""``make gpu-proxy-compiled``: the GPU cost of the *compiled* training steps, estimated on a CPU.

The steps of bench/gpu_proxy.py (same sizes, bf16, one rank, fake tensors), compiled as users run them:

- dinopipe with its recipe settings (``parallel.compile=true``: each block, the DINO/iBOT heads and the losses
  ``torch.compile(fullgraph=True, dynamic=True)``, plan/trace.py's ``compile_backend``);
- the official ``SSLMetaArch`` with each backbone block compiled the same way (``dynamic=True``; the official
  code compiles nothing itself).

Each compiled region goes through plan/inductor_cost.py: AOTAutograd's forward and backward graphs, lowered by
inductor for a pretend Hopper GPU, one cost per generated Triton kernel (inductor's bytes) or extern kernel (the
aten formulas); the rest of the step (FSDP, optimizer, EMA) keeps its eager op stream. Writes
``bench/results/gpu_proxy_compiled.json`` beside the eager estimate.

    python bench/gpu_proxy_compiled.py [--cases vit_s14:64,vit_l14:32] [--sides dinopipe,official] [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from unittest import mock

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402

import gpu_proxy as gp  # noqa: E402
from dinopipe.plan import gpu_cost as gc  # noqa: E402
from dinopipe.plan.inductor_cost import CompiledCost, compile_outside_modes  # noqa: E402

OUT = REPO / "bench" / "results" / "gpu_proxy_compiled.json"


def record_dinopipe(model: str, b: int, small: bool = False) -> tuple[list, dict]:
    from dinopipe.app.gpu_check_train import _task_config
    from dinopipe.plan.trace import trace
    from dinopipe.ssl import base

    cfg = _task_config(small, True, model=model, batch=b)
    saved = base.adamw_impl
    base.adamw_impl = lambda device: {"fused": True}
    rec = gc.CostRecorder()
    cc = CompiledCost(rec)
    try:
        with mock.patch.object(torch, "compile", compile_outside_modes()):
            trace(cfg, 1, steps=2, comm_debug=False, recorder=rec, compile_backend=cc.backend())
    finally:
        base.adamw_impl = saved
    return rec.ops, {"regions": len(cc.regions)}


def compile_official_blocks(m, backend) -> int:
    """Each block of the student and teacher backbones compiled as dinopipe compiles its own."""
    n = 0
    for side in (m.student, m.teacher):
        for blk in side.backbone.blocks.modules():
            if type(blk).__name__.endswith("Block") and hasattr(blk, "attn"):
                blk.forward = compile_outside_modes()(blk.forward, backend=backend, dynamic=True)
                n += 1
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--cases", default="vit_s14:64,vit_l14:32")
    ap.add_argument("--sides", default="dinopipe,official")
    ap.add_argument("--small", action="store_true", help="vit_test, b=4, tiny heads (the smoke)")
    ap.add_argument("--official", default=str(gp.OFFICIAL))
    args = ap.parse_args(argv)
    src = Path(args.official)
    sides = args.sides.split(",")
    if "official" in sides and not (src / "dinov2").is_dir():
        print(f"error: no official dinov2 source at {src}: run `make official-src` first", file=sys.stderr)
        return 2
    cases_arg = [("vit_test", 4)] if args.small else [(m, int(b)) for m, b in
                                                      (c.split(":") for c in args.cases.split(","))]
    warnings.filterwarnings("ignore")
    torch._dynamo.config.cache_size_limit = 64
    out = Path(args.out)
    report = json.loads(out.read_text()) if out.is_file() else {"cases": {}}
    for model, b in cases_arg:
        name = f"{model}_b{b}"
        case = report["cases"].setdefault(name, {})
        for side in sides:
            t0 = time.perf_counter()
            if side == "dinopipe":
                ops, extra = record_dinopipe(model, b, args.small)
            else:
                cc = CompiledCost()
                ops, extra = gp.record_official(model, b, args.small, src,
                                                prepare=lambda m: compile_official_blocks(m, cc.backend()),
                                                recorder_hook=lambda rec: setattr(cc, "recorder", rec))
                extra["regions"] = len(cc.regions)
            case[side] = gp.case_summary(ops, extra)
            case[side]["trace_s"] = round(time.perf_counter() - t0, 1)
            t = case[side]["H200"]["total"]
            print(f"{name} {side} compiled: H200 roofline {t['ms']:.2f} ms, {t['kernels']} kernels, {t['gb']:.1f} GB "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        if "dinopipe" in case and "official" in case:
            gp.derive({name: case})
            r = case["ratio"]["H200"]
            print(f"{name} compiled, H200: speed {r['roofline']:.2f}, kernels {r['kernels']:.2f}, bytes {r['bytes']:.2f}")
    report.update(torch=torch.__version__, conditions="compiled (inductor codegen for a pretend SM 9.0 GPU; Triton "
                  "kernels costed on inductor's bytes, extern kernels on the aten formulas), one rank, bf16; dinopipe "
                  "parallel.compile=true as shipped, the official step's backbone blocks compiled the same way")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
