"""ViT-S/14 backbone benches (fp32, fwd+bwd, train mode), printed as ratios measured in one run.

    python bench/bench_vit.py                 # batch 16, 5 rounds (~10 min on 2 cores)
    python bench/bench_vit.py --quick         # batch 4, 3 rounds, smaller attention batch (~2 min)
    python bench/bench_vit.py --json out.json # also write every raw number

Lines ``name: X.XX`` (goals from issue 2):
- ``stochastic_depth_speedup``: masked DropPath step time / efficient (subset + index_add) step time, d=0.4
  on every block, same model and weights, 224 px. Goal >= 1.6.
- ``attn518_sdpa_over_math_memory`` / ``_time``: the attention *op* (q, k, v -> out, fwd+bwd) with the real
  518 px shapes (B, 6 heads, 1370 tokens, 64 dims), laid out as the model lays them out (views of one qkv
  GEMM output). Memory is the torch allocator peak above the live set (see common.py). Goals <= 0.3, <= 1.0.
- ``res518_time_over_flop_ratio``: (per-image step time at 518 / at 224) / (per-image FLOPs at 518 / at
  224), FLOPs from the planner's model (``dinopipe.plan.crop_forward_flops``: patch embedding + per block
  the linear layers' 24 N d^2 and attention's 4 N^2 d). 518 runs at a batch with about as many tokens as the 224
  batch. 1.0 means time grows exactly like FLOPs. Goal <= 1.15.
- ``train_step_mfu``: analytic model FLOPs (3 x forward: blocks + patch embed) per second of the 224 px
  fwd+bwd step, over the FLOP rate of a fp32 2048^2 GEMM timed in the same rounds. Goal >= 0.75.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common as C  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dinopipe  # noqa: E402
from dinopipe.models.attention import math_attention  # noqa: E402
from dinopipe.plan import backbone_arch, crop_forward_flops  # noqa: E402

ARCH = "vit_s14"
DIM, DEPTH, HEADS, PATCH = 384, 12, 6, 14


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=None, help="batch at 224 px (default 16, --quick 4)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5, --quick 3)")
    p.add_argument("--quick", action="store_true", help="smaller, faster run for a smoke check")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="write all raw numbers to this file")
    p.add_argument("--only", default=None, help="comma list of: droppath,attn,res (default all)")
    p.add_argument("--probe", default=None, help=argparse.SUPPRESS)  # internal: one RSS measurement
    args = p.parse_args(argv)
    args.batch = args.batch or (4 if args.quick else 16)
    args.repeats = args.repeats or (3 if args.quick else 5)
    # 518 px batch with about the tokens of the 224 px batch (257 vs 1370 tokens per image).
    args.batch518 = max(1, round(args.batch * 257 / 1370))
    return args


def train_step(model: torch.nn.Module, x: torch.Tensor):
    """One fwd+bwd; the loss touches every output token so the whole graph is differentiated."""
    def step() -> None:
        model.zero_grad(set_to_none=True)
        out = model.forward_features(x)
        (out["x_norm_patchtokens"].square().mean() + out["x_norm_clstoken"].square().mean()).backward()
    return step


# -- 1. efficient stochastic depth vs masked DropPath --------------------------------------------------
def bench_droppath(args) -> dict:
    model = dinopipe.create_model(ARCH, img_size=224, drop_path_rate=0.4, drop_path_uniform=True,
                                  efficient_drop_path=True, attn_backend="sdpa").to(args.device).train()
    x = torch.randn(args.batch, 3, 224, 224, device=args.device)
    step = train_step(model, x)

    def with_mode(efficient: bool):
        def run() -> None:
            for blk in model.blocks:  # same module, same weights: only the residual path changes
                blk.efficient_drop_path = efficient
            step()
        return run

    t = C.interleaved_times({"efficient": with_mode(True), "masked": with_mode(False)},
                            args.repeats, device=args.device)
    speedup = C.paired_ratio(t["masked"], t["efficient"])
    k = max(1, int(args.batch * 0.6))
    return dict(times=t, speedup=speedup, kept=k, ideal_speedup=args.batch / k)


# -- 2. attention op at 518 px: sdpa vs math ------------------------------------------------------------
def attention_op(backend: str, batch: int, device: str):
    """fwd+bwd of the attention op alone, shapes and strides as in Attention.forward at 518 px."""
    n = (518 // PATCH) ** 2 + 1  # 1370
    hd = DIM // HEADS
    qkv = torch.randn(batch * n, 3 * DIM, device=device, requires_grad=True)  # (T, 3D) like the qkv GEMM out
    grad_out = torch.randn(batch * n, DIM, device=device)

    def run() -> None:
        qkv.grad = None
        q, k, v = qkv.view(batch, n, 3, HEADS, hd).permute(2, 0, 3, 1, 4)  # each (B, H, N, hd)
        o = F.scaled_dot_product_attention(q, k, v) if backend == "sdpa" else math_attention(q, k, v)
        o.transpose(1, 2).reshape(batch * n, DIM).backward(grad_out)
    run.reset = lambda: setattr(qkv, "grad", None)  # type: ignore[attr-defined]
    return run


def bench_attention(args) -> dict:
    b = args.batch518
    fns = {name: attention_op(name, b, args.device) for name in ("sdpa", "math")}
    t = C.interleaved_times(fns, args.repeats, device=args.device)
    mem = {name: C.torch_peak_bytes(fn, args.device, before=fn.reset) for name, fn in fns.items()}
    res = dict(batch=b, times=t, torch_peak_bytes=mem,
               time_ratio=C.paired_ratio(t["sdpa"], t["math"]), memory_ratio=mem["sdpa"] / mem["math"])
    if args.device == "cpu" and sys.platform.startswith("linux"):
        here = os.path.abspath(__file__)
        rss = {name: C.run_probe(here, ["--probe", f"attn:{name}:{b}", "--threads", str(args.threads)])
               ["rss_peak_bytes"] for name in fns}
        res["rss_peak_bytes"] = rss
        res["rss_memory_ratio"] = rss["sdpa"] / max(1, rss["math"])
    if not args.quick:  # context: the whole model at 518 px, batch 1, torch allocator peak of fwd+bwd
        model = dinopipe.create_model(ARCH, img_size=224).to(args.device).train()
        x = torch.randn(1, 3, 518, 518, device=args.device)
        full = {}
        for name in ("sdpa", "math"):
            model.set_attn_backend(name)
            step = train_step(model, x)
            step()  # warm-up; grads are dropped before measuring, so both count their allocation
            full[name] = C.torch_peak_bytes(step, args.device, before=lambda: model.zero_grad(set_to_none=True))
        res["full_model_b1_torch_peak_bytes"] = full
    return res


def probe(spec: str, threads: int) -> None:
    """Subprocess entry: RSS peak of one attention op fwd+bwd after a warm-up; prints one JSON line."""
    C.setup(threads)
    kind, backend, batch = spec.split(":")
    assert kind == "attn", spec
    fn = attention_op(backend, int(batch), "cpu")
    fn()
    fn.reset()
    print(json.dumps({"rss_peak_bytes": C.rss_peak_bytes(fn)}))


# -- 3 + 4. resolution scaling and MFU, with the GEMM reference in the same rounds ---------------------
def bench_res_mfu(args) -> dict:
    model = dinopipe.create_model(ARCH, img_size=224, attn_backend="sdpa").to(args.device).train()
    b224, b518 = args.batch, args.batch518
    x224 = torch.randn(b224, 3, 224, 224, device=args.device)
    x518 = torch.randn(b518, 3, 518, 518, device=args.device)
    gemm = C.Gemm(2048, device=args.device)
    t = C.interleaved_times({"train224": train_step(model, x224), "train518": train_step(model, x518),
                             "gemm": gemm}, args.repeats, device=args.device)

    arch = backbone_arch(model)  # the planner's FLOP model (dinopipe plan), not a second copy here
    fwd224 = crop_forward_flops(arch, 224)
    model_flops = 3 * fwd224 * b224
    gemm_rates = [gemm.rate(s) for s in t["gemm"]]
    mfu = C.median((model_flops / a) / g for a, g in zip(t["train224"], gemm_rates))

    flop_ratio = crop_forward_flops(arch, 518) / crop_forward_flops(arch, 224)
    time_ratio = C.paired_ratio([s / b518 for s in t["train518"]], [s / b224 for s in t["train224"]])

    counted = C.counted_flops(train_step(model, x224[:1])) * b224  # cross-check of the analytic count
    return dict(times=t, batch224=b224, batch518=b518, model_flops=model_flops, counted_flops=counted,
                gemm_flops_per_s=C.median(gemm_rates), model_flops_per_s=model_flops / C.median(t["train224"]),
                mfu=mfu, flop_ratio=flop_ratio, per_image_time_ratio=time_ratio,
                res_ratio=time_ratio / flop_ratio)


# -- report ---------------------------------------------------------------------------------------------
def report(args, res: dict) -> None:
    rows, lines = [], []
    if "droppath" in res:
        d = res["droppath"]
        rows += [("drop path d=0.4, efficient step", C.fmt_s(C.median(d["times"]["efficient"])),
                  f"B={args.batch}, k={d['kept']} kept"),
                 ("drop path d=0.4, masked step", C.fmt_s(C.median(d["times"]["masked"])),
                  f"ideal speedup B/k = {d['ideal_speedup']:.2f}")]
        lines.append(("stochastic_depth_speedup", d["speedup"], ">= 1.6"))
    if "attn" in res:
        a = res["attn"]
        for name in ("sdpa", "math"):
            extra = f"torch peak {C.fmt_bytes(a['torch_peak_bytes'][name])}"
            if "rss_peak_bytes" in a:
                extra += f", RSS peak {C.fmt_bytes(a['rss_peak_bytes'][name])}"
            rows.append((f"attn op 518px B={a['batch']} fwd+bwd, {name}", C.fmt_s(C.median(a["times"][name])), extra))
        if "rss_memory_ratio" in a:
            rows.append(("attn op RSS peak ratio sdpa/math", f"{a['rss_memory_ratio']:.2f}", "cross-check"))
        if "full_model_b1_torch_peak_bytes" in a:
            f = a["full_model_b1_torch_peak_bytes"]
            rows.append(("full model 518px B=1 fwd+bwd peak", f"sdpa {C.fmt_bytes(f['sdpa'])}",
                         f"math {C.fmt_bytes(f['math'])} (ratio {f['sdpa'] / f['math']:.2f}, context only)"))
        lines += [("attn518_sdpa_over_math_memory", a["memory_ratio"], "<= 0.3"),
                  ("attn518_sdpa_over_math_time", a["time_ratio"], "<= 1.0")]
    if "res" in res:
        r = res["res"]
        rows += [(f"train step 224px B={r['batch224']}", C.fmt_s(C.median(r["times"]["train224"])),
                  f"{C.fmt_s(C.median(r['times']['train224']) / r['batch224'])}/img"),
                 (f"train step 518px B={r['batch518']}", C.fmt_s(C.median(r["times"]["train518"])),
                  f"{C.fmt_s(C.median(r['times']['train518']) / r['batch518'])}/img, FLOP ratio "
                  f"{r['flop_ratio']:.2f}, time ratio {r['per_image_time_ratio']:.2f}"),
                 ("fp32 2048^2 GEMM", f"{r['gemm_flops_per_s'] / 1e9:.1f} GFLOP/s", "reference"),
                 ("train step 224px model FLOP rate", f"{r['model_flops_per_s'] / 1e9:.1f} GFLOP/s",
                  f"analytic {r['model_flops'] / 1e9:.0f} GFLOP/step; FlopCounterMode "
                  f"{r['counted_flops'] / 1e9:.0f}")]
        lines += [("res518_time_over_flop_ratio", r["res_ratio"], "<= 1.15"),
                  ("train_step_mfu", r["mfu"], ">= 0.75")]
    C.print_table(f"{ARCH}, fp32 {args.device}, {torch.get_num_threads()} threads, "
                  f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '')}, median of {args.repeats} "
                  f"interleaved rounds", rows, ("measurement", "median", "notes"))
    C.print_table("ratios vs goals", [(n, f"{v:.2f}", g, "ok" if C.meets_goal(v, g) else "MISSED")
                                      for n, v, g in lines], ("name", "value", "goal", ""))
    print()
    for name, value, _ in lines:
        C.print_ratio(name, value)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.probe:
        probe(args.probe, args.threads)
        return 0
    C.setup(args.threads)
    only = set((args.only or "droppath,attn,res").split(","))
    unknown = only - {"droppath", "attn", "res"}
    if unknown:
        print(f"--only: unknown bench(es) {sorted(unknown)}; choose from droppath, attn, res", file=sys.stderr)
        return 2
    res = {}
    if "droppath" in only:
        res["droppath"] = bench_droppath(args)
    if "attn" in only:
        res["attn"] = bench_attention(args)
    if "res" in only:
        res["res"] = bench_res_mfu(args)
    report(args, res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), results=res), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
